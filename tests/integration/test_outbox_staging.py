"""The transactional outbox on the real stack: staging in the caller's transaction, relays, failures."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import psycopg
import pytest

from taskq import AsyncTaskProducer, InvalidTaskError, Settings, StoreUnavailableError, TaskProducer, TaskSpec
from taskq._core.db import Database
from taskq._core.envelope import H, Topics
from taskq._core.errors import KafkaUnavailableError
from taskq._core.kafka import Admin, Record, Source
from taskq._core.store import Store
from taskq.producer.outbox import OutboxRelay
from taskq.schemas.registry import Registry

FIELDS = [{"name": "to", "type": "string"}, {"name": "n", "type": "long"}]


@pytest.fixture
def email_type(settings: Settings, task_schema: Callable[..., dict[str, Any]]) -> str:
    with Registry(settings.schema_registry_url) as registry:
        return registry.register(task_schema("SendEmail", FIELDS)).subject


@pytest.fixture
def db(settings: Settings) -> Iterator[Database]:
    database = Database(settings.database_url, schema=settings.database_schema)
    yield database
    database.close()


@pytest.fixture
def producer(settings: Settings) -> Iterator[TaskProducer]:
    with TaskProducer(settings) as p:
        yield p


def waiting(db: Database, settings: Settings) -> int:
    return Store(db).outbox_backlog(settings.namespace)[0]


def published(settings: Settings) -> list[Record]:
    """Every record in the namespace's tiers, read from the start."""
    topics = Topics(settings.namespace).priority_topics
    admin = Admin(settings)
    ends = {tp: end for tp, end in admin.end_offsets(topics).items() if end > 0}
    source = Source(settings, group=f"{settings.namespace}.reader")
    records: list[Record] = []
    try:
        source.assign([(tp[0], tp[1], 0) for tp in ends])
        while len(records) < sum(ends.values()):
            records += source.poll(500, 1.0)
    finally:
        source.close()
    return records


def test_staged_tasks_are_published_only_when_the_transaction_commits(
    settings: Settings, producer: TaskProducer, db: Database, email_type: str
) -> None:
    with db.connect(autocommit=False) as conn:
        producer.enqueue(email_type, {"to": "rolled@example.com", "n": 1}, conn=conn)
        assert waiting(db, settings) == 0  # not visible outside the open transaction
        conn.rollback()
        kept = producer.enqueue(email_type, {"to": "kept@example.com", "n": 2}, priority="high", conn=conn)
        conn.commit()
    assert waiting(db, settings) == 1
    with OutboxRelay(settings) as relay:
        assert relay.relay_once() == 1
        assert relay.relay_once() == 0
    assert waiting(db, settings) == 0
    [record] = published(settings)
    headers = dict(record.headers)
    assert record.topic == Topics(settings.namespace).tier("high")
    assert headers[H + "task-id"].decode() == kept.task_id
    assert headers[H + "idempotency-key"].decode() == kept.idempotency_key
    assert record.key == kept.idempotency_key.encode()


def test_two_relays_publish_every_row_once(
    settings: Settings, producer: TaskProducer, db: Database, email_type: str
) -> None:
    with db.connect(autocommit=False) as conn:
        receipts = producer.enqueue_many(
            [
                TaskSpec(task_type=email_type, payload={"to": f"u{i}@example.com", "n": i})
                for i in range(1000)
            ],
            conn=conn,
        )
        conn.commit()
    relays = [OutboxRelay(settings, batch=50) for _ in range(2)]
    counts = [0, 0]

    def drain(i: int) -> None:
        while (n := relays[i].relay_once()) > 0:
            counts[i] += n

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for relay in relays:
        relay.close()
    assert sum(counts) == 1000 and all(counts), counts  # both took batches, none took a row twice
    ids = [dict(r.headers)[H + "task-id"].decode() for r in published(settings)]
    assert sorted(ids) == sorted(r.task_id for r in receipts)


def test_rows_kafka_does_not_take_stay_in_the_outbox(
    settings: Settings, db: Database, email_type: str
) -> None:
    orphan = settings.with_namespace(settings.namespace + "x")  # topics never created; the same database
    with TaskProducer(orphan) as producer, db.connect(autocommit=False) as conn:
        producer.enqueue(email_type, {"to": "a@example.com", "n": 1}, conn=conn)
        conn.commit()
    with OutboxRelay(orphan, publish_timeout=2) as relay, pytest.raises(KafkaUnavailableError, match="stay"):
        relay.relay_once()
    assert waiting(db, orphan) == 1


def test_staging_mistakes_are_one_line_errors(
    settings: Settings, producer: TaskProducer, db: Database, email_type: str
) -> None:
    with db.connect(autocommit=False) as conn:
        with pytest.raises(InvalidTaskError, match="wait=True cannot be combined with conn="):
            producer.enqueue(email_type, {"to": "a@example.com", "n": 1}, conn=conn, wait=True)
    unmigrated = replace(settings, database_schema=settings.database_schema + "_none")  # no tables there
    with TaskProducer(unmigrated) as p, psycopg.connect(settings.database_url) as conn:
        with pytest.raises(StoreUnavailableError) as raised:
            p.enqueue(email_type, {"to": "a@example.com", "n": 1}, conn=conn)
    assert "taskq db migrate" in str(raised.value) and "\n" not in str(raised.value)


def test_the_async_producer_stages_through_an_async_connection(
    settings: Settings, db: Database, email_type: str
) -> None:
    async def main() -> str:
        async with AsyncTaskProducer(settings) as producer:
            async with await psycopg.AsyncConnection.connect(settings.database_url) as conn:
                receipt = await producer.enqueue(email_type, {"to": "a@example.com", "n": 1}, conn=conn)
                await conn.rollback()
                assert waiting(db, settings) == 0
                receipt = await producer.enqueue(email_type, {"to": "b@example.com", "n": 2}, conn=conn)
                await conn.commit()
        return receipt.task_id

    task_id = asyncio.run(main())
    with OutboxRelay(settings) as relay:
        assert relay.relay_once() == 1
    [record] = published(settings)
    assert dict(record.headers)[H + "task-id"].decode() == task_id
