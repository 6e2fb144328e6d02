"""Fixtures: the real stack (started once per session if nothing answers) and a namespace per test."""

from __future__ import annotations

import fcntl
import functools
import json
import os
import socket
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from taskq._core.db import Database  # noqa: E402
from taskq._core.kafka import Admin  # noqa: E402
from taskq._core.settings import Settings  # noqa: E402
from taskq.producer.admin import create_topics  # noqa: E402
from taskq.schemas import Registry  # noqa: E402

_VARS = ("TASKQ_BOOTSTRAP_SERVERS", "TASKQ_SCHEMA_REGISTRY_URL", "TASKQ_DATABASE_URL")


def _answers(env: dict[str, str]) -> bool:
    try:
        host, port = env["TASKQ_BOOTSTRAP_SERVERS"].split(",")[0].rsplit(":", 1)
        socket.create_connection((host, int(port)), timeout=2).close()
        db = urlparse(env["TASKQ_DATABASE_URL"])
        socket.create_connection((db.hostname or "127.0.0.1", db.port or 5432), timeout=2).close()
        with urllib.request.urlopen(
            env["TASKQ_SCHEMA_REGISTRY_URL"].rstrip("/") + "/subjects", timeout=5
        ) as r:
            return bool(r.status == 200)
    except (OSError, KeyError, ValueError):
        return False


def _from_stack_script() -> dict[str, str]:
    out = subprocess.run(
        [str(REPO / "compose" / "stack"), "up"], check=False, stdout=subprocess.PIPE, text=True, timeout=900
    )
    if out.returncode != 0:
        pytest.exit(
            f"compose/stack up failed with exit code {out.returncode} (its stderr says why)", returncode=3
        )
    env = {}
    for line in out.stdout.splitlines():
        if line.startswith("export ") and "=" in line:
            name, _, value = line[len("export ") :].partition("=")
            env[name] = value.strip().strip("'\"")
    return env


def _from_containers() -> dict[str, str]:  # pragma: no cover - needs a Docker engine, which CI here lacks
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.waiting_utils import wait_for_logs
    from testcontainers.kafka import KafkaContainer
    from testcontainers.postgres import PostgresContainer

    pg = PostgresContainer("postgres:15", dbname="taskq").start()
    kafka = KafkaContainer("apache/kafka:4.3.1").with_kraft().start()
    registry = DockerContainer("apicurio/apicurio-registry:3.3.3").with_exposed_ports(8080).start()
    wait_for_logs(registry, "Listening on", timeout=120)
    port = registry.get_exposed_port(8080)
    return {
        "TASKQ_BOOTSTRAP_SERVERS": kafka.get_bootstrap_server(),
        "TASKQ_SCHEMA_REGISTRY_URL": f"http://{registry.get_container_host_ip()}:{port}/apis/ccompat/v7",
        "TASKQ_DATABASE_URL": pg.get_connection_url(driver=None),
    }


@functools.cache
def _stack() -> dict[str, str]:
    """TASKQ_* variables of a running stack: from the environment, else `compose/stack up` (once a process).

    Under pytest-xdist every worker process asks; they take turns on a lock in the stack's state dir, so the
    first starts the stack and the others find it answering (one `compose/stack up` at a time on one dir).
    """
    env = {k: os.environ[k] for k in _VARS if os.environ.get(k)}
    if len(env) == len(_VARS) and _answers(env):
        return env
    if os.environ.get("TASKQ_TEST_STACK") == "containers":
        return _from_containers()
    state = Path(os.environ.get("TASKQ_STACK_DIR") or REPO / ".stack")
    state.mkdir(parents=True, exist_ok=True)
    with (state / "up.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        env = _from_stack_script()
    if not _answers(env):
        pytest.exit(f"the stack started but does not answer at {env}", returncode=3)
    os.environ.update(env)
    return env


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the stack, if the run has tests that need it and nothing answers, before the first of them rather
    than in its setup: a first start fetches Kafka's and the registry's jars, which takes longer than the
    time limit a test has (pyproject.toml's `faulthandler_timeout`)."""
    if any("stack_env" in getattr(item, "fixturenames", ()) for item in session.items):
        _stack()


@pytest.fixture(scope="session")
def stack_env() -> dict[str, str]:
    """TASKQ_* variables of the running stack (see `_stack`)."""
    return _stack()


@pytest.fixture(scope="session")
def base_settings(stack_env: dict[str, str]) -> Settings:
    """Settings of the running stack, in the default namespace."""
    return Settings.from_env(stack_env)


@pytest.fixture
def ns() -> str:
    """A fresh namespace (topic prefix, group, database schema) for one test."""
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
def settings(base_settings: Settings, ns: str, request: pytest.FixtureRequest) -> Iterator[Settings]:
    """Settings in the test's own namespace, with its topics created and its database schema migrated.

    Topics get 3 partitions each, or what a `@pytest.mark.partitions(n)` on the test asks for.
    """
    marker = request.node.get_closest_marker("partitions")
    with namespace_settings(base_settings, ns, partitions=marker.args[0] if marker else 3) as s:
        yield s


@contextmanager
def namespace_settings(base_settings: Settings, ns: str, *, partitions: int) -> Iterator[Settings]:
    """Settings in namespace `ns` with its topics and database schema; all of it, task types included, is
    deleted at the end."""
    s = Settings.from_env(
        {
            "TASKQ_BOOTSTRAP_SERVERS": base_settings.bootstrap_servers,
            "TASKQ_SCHEMA_REGISTRY_URL": base_settings.schema_registry_url,
            "TASKQ_DATABASE_URL": base_settings.database_url,
        },
        namespace=ns,
        database_schema=ns,
    )
    create_topics(s, partitions=partitions)
    db = Database(s.database_url, schema=s.database_schema)
    db.migrate()
    yield s
    db.drop_schema()
    with Registry(s.schema_registry_url) as registry:  # task types of the test live under its namespace
        for subject in registry.subjects():
            if subject.startswith(ns + "."):
                registry.delete_subject(subject)
    admin = Admin(s)
    admin.delete_topics([t for t in admin.partitions(_all_topics(s))])


def _all_topics(s: Settings) -> list[str]:
    from taskq._core.envelope import Topics

    t = Topics(s.namespace, s.delay_tiers)
    return [*t.priority_topics, *t.delay_topics, t.dlq]


@pytest.fixture
def env_of(settings: Settings) -> Callable[..., dict[str, str]]:
    """Environment for a subprocess (CLI, worker) in the test's namespace."""

    def make(**extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "TASKQ_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
            "TASKQ_SCHEMA_REGISTRY_URL": settings.schema_registry_url,
            "TASKQ_DATABASE_URL": settings.database_url,
            "TASKQ_NAMESPACE": settings.namespace,
            "TASKQ_DATABASE_SCHEMA": settings.database_schema,
            "PYTHONPATH": str(REPO),
            # Its Postgres sessions carry the namespace as their application_name: tests that look at
            # pg_stat_activity see their own processes only, not those of tests running beside them.
            "PGAPPNAME": settings.namespace,
            **extra,
        }

    return make


@pytest.fixture
def task_schema(ns: str, tmp_path: Path) -> Callable[..., dict[str, Any]]:
    """Make a record schema in the test's own Avro namespace (so subjects never collide between tests)."""

    def make(name: str, fields: list[dict[str, Any]], *, write_to: str | None = None) -> dict[str, Any]:
        schema = {"type": "record", "name": name, "namespace": ns, "fields": fields}
        if write_to:
            (tmp_path / write_to).write_text(json.dumps(schema))
        return schema

    return make


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark tests by folder, so `-m 'not integration'` runs the unit tests alone."""
    for item in items:
        parts = Path(str(item.fspath)).parts
        if "integration" in parts:
            item.add_marker(pytest.mark.integration)
        elif "acceptance" in parts:
            item.add_marker(pytest.mark.acceptance)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under `--dist loadgroup` (make test), fail a test marked `xdist_group` that pytest-xdist did not put in
    its group, before its fixtures start: spread over the workers, each would start the module's shared stack
    or browser of its own and fail in ways that say nothing of the cause."""
    if getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group"):
        if "@" not in item.nodeid:  # xdist names the group after the id
            pytest.fail(
                "pytest-xdist did not put this test in its xdist_group: with pytest 9.2 its --dist loadgroup "
                "groups nothing (pytest-dev/pytest-xdist#1386); install the pytest that pyproject.toml pins",
                pytrace=False,
            )
