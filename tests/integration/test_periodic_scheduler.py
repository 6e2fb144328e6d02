"""The periodic scheduler on Postgres: concurrent schedulers stage each slot once, in the outbox."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from taskq import Settings, TaskProducer
from taskq._core.db import Database
from taskq._core.envelope import H
from taskq.consumer.periodic import Every, PeriodicScheduler, PeriodicSpec
from taskq.schemas.registry import Registry


@pytest.fixture
def tick_type(settings: Settings, task_schema: Callable[..., dict[str, Any]]) -> str:
    with Registry(settings.schema_registry_url) as registry:
        return registry.register(task_schema("Tick", [{"name": "note", "type": "string"}])).subject


@pytest.fixture
def db(settings: Settings) -> Iterator[Database]:
    database = Database(settings.database_url, schema=settings.database_schema)
    yield database
    database.close()


def at(minute: int, second: int = 1) -> datetime:
    return datetime(2026, 11, 30, 10, minute, second, tzinfo=UTC)


def staged_keys(db: Database) -> list[str]:
    with db.connection() as conn:
        rows = conn.execute("SELECT headers FROM taskq_outbox ORDER BY id").fetchall()
    return [bytes.fromhex(dict(r["headers"])[H + "idempotency-key"]).decode() for r in rows]


def test_schedulers_racing_on_one_task_stage_each_slot_once(
    settings: Settings, db: Database, tick_type: str
) -> None:
    now = [at(0)]
    spec = PeriodicSpec("tick", tick_type, Every(60, "1m"), {"note": "n"}, "normal", "last")
    with TaskProducer(settings) as producer:

        def stage(spec: PeriodicSpec, slot: datetime, conn: Any) -> None:
            key = spec.idempotency_key(slot)
            producer.enqueue(spec.task_type, spec.payload, idempotency_key=key, conn=conn)

        schedulers = [
            PeriodicScheduler([spec], db, settings.namespace, stage, clock=lambda: now[0]) for _ in range(3)
        ]
        try:
            for minute in range(5):
                now[0] = at(minute)
                threads = [threading.Thread(target=s.run_once) for s in schedulers]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(30)
                for s in schedulers:  # and once more each, one after the other: nothing new is due
                    assert s.run_once() == 0
            assert staged_keys(db) == [spec.idempotency_key(at(m, 0)) for m in range(5)]
            now[0] = at(15)  # after ten minutes without a scheduler: the current slot, none of the missed
            assert schedulers[0].run_once() == 1
            assert staged_keys(db)[-1] == spec.idempotency_key(at(15, 0))
        finally:
            for s in schedulers:
                s.close()
