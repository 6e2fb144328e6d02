"""No secret in any message: URLs with awkward passwords, parameters, and drivers quoting them back."""

from __future__ import annotations

import pytest

from taskq._core.db import Database
from taskq._core.errors import ConfigurationError, StoreUnavailableError
from taskq._core.settings import Settings, redact
from taskq.schemas import Registry, RegistryUnavailableError


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("postgresql://app:s3cret@db:5432/taskq", "s3cret"),
        ("postgresql://app:p@ss@word@db:5432/taskq failed", "p@ss@word"),
        ("postgresql://app@db/taskq?sslmode=require&password=hunter2", "hunter2"),
        ("host=db user=app password='two words' dbname=taskq", "two words"),
        ("http://user:tok%zzen@registry:8081/apis/ccompat/v7 unreachable", "tok%zzen"),
        ("sasl.password=abc123, sasl.username=x", "abc123"),
    ],
)
def test_redact_removes_the_password_whatever_its_form(text: str, secret: str) -> None:
    out = redact(text)
    assert secret not in out and "***" in out, out


def test_a_password_quoted_back_by_a_driver_is_removed_too() -> None:
    url = "postgresql://app:Zq%2Fsecret@db/taskq"
    assert redact("invalid token near 'Zq/secret'", url) == "invalid token near '***'"


def test_a_postgres_url_with_a_bad_escape_fails_in_one_line_without_its_password() -> None:
    db = Database("postgresql://app:pa%zzss-word@127.0.0.1:1/taskq")
    with pytest.raises(StoreUnavailableError) as err:
        db.connect()
    assert "pa%zzss-word" not in str(err.value) and "pass-word" not in str(err.value)


def test_registry_errors_name_the_registry_without_its_credentials() -> None:
    with Registry("http://ops:r3gistry-pw@127.0.0.1:1/apis/ccompat/v7") as registry, pytest.raises(
        RegistryUnavailableError
    ) as err:
        registry.latest("x.Y")
    assert "r3gistry-pw" not in str(err.value) and "127.0.0.1:1" in str(err.value)


def test_metrics_listen_on_loopback_unless_told_otherwise() -> None:
    from taskq.cli import build_parser
    from taskq.consumer.metrics import serve

    server = serve(0, lambda: True)
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.shutdown()
        server.server_close()
    for argv in (["worker", "m:h", "--metrics-port", "9400"], ["stats", "--metrics-port", "9400"]):
        assert build_parser().parse_args(argv).metrics_host == "127.0.0.1"


def test_settings_repr_shows_no_secret() -> None:
    s = Settings(
        database_url="postgresql://app:db-s3cret@db/taskq",
        schema_registry_url="https://ops:url-s3cret@registry/apis/ccompat/v7",
        kafka={
            "sasl.username": "app",
            "sasl.password": "kafka-s3cret",
            "ssl.key.password": "key-s3cret",
            "sasl.oauthbearer.config": "clientId=app clientSecret=oauth-s3cret",
        },
    )
    with_auth = Settings(schema_registry_user="ops", schema_registry_password="reg-s3cret")
    with_token = Settings(schema_registry_token="tok-s3cret")
    shown = " ".join([repr(s), str(s), repr(with_auth), repr(with_token)])
    for secret in ("db-s3cret", "url-s3cret", "kafka-s3cret", "key-s3cret", "oauth-s3cret", "reg-s3cret", "tok-s3cret"):
        assert secret not in shown
    assert "postgresql://app:***@db/taskq" in shown and "'sasl.username': 'app'" in shown
    assert "schema_registry_user='ops'" in shown and "schema_registry_token='***'" in shown


def test_registry_settings_come_from_the_environment() -> None:
    s = Settings.from_env(
        {
            "TASKQ_SCHEMA_REGISTRY_USER": "ops",
            "TASKQ_SCHEMA_REGISTRY_PASSWORD": "pw",
            "TASKQ_SCHEMA_REGISTRY_CA_FILE": "/etc/ca.pem",
            "TASKQ_SCHEMA_REGISTRY_CERT_FILE": "/etc/client.pem",
            "TASKQ_SCHEMA_REGISTRY_KEY_FILE": "/etc/client.key",
        }
    )
    assert (s.schema_registry_user, s.schema_registry_password) == ("ops", "pw")
    assert (s.schema_registry_ca_file, s.schema_registry_cert_file, s.schema_registry_key_file) == (
        "/etc/ca.pem",
        "/etc/client.pem",
        "/etc/client.key",
    )
    assert Settings.from_env({"TASKQ_SCHEMA_REGISTRY_TOKEN": "t"}).schema_registry_token == "t"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"schema_registry_url": "https://ops:pw@registry/ccompat", "schema_registry_user": "ops",
             "schema_registry_password": "pw"},
            "both in TASKQ_SCHEMA_REGISTRY_URL and in settings",
        ),
        (
            {"schema_registry_url": "https://ops:pw@registry/ccompat", "schema_registry_token": "t"},
            "both in TASKQ_SCHEMA_REGISTRY_URL and in settings",
        ),
        (
            {"schema_registry_user": "ops", "schema_registry_password": "pw", "schema_registry_token": "t"},
            "a user and password or a token, not both",
        ),
        ({"schema_registry_user": "ops"}, "needs both TASKQ_SCHEMA_REGISTRY_USER and TASKQ_SCHEMA_REGISTRY_PASSWORD"),
        ({"schema_registry_password": "pw"}, "needs both"),
        ({"schema_registry_key_file": "/k"}, "TASKQ_SCHEMA_REGISTRY_KEY_FILE needs TASKQ_SCHEMA_REGISTRY_CERT_FILE"),
    ],
)
def test_conflicting_registry_settings_are_one_line_errors(kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as err:
        Settings(**kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(err.value) and "pw" not in str(err.value)


def test_an_at_sign_in_the_registry_path_is_not_a_credential() -> None:
    s = Settings(schema_registry_url="https://registry/apis/ccompat/v7?tag=a@b", schema_registry_token="t")
    assert s.schema_registry_token == "t"


def test_redact_removes_secrets_given_outside_a_url() -> None:
    assert redact("refused token t0k%41en and t0kAen", secrets=["t0k%41en"]) == "refused token *** and ***"


def test_the_dlq_redact_list_is_names() -> None:
    assert "authorization" in Settings().dlq_redact and "*password*" in Settings().dlq_redact
    assert Settings.from_env({"TASKQ_DLQ_REDACT": " card.number , x-*,"}).dlq_redact == ("card.number", "x-*")
    assert Settings.from_env({"TASKQ_DLQ_REDACT": ""}).dlq_redact == ()
    for bad in ("password", ("ok", " padded"), ("",)):
        with pytest.raises(ConfigurationError, match="dlq_redact must be names"):
            Settings(dlq_redact=bad)  # type: ignore[arg-type]
