"""The services themselves: an Avro round trip through the registry, Kafka and Postgres, and schema evolution."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from taskq._core.db import Database, migrations
from taskq._core.envelope import Envelope, Topics
from taskq._core.errors import StoreUnavailableError
from taskq._core.kafka import Sink, Source
from taskq._core.settings import Settings
from taskq.schemas import IncompatibleSchemaError, Registry, avro


def _consume_one(settings: Settings, topic: str) -> Any:
    source = Source(settings, group=f"{settings.namespace}.probe")
    source.subscribe([topic])
    try:
        for _ in range(60):
            records = source.poll(10, 1.0)
            if records:
                source.commit({records[0].tp: records[0].offset + 1})
                return records[0]
        raise AssertionError(f"nothing arrived on {topic} within 60 polls")
    finally:
        source.close()


def test_avro_round_trip_through_registry_kafka_and_postgres(
    settings: Settings, task_schema: Callable[..., dict[str, Any]], request: pytest.FixtureRequest
) -> None:
    schema = task_schema("SendEmail", [{"name": "to", "type": "string"}, {"name": "n", "type": "int"}])
    registry = Registry(settings.schema_registry_url)
    request.addfinalizer(registry.close)
    reg = registry.register(schema)
    assert reg.subject == f"{settings.namespace}.SendEmail"
    assert reg.subject in registry.subjects()

    topics = Topics(settings.namespace)
    env = Envelope(task_id=uuid.uuid4().hex, task_type=reg.subject, idempotency_key="k-1", priority="normal")
    value = avro.frame(reg.schema_id, avro.encode(reg.parsed, {"to": "a@example.com", "n": 7}))
    sink = Sink(settings)
    sink.send(topics.tier("normal"), value, key=b"k-1", headers=env.to_headers())
    assert sink.flush(30) == 0

    record = _consume_one(settings, topics.tier("normal"))
    assert record.value[0] == 0  # Confluent magic byte
    schema_id, body = avro.split_frame(record.value)
    with Registry(
        settings.schema_registry_url
    ) as fresh:  # no cache: the writer schema comes from the registry
        payload = avro.decode(body, fresh.by_id(schema_id))
    assert payload == {"to": "a@example.com", "n": 7}
    got = Envelope.from_headers(record.headers)
    assert (got.task_id, got.task_type, got.idempotency_key, got.priority) == (
        env.task_id,
        env.task_type,
        "k-1",
        "normal",
    )

    db = Database(settings.database_url, schema=settings.database_schema)
    with db.connection() as conn:
        conn.execute("CREATE TABLE roundtrip (task_id text PRIMARY KEY, payload jsonb)")
        conn.execute("INSERT INTO roundtrip VALUES (%s, %s)", (got.task_id, json.dumps(payload)))
        row = conn.execute("SELECT payload FROM roundtrip WHERE task_id = %s", (got.task_id,)).fetchone()
    assert row == {"payload": payload}


def test_schema_evolution_is_backward_compatible(
    settings: Settings, task_schema: Callable[..., dict[str, Any]], request: pytest.FixtureRequest
) -> None:
    registry = Registry(settings.schema_registry_url)
    request.addfinalizer(registry.close)
    v1 = task_schema("ChargePayment", [{"name": "payment_id", "type": "string"}])
    v2 = task_schema(
        "ChargePayment",
        [{"name": "payment_id", "type": "string"}, {"name": "currency", "type": "string", "default": "EUR"}],
    )
    incompatible = task_schema("ChargePayment", [{"name": "payment_id", "type": "long"}])

    r1 = registry.register(v1)
    assert registry.check(incompatible) is False
    with pytest.raises(IncompatibleSchemaError):
        registry.register(incompatible)
    assert registry.check(v2) is True
    r2 = registry.register(v2)
    assert (r1.version, r2.version) == (1, 2)
    assert registry.versions(r1.subject) == [1, 2]

    written_v1 = avro.frame(r1.schema_id, avro.encode(r1.parsed, {"payment_id": "p-1"}))
    schema_id, body = avro.split_frame(written_v1)
    assert schema_id == r1.schema_id
    assert avro.decode(body, registry.by_id(schema_id), avro.parse(v2)) == {
        "payment_id": "p-1",
        "currency": "EUR",
    }


def test_migrations_are_idempotent(settings: Settings) -> None:
    db = Database(settings.database_url, schema=settings.database_schema)
    assert db.migrate() == []  # the fixture already migrated
    with db.connection() as conn:
        versions = [r["version"] for r in conn.execute("SELECT version FROM taskq_migrations ORDER BY 1")]
    assert versions == [v for v, _, _ in migrations()]


def test_a_warmed_connection_is_the_one_named_queries_use_and_a_failed_warm_is_left_to_the_query(
    settings: Settings, request: pytest.FixtureRequest
) -> None:
    db = Database(settings.database_url, schema=settings.database_schema)
    request.addfinalizer(db.close)
    db.warm().join(10)
    warmed = db._conn
    assert warmed is not None and not warmed.closed
    assert db.all("counts", namespace=f"{settings.namespace}-none") == []
    assert db._conn is warmed
    nowhere = Database("postgresql://taskq:secret@127.0.0.1:1/taskq", schema=settings.database_schema)
    nowhere.warm().join(10)  # nothing raised in its thread, nothing kept
    assert nowhere._conn is None
    with pytest.raises(StoreUnavailableError, match="unreachable") as err:
        nowhere.all("counts", namespace=settings.namespace)
    assert "secret" not in str(err.value)
