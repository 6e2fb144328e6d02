"""No secret in any message: URLs with awkward passwords, parameters, and drivers quoting them back."""

from __future__ import annotations

import pytest

from taskq._core.db import Database
from taskq._core.errors import StoreUnavailableError
from taskq._core.settings import redact
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
