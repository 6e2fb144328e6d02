"""Delays on the real stack: a task behind a long delay that is due sooner is not held back by it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from taskq import Settings, TaskProducer
from taskq._core.durations import pick_delay_tier
from taskq._core.envelope import Envelope, H, Topics, new_task_id
from taskq._core.kafka import Admin, KafkaBroker, Record, Source
from taskq.consumer.forwarder import Forwarder
from taskq.schemas import avro
from taskq.schemas.registry import Registry


def test_tasks_due_now_behind_a_held_three_hour_delay_are_forwarded_at_once(
    settings: Settings, task_schema: Callable[..., dict[str, Any]]
) -> None:
    with Registry(settings.schema_registry_url) as registry:
        reg = registry.register(task_schema("Job", [{"name": "n", "type": "long"}]))
    topics = Topics(settings.namespace, settings.delay_tiers)
    long_tier = topics.delay(pick_delay_tier(timedelta(hours=3), settings.delay_tiers))
    normal = topics.tier("normal")
    admin = Admin(settings)
    forwarder = Forwarder(settings)
    stop = threading.Event()

    def forward() -> None:
        forwarder.start()
        try:
            while not stop.is_set():
                forwarder.step(wait=0.1)
        finally:
            forwarder.close()

    with TaskProducer(settings) as producer:
        for n in range(3):
            producer.enqueue(reg.subject, {"n": n}, key="k", delay=timedelta(hours=3), wait=True)
    thread = threading.Thread(target=forward)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while forwarder.next_due() is None:  # the partition is held at its 3 h head
            assert time.monotonic() < deadline, "the forwarder never held the delayed tasks"
            time.sleep(0.05)
        # Then 100 tasks due now arrive behind the head, in its partition (as a replay or a late hop might).
        sink = KafkaBroker(settings).sink()
        for n in range(3, 103):
            env = Envelope(
                task_id=new_task_id(),
                task_type=reg.subject,
                idempotency_key=f"due-now:{n}",
                priority="normal",
                not_before=datetime.now(UTC) - timedelta(seconds=1),
                origin_topic=normal,
            )
            value = avro.frame(reg.schema_id, avro.encode(reg.parsed, {"n": n}))
            sink.send(long_tier, value, key=b"k", headers=env.to_headers())
        assert sink.flush(30) == 0
        while sum(admin.end_offsets([normal]).values()) < 100:  # offsets: records and commit markers
            # The head is not due for 3 h and would hop only after 1 h: only a look behind it finds these.
            assert time.monotonic() < deadline + 60, "tasks due now stayed behind the 3 h delay"
            time.sleep(0.1)
    finally:
        stop.set()
        thread.join(30)
    keys = sorted(dict(r.headers)[H + "idempotency-key"].decode() for r in read_all(settings, normal))
    assert keys == sorted(f"due-now:{n}" for n in range(3, 103))  # the 3 h tasks are still waiting


def read_all(settings: Settings, topic: str) -> list[Record]:
    """Every committed record of a topic, from the start."""
    ends = {tp: end for tp, end in Admin(settings).end_offsets([topic]).items() if end > 0}
    source = Source(settings, group=f"{settings.namespace}.reader")
    records: list[Record] = []
    try:
        source.assign([(t, p, 0) for t, p in ends])
        deadline = time.monotonic() + 30
        while not all(source.position((t, p)) >= end for (t, p), end in ends.items()):
            assert time.monotonic() < deadline, "could not read the tier to its end"
            records += source.poll(500, 0.5)
    finally:
        source.close()
    return records
