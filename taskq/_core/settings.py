"""Settings: where Kafka, the registry and Postgres are, and the namespace. Environment is read here only."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from types import MappingProxyType
from typing import Any
from urllib.parse import unquote

from taskq._core.durations import DEFAULT_DELAY_TIERS, parse_duration
from taskq._core.errors import ConfigurationError

_NAMESPACE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}$")
#: librdkafka settings the project sets itself; passing them through TASKQ_KAFKA_* would break a guarantee
#: (or, for the assignors, the spread of every tier over a group). The other defaults taskq picks (linger,
#: compression, fetch waits) are tuning: a TASKQ_KAFKA_* setting replaces them.
_RESERVED_KAFKA = frozenset(
    {
        "bootstrap.servers",
        "enable.idempotence",
        "acks",
        "enable.auto.commit",
        "enable.auto.offset.store",
        "isolation.level",
        "auto.offset.reset",
        "group.id",
        "group.protocol",
        "group.remote.assignor",
        "partition.assignment.strategy",
        "transactional.id",
    }
)
#: Kafka's consumer group protocols: the broker-driven one (KIP-848) and the classic join/sync one.
GROUP_PROTOCOLS = ("consumer", "classic")


#: What `taskq dlq show` hides unless TASKQ_DLQ_REDACT says otherwise: headers and payload fields by name
#: (`*` matches any run of characters, case is ignored).
DEFAULT_DLQ_REDACT = (
    "authorization",
    "proxy-authorization",
    "cookie",
    "set-cookie",
    "*password*",
    "*passwd*",
    "*secret*",
    "*token*",
    "*api-key*",
    "*api_key*",
    "*apikey*",
    "*credential*",
)

#: Settings that hold secrets: never shown, not even in a repr.
_SECRET_FIELDS = frozenset({"schema_registry_password", "schema_registry_token"})
#: librdkafka properties that hold secrets (sasl.password, ssl.key.password, sasl.jaas.config, ...).
_SECRET_KAFKA = re.compile(r"password|secret|token|jaas|oauthbearer\.config|key\.pem", re.IGNORECASE)

_URL_PASSWORD = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s:/@]*:)[^\s]*@")
_PARAM_SECRET = re.compile(
    r"(\b(?:password|passwd|pwd|token|secret|api[_-]?key|sasl\.password)\s*[=:]\s*)('[^']*'|[^\s&;,]+)",
    re.IGNORECASE,
)


def redact(text: str, *urls: str, secrets: Iterable[str] = ()) -> str:
    """`text` without credentials: the password of any URL in it (even one holding '@' or a bad %-escape),
    password=/token=/secret= parameters, the passwords of `urls` and the `secrets` (passwords and tokens
    given outside a URL) wherever they appear (a driver may quote one back in an error). Every message that
    can carry a setting goes through here."""
    for secret in [*(_password_of(url) for url in urls), *secrets]:
        if secret:
            text = text.replace(secret, "***")
            text = text.replace(unquote(secret), "***")
    text = _URL_PASSWORD.sub(r"\1***@", text)
    return _PARAM_SECRET.sub(r"\1***", text)


def _password_of(url: str) -> str:
    """The password part of a URL as written (without decoding it: a bad %-escape must not break this)."""
    rest = url.partition("://")[2]
    authority = rest.rsplit("@", 1)[0] if "@" in rest else ""
    return authority.partition(":")[2]


def _setting(default: Any = dataclasses.MISSING, *, doc: str, env: str = "", factory: Any = None) -> Any:
    """A settings field with its description and environment variable, which the settings reference
    (docs) and `Settings.from_env` read."""
    metadata = {"doc": doc, "env": env}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Where the services are and how topics are named; frozen and validated when created."""

    bootstrap_servers: str = _setting(
        "127.0.0.1:19092", env="TASKQ_BOOTSTRAP_SERVERS", doc="Kafka brokers to start from, `host:port,...`."
    )
    schema_registry_url: str = _setting(
        "http://127.0.0.1:18081/apis/ccompat/v7",
        env="TASKQ_SCHEMA_REGISTRY_URL",
        doc="The schema registry's Confluent-compatible REST API (Apicurio's `ccompat/v7`, or Confluent's).",
    )
    database_url: str = _setting(
        "postgresql://postgres@127.0.0.1:15432/taskq",
        env="TASKQ_DATABASE_URL",
        doc="Postgres, as a libpq connection URL: idempotency records, outbox, leases, buckets, pauses.",
    )
    namespace: str = _setting(
        "taskq",
        env="TASKQ_NAMESPACE",
        doc="Topic prefix: `<namespace>.<tier>`, `.delay.<tier>`, `.dlq`; also scopes idempotency records.",
    )
    database_schema: str = _setting(
        "public",
        env="TASKQ_DATABASE_SCHEMA",
        doc="Postgres schema holding the project's tables (tests give each namespace its own).",
    )
    kafka: Mapping[str, str] = _setting(
        factory=lambda: MappingProxyType({}),
        env="TASKQ_KAFKA_*",
        doc="Extra librdkafka properties (SASL/SSL and the like), passed through unchanged: "
        "`TASKQ_KAFKA_SASL_MECHANISM` becomes `sasl.mechanism`.",
    )
    delay_tiers: tuple[timedelta, ...] = _setting(
        DEFAULT_DELAY_TIERS,
        env="TASKQ_DELAY_TIERS",
        doc="Delay-tier topics' durations, comma-separated (`1s,5s,30s,2m,10m,1h`).",
    )
    worker_group: str = _setting(
        "",
        env="TASKQ_WORKER_GROUP",
        doc="Consumer group of the workers (empty: `<namespace>.workers`); the producer's depth limits "
        "read its committed offsets.",
    )
    group_protocol: str = _setting(
        "consumer",
        env="TASKQ_GROUP_PROTOCOL",
        doc="Kafka's group protocol: `consumer` (KIP-848, Kafka 4.0+ brokers) or `classic` (older brokers).",
    )
    kafka_timeout: float = _setting(
        30.0,
        doc="Seconds an admin request (topics, offsets) waits for the broker; the CLI's one-off commands "
        "use 10, so that an unreachable broker is reported in about that long.",
    )
    schema_registry_user: str = _setting(
        "", env="TASKQ_SCHEMA_REGISTRY_USER", doc="Registry HTTP basic auth user (with the password)."
    )
    schema_registry_password: str = _setting(
        "", env="TASKQ_SCHEMA_REGISTRY_PASSWORD", doc="Registry HTTP basic auth password; never shown."
    )
    schema_registry_token: str = _setting(
        "",
        env="TASKQ_SCHEMA_REGISTRY_TOKEN",
        doc="Registry bearer token (instead of a user and password); never shown.",
    )
    schema_registry_ca_file: str = _setting(
        "",
        env="TASKQ_SCHEMA_REGISTRY_CA_FILE",
        doc="PEM file of the CA that signed the registry's certificate (empty: the system's, or certifi's).",
    )
    schema_registry_cert_file: str = _setting(
        "",
        env="TASKQ_SCHEMA_REGISTRY_CERT_FILE",
        doc="PEM client certificate, where the registry asks for one.",
    )
    schema_registry_key_file: str = _setting(
        "", env="TASKQ_SCHEMA_REGISTRY_KEY_FILE", doc="PEM key of the client certificate."
    )
    dlq_redact: tuple[str, ...] = _setting(
        DEFAULT_DLQ_REDACT,
        env="TASKQ_DLQ_REDACT",
        doc="Headers and payload fields `taskq dlq show` prints as `***`: names, dotted paths or `*` "
        "patterns, comma-separated (set but empty: nothing is hidden).",
    )

    def __post_init__(self) -> None:
        if not _NAMESPACE.match(self.namespace):
            raise ConfigurationError(
                f"namespace {self.namespace!r} is not a valid Kafka topic prefix: "
                "use letters, digits, '.', '_' or '-', at most 200 characters"
            )
        if not re.match(r"^[a-z_][a-z0-9_]{0,62}$", self.database_schema):
            raise ConfigurationError(
                f"database_schema {self.database_schema!r} must be a lower-case SQL identifier "
                "of at most 63 chars"
            )
        if not self.schema_registry_url.lower().startswith(("http://", "https://")):
            raise ConfigurationError(
                "schema_registry_url must be an http:// or https:// URL, "
                f"got {redact(self.schema_registry_url, self.schema_registry_url)!r}"
            )
        if not self.bootstrap_servers:
            raise ConfigurationError("bootstrap_servers must name at least one broker (host:port)")
        if not self.delay_tiers or any(t <= timedelta(0) for t in self.delay_tiers):
            shown = ", ".join(f"{t.total_seconds():g}s" for t in self.delay_tiers)
            raise ConfigurationError(f"delay_tiers must be positive durations, got {shown or 'none'}")
        if self.group_protocol not in GROUP_PROTOCOLS:
            raise ConfigurationError(
                f"group_protocol must be one of {', '.join(GROUP_PROTOCOLS)}, got {self.group_protocol!r}"
            )
        if not 0 < self.kafka_timeout <= 3600:  # also refuses nan
            raise ConfigurationError(
                f"kafka_timeout must be in (0, 3600] seconds, got {self.kafka_timeout!r}"
            )
        self._validate_registry_auth()
        if isinstance(self.dlq_redact, str) or any(not n.strip() or n != n.strip() for n in self.dlq_redact):
            raise ConfigurationError(
                f"dlq_redact must be names, each non-empty and unpadded, got {self.dlq_redact!r}"
            )
        object.__setattr__(self, "dlq_redact", tuple(self.dlq_redact))
        reserved = _RESERVED_KAFKA & set(self.kafka)
        if reserved:
            raise ConfigurationError(
                f"kafka settings {sorted(reserved)} are set by taskq itself and cannot be overridden"
            )
        object.__setattr__(self, "kafka", MappingProxyType(dict(self.kafka)))
        object.__setattr__(self, "delay_tiers", tuple(sorted(set(self.delay_tiers))))
        if not self.worker_group:
            object.__setattr__(self, "worker_group", f"{self.namespace}.workers")

    def _validate_registry_auth(self) -> None:
        basic = bool(self.schema_registry_user or self.schema_registry_password)
        if basic and not (self.schema_registry_user and self.schema_registry_password):
            raise ConfigurationError(
                "schema registry basic auth needs both TASKQ_SCHEMA_REGISTRY_USER and "
                "TASKQ_SCHEMA_REGISTRY_PASSWORD"
            )
        if basic and self.schema_registry_token:
            raise ConfigurationError(
                "schema registry credentials: give a user and password or a token, not both"
            )
        authority = re.split(r"[/?#]", self.schema_registry_url.partition("://")[2], maxsplit=1)[0]
        if (basic or self.schema_registry_token) and "@" in authority:
            raise ConfigurationError(
                "schema registry credentials are both in TASKQ_SCHEMA_REGISTRY_URL and in settings: "
                "keep one (the settings keep them out of the URL)"
            )
        if self.schema_registry_key_file and not self.schema_registry_cert_file:
            raise ConfigurationError(
                "TASKQ_SCHEMA_REGISTRY_KEY_FILE needs TASKQ_SCHEMA_REGISTRY_CERT_FILE, the client certificate"
            )

    def __repr__(self) -> str:
        # Settings get logged and shown in test reports: no password, token or secret in their repr.
        shown = []
        for f in dataclasses.fields(self):
            value: Any = getattr(self, f.name)
            if f.name in _SECRET_FIELDS:
                value = "***" if value else ""
            elif f.name.endswith("_url"):
                value = redact(value, value)
            elif f.name == "kafka":
                value = {k: "***" if _SECRET_KAFKA.search(k) else redact(v) for k, v in value.items()}
            shown.append(f"{f.name}={value!r}")
        return f"Settings({', '.join(shown)})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as the constructor call (a MappingProxyType cannot be pickled): the worker processes of
        # `taskq worker --processes N` receive their settings this way.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return (functools.partial(Settings, **{**fields, "kafka": dict(self.kafka)}), ())

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from TASKQ_* variables (overrides win); TASKQ_KAFKA_SASL_MECHANISM -> sasl.mechanism."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            var = f.metadata.get("env", "")
            if f.type == "str" and var and env.get(var):  # the plain text settings; the rest below
                values[f.name] = env[var]
        if env.get("TASKQ_DELAY_TIERS"):
            values["delay_tiers"] = tuple(parse_duration(t) for t in env["TASKQ_DELAY_TIERS"].split(","))
        if "TASKQ_DLQ_REDACT" in env:  # set but empty: nothing is hidden
            values["dlq_redact"] = tuple(n.strip() for n in env["TASKQ_DLQ_REDACT"].split(",") if n.strip())
        kafka = {
            var[len("TASKQ_KAFKA_") :].lower().replace("_", "."): value
            for var, value in env.items()
            if var.startswith("TASKQ_KAFKA_")
        }
        if kafka:
            values["kafka"] = kafka
        values.update(overrides)
        return cls(**values)

    def with_namespace(self, namespace: str) -> Settings:
        """A copy for another namespace, with its own worker group."""
        return replace(self, namespace=namespace, worker_group="")
