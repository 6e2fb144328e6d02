"""enqueue_many(task_type, payloads, ...) against the real stack: every task lands once, keyed and ordered as
enqueue() would; one invalid payload sends nothing; receipts carry the broker's acknowledgement; refusals
are reported per task."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest

from taskq import (
    AsyncTaskProducer,
    DeliveryError,
    InvalidTaskError,
    PayloadValidationError,
    Settings,
    TaskProducer,
)
from taskq._core.envelope import Envelope, Topics
from taskq._core.kafka import Admin, Record, Source
from taskq.schemas import Registry, avro

FIELDS = [{"name": "key", "type": "string"}, {"name": "n", "type": "int"}]


@pytest.fixture
def item_type(settings: Settings, task_schema: Callable[..., dict[str, Any]]) -> str:
    """A registered task type in the test's namespace; returns its name."""
    with Registry(settings.schema_registry_url) as registry:
        return registry.register(task_schema("Item", FIELDS)).subject


def _ends(settings: Settings) -> int:
    """Records in every topic of the namespace (end offsets summed)."""
    t = Topics(settings.namespace, settings.delay_tiers)
    return sum(Admin(settings).end_offsets([*t.priority_topics, *t.delay_topics, t.dlq]).values())


def _read_all(settings: Settings, topic: str, n: int) -> list[Record]:
    """Every record of a topic, expecting `n`, read from offset 0 without joining a group."""
    partitions = Admin(settings).partitions([topic])[topic]
    source = Source(settings, group=f"{settings.namespace}.reader")
    source.assign([(topic, p, 0) for p in range(partitions)])
    got: list[Record] = []
    try:
        for _ in range(100):
            got += source.poll(n, 0.2)
            if len(got) >= n:
                break
        got += source.poll(n, 0.5)  # anything beyond n would be a duplicate
    finally:
        source.close()
    return got


def test_a_batch_lands_once_each_task_keyed_and_ordered_as_enqueue_would(
    settings: Settings, item_type: str
) -> None:
    payloads = [{"key": "ab"[i % 2], "n": i} for i in range(40)]
    with TaskProducer(settings) as producer:
        receipts = producer.enqueue_many(
            item_type, payloads, priority="high", keys=[p["key"] for p in payloads], wait=True
        )
        single = {
            k: producer.enqueue(item_type, {"key": k, "n": -1}, priority="high", key=k, wait=True)
            for k in "ab"
        }
        derived = producer.enqueue_many(item_type, [{"key": "c", "n": 1}], wait=True)[0]
        again = producer.enqueue(item_type, {"key": "c", "n": 1}, wait=True)
    topic = Topics(settings.namespace).tier("high")
    assert all(r.topic == topic and r.priority == "high" for r in receipts)
    assert len({r.task_id for r in receipts}) == 40
    # Acknowledged: each receipt names the record the broker took, and that record is this task.
    records = {(r.partition, r.offset): r for r in _read_all(settings, topic, 42)}
    assert len(records) == 42  # the batch's 40 and the two single enqueues, nothing twice
    by_key: dict[str, list[int]] = defaultdict(list)
    for payload, receipt in zip(payloads, receipts, strict=True):
        assert receipt.partition is not None and receipt.offset is not None
        record = records[receipt.partition, receipt.offset]
        env = Envelope.from_headers(record.headers)
        assert (env.task_id, env.task_type, env.attempt) == (receipt.task_id, item_type, 1)
        assert env.idempotency_key == receipt.idempotency_key
        assert record.key == payload["key"].encode()
        schema_id, body = avro.split_frame(record.value)
        with Registry(settings.schema_registry_url) as fresh:
            assert avro.decode(body, fresh.by_id(schema_id)) == payload
        by_key[payload["key"]].append(receipt.offset)
        # The same key goes to the same partition as enqueue() sends it to.
        assert receipt.partition == single[payload["key"]].partition
    for offsets in by_key.values():
        assert offsets == sorted(offsets)  # in the order of the payloads
    # Without keys, a task is keyed by its idempotency key, derived from the payload as enqueue() derives it.
    assert derived.idempotency_key == again.idempotency_key
    assert derived.partition == again.partition


def test_one_invalid_payload_sends_nothing_and_is_named(settings: Settings, item_type: str) -> None:
    before = _ends(settings)
    with TaskProducer(settings) as producer:
        payloads: list[dict[str, Any]] = [{"key": "a", "n": i} for i in range(5)]
        payloads[3] = {"key": "a", "n": "three"}
        with pytest.raises(PayloadValidationError, match=r"^task 3 of 5: invalid payload .*'n'") as raised:
            producer.enqueue_many(item_type, payloads)
        assert raised.value.field == "n"
        assert "\n" not in str(raised.value)
        with pytest.raises(InvalidTaskError, match="idempotency_keys must be a sequence of one per payload"):
            producer.enqueue_many(item_type, payloads[:2], idempotency_keys=["only-one"])
        with pytest.raises(InvalidTaskError, match=r"^task 1 of 2: idempotency_key must be a non-empty"):
            producer.enqueue_many(item_type, payloads[:2], idempotency_keys=["k", ""])
        producer.flush(30)
    assert _ends(settings) == before


def test_tasks_the_broker_refuses_are_reported_each_by_its_task_id(
    settings: Settings, item_type: str
) -> None:
    # A namespace whose topics were never created (and the broker does not auto-create them).
    orphan = settings.with_namespace(settings.namespace + "x")
    with TaskProducer(orphan, kafka_config={"message.timeout.ms": 1500}) as producer:
        with pytest.raises(DeliveryError) as waited:
            producer.enqueue_many(item_type, [{"key": "a", "n": i} for i in range(3)], wait=True)
        assert len({task_id for task_id, _ in waited.value.failures}) == 3
        assert all(err for _, err in waited.value.failures)
        # Nobody waits: flush reports them. Equal records (same payload, same key) are told apart.
        receipts = producer.enqueue_many(item_type, [{"key": "a", "n": 1}] * 3, idempotency_keys=["same"] * 3)
        with pytest.raises(DeliveryError) as flushed:
            producer.flush(30)
        assert sorted(task_id for task_id, _ in flushed.value.failures) == sorted(r.task_id for r in receipts)
        producer.flush(30)  # each failure is reported once


def test_the_async_producer_awaits_one_acknowledgement_per_batch(settings: Settings, item_type: str) -> None:
    async def main() -> list[Any]:
        async with AsyncTaskProducer(settings) as producer:
            return await producer.enqueue_many(
                item_type, [{"key": "k", "n": i} for i in range(20)], keys=["k"] * 20, wait=True
            )

    receipts = asyncio.run(main())
    assert len({(r.partition, r.offset) for r in receipts}) == 20
    offsets = [r.offset for r in receipts]
    assert offsets == sorted(offsets) and len({r.partition for r in receipts}) == 1
