"""The contract suite: each test runs against the in-memory fakes of `taskq.testing` and against the real
services, so a fake that drifts from the real semantics fails here."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from taskq._core.db import Database
from taskq._core.envelope import WORKFLOW_HEADER
from taskq._core.kafka import Broker, KafkaBroker, TopicSpec
from taskq._core.settings import Settings
from taskq.consumer.dlq import PostgresReplayLog
from taskq.consumer.store import IdempotencyStore
from taskq.producer.status import PostgresTaskRecords
from taskq.schemas.registry import Registry
from taskq.testing import InMemoryBroker, InMemoryRegistry, InMemoryStore


@pytest.fixture(params=["memory", pytest.param("real", marks=pytest.mark.integration)])
def kind(request: pytest.FixtureRequest) -> str:
    """Which implementation the test runs against (the real services' runs are marked integration, so that
    `-m 'not integration'` keeps the fakes' runs alone, as `make test-fast` does)."""
    return str(request.param)


def _settings(request: pytest.FixtureRequest) -> Settings:
    settings: Settings = request.getfixturevalue("settings")  # the real stack, in the test's namespace
    return settings


@dataclass
class Kafka:
    """A broker and a topic of 3 partitions on it."""

    broker: Broker
    topic: str
    ns: str


@pytest.fixture
def kafka(kind: str, ns: str, request: pytest.FixtureRequest) -> Kafka:
    broker: Broker = InMemoryBroker() if kind == "memory" else KafkaBroker(_settings(request))
    topic = f"{ns}.contract"
    broker.admin().create_topics([TopicSpec(topic, 3)])
    return Kafka(broker, topic, ns)


@pytest.fixture
def stores(kind: str, request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any]]:
    """Two stores over one table, as two workers (owners 'a' and 'b') see it."""
    if kind == "memory":
        a = InMemoryStore(owner="a")
        yield a, InMemoryStore(
            owner="b", rows=a.rows, workers=a.workers, slots=a.slots, buckets=a.buckets, paused=a.paused,
            workflows=a.workflows,
        )
        return
    s = _settings(request)
    db = Database(s.database_url, schema=s.database_schema)
    a, b = IdempotencyStore(db, owner="a", namespace=s.namespace), IdempotencyStore(db, owner="b", namespace=s.namespace)
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def records(kind: str, stores: tuple[Any, Any], request: pytest.FixtureRequest) -> Iterator[Any]:
    """Where a producer reads task records and cancels tasks, over the records of `stores`."""
    if kind == "memory":
        yield stores[0]
        return
    s = _settings(request)
    records = PostgresTaskRecords(Database(s.database_url, schema=s.database_schema), s.namespace)
    yield records
    records.close()


@pytest.fixture
def staged(
    kind: str, stores: tuple[Any, Any], request: pytest.FixtureRequest
) -> Iterator[Callable[[], list[str]]]:
    """Take the records workflows staged since the last call (as a relay would): their workflow headers."""
    if kind == "memory":
        yield lambda: [dict(h)[WORKFLOW_HEADER].decode() for _, _, _, h in stores[0].take_staged()]
        return
    s = _settings(request)
    db = Database(s.database_url, schema=s.database_schema)

    def take() -> list[str]:
        with db.connection() as conn:
            rows = conn.execute(
                "DELETE FROM taskq_outbox WHERE namespace = %s RETURNING id, headers", (s.namespace,)
            ).fetchall()
        rows.sort(key=lambda r: r["id"])
        return [bytes.fromhex(dict(r["headers"])[WORKFLOW_HEADER]).decode() for r in rows]

    yield take
    db.close()


@pytest.fixture
def namespaces(kind: str, request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any]]:
    """Two stores of two namespaces ('x' with owner 'a', 'y' with owner 'b') sharing one database."""
    if kind == "memory":
        yield InMemoryStore(owner="a", namespace="x"), InMemoryStore(owner="b", namespace="y")
        return
    s = _settings(request)
    db = Database(s.database_url, schema=s.database_schema)
    x, y = IdempotencyStore(db, owner="a", namespace="x"), IdempotencyStore(db, owner="b", namespace="y")
    yield x, y
    x.close()
    y.close()


@pytest.fixture
def registry(kind: str, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A schema registry; the real one's subjects of the test namespace are deleted after the test."""
    if kind == "memory":
        yield InMemoryRegistry()
        return
    with Registry(_settings(request).schema_registry_url) as r:
        yield r


@pytest.fixture
def replay_log(kind: str, request: pytest.FixtureRequest) -> Iterator[Any]:
    """Where DLQ replays are recorded: the in-memory store, or Postgres."""
    if kind == "memory":
        yield InMemoryStore(owner="dlq")
        return
    s = _settings(request)
    log = PostgresReplayLog(Database(s.database_url, schema=s.database_schema), namespace=s.namespace)
    yield log
    log.close()
