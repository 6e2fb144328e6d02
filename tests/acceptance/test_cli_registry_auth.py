"""`taskq schemas` with registry credentials and TLS from TASKQ_SCHEMA_REGISTRY_* settings, as processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.integration.test_registry_auth import PASSWORD, SCHEMA, Pki, Served, basic, serve_registry
from tests.integration.test_registry_auth import pki as pki  # the module's CA and certificates

Run = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def registry(pki: Pki) -> Iterator[Served]:
    yield from serve_registry(pki, authorization=basic("ops", PASSWORD))


@pytest.fixture
def taskq(registry: Served, pki: Pki) -> Run:
    """Run `taskq ...` against the served registry, with its credentials and CA from the environment."""

    def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        full = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "TASKQ_SCHEMA_REGISTRY_URL": registry.url,
            "TASKQ_SCHEMA_REGISTRY_USER": "ops",
            "TASKQ_SCHEMA_REGISTRY_PASSWORD": PASSWORD,
            "TASKQ_SCHEMA_REGISTRY_CA_FILE": str(pki.ca),
            **env,
        }
        return subprocess.run(
            [sys.executable, "-m", "taskq.cli", *args], env=full, capture_output=True, text=True, timeout=120
        )

    return run


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.startswith("taskq: error: ") and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr
    return done.stderr


def test_schemas_register_and_list_with_settings_credentials(taskq: Run, tmp_path: Path) -> None:
    path = tmp_path / "order.avsc"
    path.write_text(json.dumps(SCHEMA))
    done = taskq("schemas", "register", str(path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("auth.Order  version 1  id 1")
    listed = taskq("schemas", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == [{"subject": "auth.Order", "latest_version": 1, "id": 1}]


def test_credential_and_tls_mistakes_are_one_line_without_secrets(taskq: Run, registry: Served) -> None:
    refused = one_line_error(taskq("schemas", "list", TASKQ_SCHEMA_REGISTRY_PASSWORD="wr0ng-pw"))
    assert "refused the credentials (HTTP 401)" in refused and "wr0ng-pw" not in refused

    both = one_line_error(taskq("schemas", "list", TASKQ_SCHEMA_REGISTRY_TOKEN="t0ken-pw"))
    assert "a user and password or a token, not both" in both and "t0ken-pw" not in both

    in_url = registry.url.replace("https://", "https://ops:url-pw@")
    twice = one_line_error(taskq("schemas", "list", TASKQ_SCHEMA_REGISTRY_URL=in_url))
    assert "both in TASKQ_SCHEMA_REGISTRY_URL and in settings" in twice and "url-pw" not in twice

    missing = one_line_error(taskq("schemas", "list", TASKQ_SCHEMA_REGISTRY_CA_FILE="/nonexistent/ca.pem"))
    assert "TASKQ_SCHEMA_REGISTRY_CA_FILE: no such file '/nonexistent/ca.pem'" in missing
    assert PASSWORD not in missing
