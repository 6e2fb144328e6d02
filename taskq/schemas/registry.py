"""The one module that talks to the schema registry (Confluent REST API, e.g. Apicurio ccompat).

Its HTTP calls are the standard library's (`taskq.schemas.rest`): nothing to import but urllib. A worker
still makes its registry on a thread of its own (`PendingRegistry`) while it joins its group, and looks up
its task types' latest versions there.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, TypeVar
from urllib.parse import quote

from taskq._core.errors import ConfigurationError
from taskq._core.settings import Settings, redact
from taskq.schemas import avro
from taskq.schemas.errors import (
    IncompatibleSchemaError,
    RegistryUnavailableError,
    SchemaError,
    SchemaNotFoundError,
)
from taskq.schemas.rest import RegistryHTTPError, RestClient

log = logging.getLogger("taskq.registry")
T = TypeVar("T")
#: Confluent error codes meaning "no such subject / version / schema".
_NOT_FOUND = {40401, 40402, 40403, 404}


@dataclass(frozen=True, slots=True)
class RegisteredSchema:
    """One version of a subject: its registry id, version number and parsed Avro schema."""

    subject: str
    schema_id: int
    version: int
    schema: dict[str, Any]
    parsed: avro.ParsedSchema


class SchemaRegistry(Protocol):
    """What producers and workers need of a registry: `Registry`, or `taskq.testing`'s in-memory one."""

    def register(
        self, schema: Mapping[str, Any], *, compatibility: str | None = "BACKWARD"
    ) -> RegisteredSchema: ...
    def check(self, schema: Mapping[str, Any]) -> bool: ...
    def latest(self, subject: str) -> RegisteredSchema: ...
    def lookup(self, schema: Mapping[str, Any]) -> RegisteredSchema: ...
    def cached(self, schema_id: int) -> avro.ParsedSchema | None: ...
    def by_id(self, schema_id: int) -> avro.ParsedSchema: ...
    def close(self) -> None: ...


class Registry:
    """A small client for the registry: register, look up by subject or id, check compatibility; cached."""

    def __init__(
        self, url: str, *, config: Mapping[str, Any] | None = None, latest_ttl: float = 30.0
    ) -> None:
        """A client of the registry at `url`; `config` adds confluent-kafka's registry client properties
        (credentials and TLS files: see `client_config`)."""
        self.url = url
        config = dict(config or {})
        # Credentials given outside the URL: every message strips them as it strips the URL's password.
        self._secrets = tuple(
            secret
            for secret in (
                str(config.get("basic.auth.user.info", "")).partition(":")[2],
                str(config.get("bearer.auth.token", "")),
            )
            if secret
        )
        try:
            self._rest = RestClient(url, config)
        except (OSError, ValueError, TypeError) as exc:  # ssl.SSLError is an OSError: a bad PEM file
            raise ConfigurationError(self._redact(f"schema registry client for {url}: {exc}")) from exc
        self._latest_ttl = latest_ttl
        self._lock = threading.Lock()
        self._by_id: dict[int, avro.ParsedSchema] = {}
        self._latest: dict[str, tuple[float, RegisteredSchema]] = {}

    @classmethod
    def from_settings(cls, settings: Settings, *, latest_ttl: float = 30.0) -> Registry:
        """The registry of `settings`: its URL, credentials (basic auth or a bearer token) and TLS files."""
        return cls(settings.schema_registry_url, config=client_config(settings), latest_ttl=latest_ttl)

    def _redact(self, text: str) -> str:
        return redact(text, self.url, secrets=self._secrets)

    def close(self) -> None:
        """Release the client (each call has its own connection: nothing stays open between calls)."""
        self._rest.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except RegistryHTTPError as exc:
            message, status = self._redact(exc.message), exc.status
            if exc.error_code in _NOT_FOUND or status == 404:
                raise SchemaNotFoundError(f"{what}: {message}") from exc
            if status == 409 or exc.error_code == 409:
                raise IncompatibleSchemaError(f"{what}: {message}") from exc
            if status >= 500 or status < 0:
                raise RegistryUnavailableError(
                    self._redact(f"{what}: registry at {self.url} failed: {message}")
                ) from exc
            if status in (401, 403):
                raise SchemaError(
                    self._redact(
                        f"{what}: registry at {self.url} refused the credentials (HTTP {status}): {message}"
                    )
                ) from exc
            raise SchemaError(f"{what}: {message} (HTTP {status})") from exc
        except OSError as exc:  # no answer: refused, cut, timed out, or TLS (ssl.SSLError is an OSError)
            raise RegistryUnavailableError(
                self._redact(f"{what}: registry at {self.url} unreachable: {exc}")
            ) from exc

    def register(
        self, schema: Mapping[str, Any], *, compatibility: str | None = "BACKWARD"
    ) -> RegisteredSchema:
        """Register a record schema under its full name; IncompatibleSchemaError if the registry refuses."""
        subject = avro.full_name(schema)
        avro.parse(schema, source=f"schema of {subject}")
        if compatibility:
            self._ensure_compatibility(subject, compatibility)
        text = avro.canonical_json(schema)
        path = f"subjects/{_path(subject)}"
        rs = self._call(f"registering {subject}", lambda: self._rest.post(f"{path}/versions", _avro(text)))
        looked = self._call(f"looking up {subject}", lambda: self._rest.post(path, _avro(text)))
        with self._lock:
            self._latest.pop(subject, None)
        return self._registered(subject, _int(rs, "id", looked), _int(looked, "version"), text)

    def _level(self, subject: str) -> str | None:
        """The subject's own compatibility level, or None when it has none (the registry default applies)."""
        try:
            level = self._call(
                f"reading compatibility of {subject}", lambda: self._rest.get(f"config/{_path(subject)}")
            )["compatibilityLevel"]
        except SchemaNotFoundError:
            return None
        return str(level) if level else None

    def _ensure_compatibility(self, subject: str, level: str) -> None:
        # Only a subject with no level of its own gets ours: one an operator set (BACKWARD_TRANSITIVE,
        # FULL, ...) is kept, so registering never weakens the checks that protect old tasks.
        if self._level(subject) is not None:
            return
        try:
            self._call(
                f"setting compatibility of {subject}",
                lambda: self._rest.put(f"config/{_path(subject)}", {"compatibility": level.upper()}),
            )
        except IncompatibleSchemaError:
            # Another process registering the subject at the same time set it first: the registry refuses
            # the second setting of a level (a rule that already exists), and the first one stands.
            if self._level(subject) is None:
                raise

    def check(self, schema: Mapping[str, Any]) -> bool:
        """Whether the schema may become the next version of its subject (True for a new subject): against
        the latest version, or every version when the subject's level is transitive."""
        subject = avro.full_name(schema)
        text = avro.canonical_json(schema)
        try:
            level = self._level(subject) or str(
                self._call("reading the default compatibility", lambda: self._rest.get("config"))[
                    "compatibilityLevel"
                ]
            )
            versions: list[int | str] = ["latest"]
            if level.endswith("_TRANSITIVE"):
                versions = list(self.versions(subject))

            def compatible(version: int | str) -> bool:
                path = f"compatibility/subjects/{_path(subject)}/versions/{version}"
                return bool(self._rest.post(path, _avro(text))["is_compatible"])

            return all(
                self._call(f"checking {subject} against version {v}", partial(compatible, v))
                for v in versions
            )
        except SchemaNotFoundError:
            return True

    def latest(self, subject: str) -> RegisteredSchema:
        """The latest version of a subject, cached for a short while; SchemaNotFoundError if unregistered."""
        now = time.monotonic()
        with self._lock:
            hit = self._latest.get(subject)
        if hit and now - hit[0] < self._latest_ttl:
            return hit[1]
        path = f"subjects/{_path(subject)}/versions/latest"
        rs = self._call(f"looking up task type {subject}", lambda: self._rest.get(path))
        reg = self._registered(subject, _int(rs, "id"), _int(rs, "version"), _text(rs))
        with self._lock:
            self._latest[subject] = (now, reg)
        return reg

    def lookup(self, schema: Mapping[str, Any]) -> RegisteredSchema:
        """The registered version identical to this schema; SchemaNotFoundError if it was never registered."""
        subject = avro.full_name(schema)
        text = avro.canonical_json(schema)
        path = f"subjects/{_path(subject)}"
        rs = self._call(f"looking up {subject}", lambda: self._rest.post(path, _avro(text)))
        return self._registered(subject, _int(rs, "id"), _int(rs, "version"), text)

    def cached(self, schema_id: int) -> avro.ParsedSchema | None:
        """The parsed schema of an id if this client already has it, without asking the registry."""
        with self._lock:
            return self._by_id.get(schema_id)

    def by_id(self, schema_id: int) -> avro.ParsedSchema:
        """The parsed writer schema of a registry id (ids never change, so cached forever)."""
        with self._lock:
            hit = self._by_id.get(schema_id)
        if hit is not None:
            return hit
        path = f"schemas/ids/{int(schema_id)}"
        s = self._call(f"fetching schema id {schema_id}", lambda: self._rest.get(path))
        parsed = avro.parse(_text(s), source=f"schema id {schema_id}")
        with self._lock:
            self._by_id[schema_id] = parsed
        return parsed

    def delete_subject(self, subject: str) -> None:
        """Delete a subject and all its versions for good (soft delete, then permanent)."""

        def delete(permanent: bool) -> list[int]:
            query = "?permanent=true" if permanent else ""
            return list(self._rest.delete(f"subjects/{_path(subject)}{query}"))

        for permanent in (False, True):
            try:
                self._call(f"deleting {subject}", lambda: delete(permanent))  # noqa: B023 - called at once
            except SchemaNotFoundError:
                if permanent:
                    return
        with self._lock:
            self._latest.pop(subject, None)

    def subjects(self) -> list[str]:
        """Every subject in the registry."""
        return list(self._call("listing subjects", lambda: self._rest.get("subjects")))

    def versions(self, subject: str) -> list[int]:
        """The version numbers of a subject."""
        path = f"subjects/{_path(subject)}/versions"
        return list(self._call(f"listing versions of {subject}", lambda: self._rest.get(path)))

    def _registered(self, subject: str, schema_id: int, version: int, text: str) -> RegisteredSchema:
        parsed = avro.parse(text, source=f"{subject} v{version}")
        with self._lock:
            self._by_id.setdefault(schema_id, parsed)
        return RegisteredSchema(subject, schema_id, version, json.loads(text), parsed)


def client_config(settings: Settings) -> dict[str, Any]:
    """confluent-kafka's client properties of `settings`' registry: credentials and TLS files, which must
    exist (ConfigurationError otherwise; whether they hold usable PEM shows when a `Registry` is made)."""
    config: dict[str, Any] = {}
    if settings.schema_registry_user:
        user, password = settings.schema_registry_user, settings.schema_registry_password
        config["basic.auth.user.info"] = f"{user}:{password}"
    if settings.schema_registry_token:
        # The client's static bearer token. Its logical cluster names a Confluent Cloud registry (sent as
        # target-sr-cluster); other registries read only the Authorization header.
        config["bearer.auth.credentials.source"] = "STATIC_TOKEN"
        config["bearer.auth.token"] = settings.schema_registry_token
        config["bearer.auth.logical.cluster"] = ""
    for prop, name, path in (
        ("ssl.ca.location", "CA_FILE", settings.schema_registry_ca_file),
        ("ssl.certificate.location", "CERT_FILE", settings.schema_registry_cert_file),
        ("ssl.key.location", "KEY_FILE", settings.schema_registry_key_file),
    ):
        if path:
            var = f"TASKQ_SCHEMA_REGISTRY_{name}"
            if not os.path.isfile(path):
                raise ConfigurationError(f"{var}: no such file {path!r}")
            config[prop] = path
    return config


class PendingRegistry:
    """A `SchemaRegistry` made on a thread of its own; once asked (`look_up_ahead`), the same thread looks
    up the latest version of some subjects, so that records written with it decode without a round trip.
    A call waits until the registry is made, and raises what making it raised (a ConfigurationError for
    unusable TLS files)."""

    def __init__(self, make: Callable[[], SchemaRegistry]) -> None:
        self._registry: SchemaRegistry | None = None
        self._error: BaseException | None = None
        self._made = threading.Event()
        self._subjects: tuple[str, ...] = ()
        self._asked = threading.Event()  # look_up_ahead, or close
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._make, args=(make,), name="taskq-registry", daemon=True)
        self._thread.start()

    def look_up_ahead(self, subjects: Sequence[str]) -> None:
        """Look up the latest version of each subject on the registry's thread, once it is made."""
        self._subjects = tuple(subjects)
        self._asked.set()

    def _make(self, make: Callable[[], SchemaRegistry]) -> None:
        try:
            registry = self._registry = make()
        except BaseException as exc:  # raised again by every call, on the caller's thread
            self._error = exc
            return
        finally:
            self._made.set()
        self._asked.wait()
        for subject in self._subjects:
            if self._closed.is_set():
                return
            try:
                registry.latest(subject)
            except Exception as exc:  # a look-up ahead of need (the registry may be down, or closing):
                log.debug("registry look-up ahead: %s", exc)  # the first record of the type asks again

    def made(self) -> bool:
        """Whether the registry is made; raises what making it raised."""
        if not self._made.is_set():
            return False
        if self._error is not None:
            raise self._error
        return True

    def _ready(self) -> SchemaRegistry:
        registry = self._registry
        if registry is None:
            self._made.wait()
            if self._error is not None:
                raise self._error
            assert self._registry is not None
            registry = self._registry
        return registry

    def register(
        self, schema: Mapping[str, Any], *, compatibility: str | None = "BACKWARD"
    ) -> RegisteredSchema:
        """As `Registry.register`."""
        return self._ready().register(schema, compatibility=compatibility)

    def check(self, schema: Mapping[str, Any]) -> bool:
        """As `Registry.check`."""
        return self._ready().check(schema)

    def latest(self, subject: str) -> RegisteredSchema:
        """As `Registry.latest`."""
        return self._ready().latest(subject)

    def lookup(self, schema: Mapping[str, Any]) -> RegisteredSchema:
        """As `Registry.lookup`."""
        return self._ready().lookup(schema)

    def cached(self, schema_id: int) -> avro.ParsedSchema | None:
        """As `Registry.cached`: None until the registry is made, without waiting for it."""
        registry = self._registry
        return registry.cached(schema_id) if registry is not None else None

    def by_id(self, schema_id: int) -> avro.ParsedSchema:
        """As `Registry.by_id`."""
        return self._ready().by_id(schema_id)

    def close(self) -> None:
        """Close the registry once it is made, and end its thread: a look-up ahead still under way ends
        with the registry. The thread must be gone before the process ends: a daemon thread still importing
        or in a request while the interpreter finalizes can crash it (a refused worker died of SIGSEGV)."""
        self._closed.set()
        self._asked.set()
        self._made.wait()
        if self._registry is not None:
            self._registry.close()
        if self._thread is not threading.current_thread():
            self._thread.join(10)


def _path(name: str) -> str:
    """A subject as one segment of a URL path."""
    return quote(name, safe="")


def _avro(text: str) -> dict[str, str]:
    """The body that carries an Avro schema."""
    return {"schema": text, "schemaType": "AVRO"}


def _text(answer: Any) -> str:
    """The schema text of a registry answer."""
    if not isinstance(answer, dict) or not isinstance(answer.get("schema"), str):
        raise SchemaError("the registry answered without a schema")
    return str(answer["schema"])


def _int(answer: Any, key: str, fallback: Any = None) -> int:
    """An id or version of a registry answer (or of `fallback` when the answer lacks it)."""
    for source in (answer, fallback):
        if isinstance(source, dict) and isinstance(source.get(key), int):
            return int(source[key])
    raise SchemaError(f"the registry answered without a schema {key}")
