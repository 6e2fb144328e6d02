"""The worker's claims in flight on the recorder thread, without services."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

from taskq._core.envelope import Envelope
from taskq._core.kafka import TP, Record
from taskq._core.settings import Settings
from taskq.consumer.handlers import Handlers
from taskq.consumer.store import Claim, ClaimRequest, Finished
from taskq.consumer.worker import Worker, WorkerConfig
from taskq.schemas import avro
from taskq.testing import InMemoryRegistry, InMemoryStore
from tests.unit.test_worker_rebalance import KEPT, NS, SCHEMA, SCHEMA_ID, RecordingSource, buffered


def record(tp: TP, offset: int, priority: str = "normal") -> Record:
    env = Envelope(
        task_id=f"id-{tp[0]}-{offset}",
        task_type=f"{NS}.Job",
        idempotency_key=f"k-{tp[0]}-{offset}",
        priority=priority,
    )
    value = avro.frame(SCHEMA_ID, avro.encode(avro.parse(SCHEMA), {"n": offset}))
    return Record(tp[0], tp[1], offset, None, value, env.to_headers(), 0)


class GatedStore(InMemoryStore):
    """Holds its round trips until `gate` is set."""

    def __init__(self) -> None:
        super().__init__(owner="w")
        self.gate, self.entered = threading.Event(), threading.Event()

    def finish_and_claim(
        self, finished: Sequence[Finished], requests: Sequence[ClaimRequest]
    ) -> tuple[set[str], list[Claim]]:
        self.entered.set()
        self.gate.wait(30)
        return super().finish_and_claim(finished, requests)


def test_a_wave_of_group_commits_waits_for_the_claims_in_flight() -> None:
    # A wave of group commits takes up to half the buffer at once, in weighted order. Started while a
    # tier's refetched records are still being claimed, the wave gave that tier's turns to the tiers
    # buffered: the dry spells of the weights test (critical and high missing for 25-45 completions).
    handlers = Handlers()
    release = threading.Event()

    @handlers.task(f"{NS}.Job", schema=SCHEMA, transactional=True)
    def job(payload: dict[str, Any], ctx: Any) -> None:
        release.wait(10)

    registry = InMemoryRegistry()
    registry._by_id[SCHEMA_ID] = registry.register(SCHEMA)
    store = GatedStore()
    w = Worker(
        handlers,
        Settings(namespace=NS),
        WorkerConfig(forwarder=False, concurrency=1),
        store=store,
        recorder=store,
        registry=registry,
    )
    w._source = RecordingSource()  # type: ignore[assignment]
    critical: TP = (f"{NS}.critical", 0)
    w._assigned_cb([KEPT, critical])
    store.gate.set()
    for offset in range(10):
        w._accept(record(KEPT, offset))
    w._claim_arrived()
    w._completer.wait_claimed(10)
    assert len(buffered(w)) == 10
    store.gate.clear()
    store.entered.clear()
    for offset in range(10):
        w._accept(record(critical, offset, priority="critical"))
    w._claim_arrived()
    assert store.entered.wait(10)
    # Postgres answers the moment the loop waits for it (and not before: the loop must ask).
    wait_claimed = w._completer.wait_claimed

    def answer_and_wait(timeout: float) -> None:
        store.gate.set()
        wait_claimed(timeout)

    w._completer.wait_claimed = answer_and_wait  # type: ignore[method-assign]
    try:
        w._dispatch()
        started = Counter(t.tier for t in w._running.values())
        assert started["critical"] > started["normal"], f"the wave started {dict(started)}"
    finally:
        store.gate.set()
        release.set()
        w.executor.shutdown(timeout=10)
        w._completer.close()
