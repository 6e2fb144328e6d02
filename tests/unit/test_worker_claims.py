"""The worker's claims in flight on the recorder thread, without services."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest

from taskq._core.envelope import Envelope
from taskq._core.kafka import TP, Record
from taskq._core.settings import Settings
from taskq.consumer.claims import CLAIM_ENOUGH, RATE_WINDOW
from taskq.consumer.handlers import Handlers
from taskq.consumer.store import Claim, ClaimRequest, Finished
from taskq.consumer.worker import Worker, WorkerConfig
from taskq.schemas import avro
from taskq.testing import InMemoryBroker, InMemoryRegistry, InMemoryStore
from tests.unit.test_worker_rebalance import KEPT, MOVED, NS, SCHEMA, SCHEMA_ID, RecordingSource, buffered


def record(tp: TP, offset: int, priority: str = "normal") -> Record:
    env = Envelope(
        task_id=f"id-{tp[0]}-{tp[1]}-{offset}",
        task_type=f"{NS}.Job",
        idempotency_key=f"k-{tp[0]}-{tp[1]}-{offset}",
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


def arrive(w: Worker, fetched: Record) -> None:
    """A loop pass's intake of one fetched record: taken in, then its claim queued or sent."""
    w._accept(fetched)
    w._claim_arrived()


def stop(*workers: Worker) -> None:
    """Stop what a worker built without `start` runs: its slots and its recorder thread."""
    for w in workers:
        w.executor.shutdown(timeout=10)
        w._completer.close()


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
        stop(w)


class CountingStore(InMemoryStore):
    """Counts its round trips and the claims each carried."""

    def __init__(self) -> None:
        super().__init__(owner="w")
        self.trips: list[int] = []

    def finish_and_claim(
        self, finished: Sequence[Finished], requests: Sequence[ClaimRequest]
    ) -> tuple[set[str], list[Claim]]:
        self.trips.append(len(requests))
        return super().finish_and_claim(finished, requests)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


WARM: TP = (f"{NS}.normal", 2)


def lingering_worker(
    linger: float = 0.002, *, started: bool = True, rate: int = 1400
) -> tuple[Worker, CountingStore, Clock]:
    """A worker whose claims go to a recorder thread, on a clock of the test's, that has just claimed
    `rate` tasks a second for a window (on partition WARM; its round trips are forgotten); `started`: past
    its first dispatch, as a worker is at a steady rate."""
    handlers = Handlers()

    @handlers.task(f"{NS}.Job", schema=SCHEMA)
    def job(payload: dict[str, Any], ctx: Any) -> None:
        pass

    registry = InMemoryRegistry()
    registry._by_id[SCHEMA_ID] = registry.register(SCHEMA)
    store, clock = CountingStore(), Clock()
    w = Worker(
        handlers,
        Settings(namespace=NS),
        WorkerConfig(forwarder=False, concurrency=1, claim_linger=linger),
        broker=InMemoryBroker(),
        store=store,
        recorder=store,
        registry=registry,
        clock=clock,
    )
    w._source = RecordingSource()  # type: ignore[assignment]
    w._assigned_cb([KEPT, WARM])
    w._dispatched = started
    window = round(rate * RATE_WINDOW)
    for offset in range(window):
        arrive(w, record(WARM, offset))
        clock.now += RATE_WINDOW / window
    clock.now += 1e-6  # past the window, whatever the rounding of its steps
    w._claims.send_queued()
    w._completer.wait_claimed(10)
    w._claims.release(w._dispatcher.drop_all())  # out of the buffers: only the test's tasks are there
    store.trips.clear()
    return w, store, clock


def test_tasks_fetched_in_passes_within_the_claim_linger_are_claimed_in_one_round_trip() -> None:
    # At a steady rate a loop pass fetches a task or two, and a round trip per pass cost more CPU than
    # the tasks: the claims of passes within `claim_linger` of the first go to Postgres together.
    w, store, clock = lingering_worker(0.002)
    try:
        arrive(w, record(KEPT, 0))
        assert w._claims.queued() == 1 and w._claims.claiming["normal"] == 1
        assert w._waiting() == 1, "a queued claim is buffered work"
        assert w._until_claims(0.25) == pytest.approx(0.002), "a wait in the loop outlasts no claim"
        clock.now += 0.001
        arrive(w, record(KEPT, 1))
        w._completer.wait_claimed(1)
        assert store.trips == [] and w._claims.queued() == 2
        clock.now += 0.0011
        assert w._until_claims(0.25) == 0.0
        w._claim_arrived()
        w._completer.wait_claimed(10)
        assert store.trips == [2]
        assert buffered(w) == [(KEPT, 0), (KEPT, 1)] and w._claims.claiming["normal"] == 0
    finally:
        stop(w)


def test_without_a_claim_linger_each_pass_claims_its_own_tasks() -> None:
    w, store, _ = lingering_worker(0.0)
    try:
        for offset in range(2):
            arrive(w, record(KEPT, offset))
            w._completer.wait_claimed(10)
        assert store.trips == [1, 1] and w._until_claims(0.25) == 0.25
    finally:
        stop(w)


def test_a_batch_as_large_as_claim_enough_and_a_starting_worker_claim_at_once() -> None:
    w, store, _ = lingering_worker(0.5)
    starting, first_trips, _ = lingering_worker(0.5, started=False)
    try:
        for offset in range(CLAIM_ENOUGH):
            w._accept(record(KEPT, offset))
        w._claim_arrived()
        w._completer.wait_claimed(10)
        assert store.trips == [CLAIM_ENOUGH]
        # Before its first dispatch a worker waits for nothing it need not: its first claims go at once.
        starting._accept(record(KEPT, 0))
        starting._claim_arrived()
        starting._completer.wait_claimed(10)
        assert first_trips.trips == [1]
    finally:
        stop(w, starting)


def test_claims_lingering_when_a_partition_is_revoked_leave_its_new_owner_no_lease_to_wait_out() -> None:
    w, store, _ = lingering_worker(0.5)
    try:
        w._assigned_cb([MOVED])
        w._accept(record(KEPT, 0))
        arrive(w, record(MOVED, 0))
        assert w._claims.queued() == 2
        w._revoked_cb([MOVED])
        assert w._claims.queued() == 0 and w._claims.claiming["normal"] == 0
        assert buffered(w) == [(KEPT, 0)], "the kept partition's task is claimed and buffered"
        # The revoked partition's key is free: its new owner claims it at once, at the same attempt.
        other = InMemoryStore(owner="other", rows=store.rows)
        claim = other.claim([ClaimRequest("k-unit.normal-1-0", "id-unit.normal-1-0", f"{NS}.Job", 60.0)])[0]
        assert claim.outcome == "claimed" and claim.attempts == 1, claim
    finally:
        stop(w)


def test_a_trickle_of_tasks_is_claimed_at_once_whatever_the_linger() -> None:
    # Lingering pays only if another task comes within it: at 5 tasks a second none would, and every
    # task would wait the linger for nothing.
    w, store, clock = lingering_worker(0.005, rate=5)
    try:
        clock.now += RATE_WINDOW
        arrive(w, record(KEPT, 0))
        w._completer.wait_claimed(10)
        assert store.trips == [1] and w._claims.queued() == 0
    finally:
        stop(w)


def test_a_worker_with_claims_lingering_is_not_idle_and_says_when_they_are_due() -> None:
    # The in-memory queue's harness advances its clock to `waiting_until()`: a queued claim must be there.
    w, _, clock = lingering_worker(0.003)
    try:
        arrive(w, record(KEPT, 0))
        assert not w.idle() and w.waiting_until() == pytest.approx(clock.now + 0.003)
    finally:
        stop(w)


class WaitingSource(RecordingSource):
    """Kafka with nothing more to deliver: a poll returns nothing once its timeout has passed."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock
        self.polls: list[tuple[int, float]] = []

    def poll(self, n: int, timeout: float) -> list[Record]:
        self.polls.append((n, timeout))
        self.clock.now += timeout
        return []

    def high_watermarks(self, tps: Any) -> dict[TP, int]:
        return {tp: 0 for tp in tps}

    def position(self, tp: TP) -> int:
        return 0

    def lag(self) -> dict[TP, int]:
        return {}


def test_a_loop_pass_with_claims_lingering_waits_for_records_until_they_are_due_then_sends_them() -> None:
    # While the claims linger and the slots are idle, the pass takes whatever Kafka delivers until they are
    # due, in one wait (not a pass per record), and sends them when it ends: the wait never outlasts them.
    w, store, clock = lingering_worker(0.002)
    source = WaitingSource(clock)
    w._source = source  # type: ignore[assignment]
    try:
        arrive(w, record(KEPT, 0))
        clock.now += 0.0005
        w._tick()
        waits = [(n, timeout) for n, timeout in source.polls if timeout > 0]
        # Kafka waits whole milliseconds: the wait is rounded up, so that it ends with the claims due.
        assert len(waits) == 1 and waits[0][0] > 1 and waits[0][1] == pytest.approx(0.002), source.polls
        w._completer.wait_claimed(10)
        assert store.trips == [1] and w._claims.queued() == 0
    finally:
        stop(w)


def test_claims_do_not_linger_while_tasks_wait_in_the_buffer_for_a_slot() -> None:
    # A backlog: the tiers' tasks are buffered and dispatched by weight. A tier's refetched records whose
    # claims lingered left it dry meanwhile, and the others took its turns: the weights test saw normal at
    # 95 of 600 completions against 80 (invariant 4). Claims linger only while the buffer is empty.
    w, store, _ = lingering_worker(0.005)
    try:
        arrive(w, record(KEPT, 0))
        assert w._claims.queued() == 1, "an empty buffer: the claim lingers"
        w._claims.send_queued()
        w._completer.wait_claimed(10)
        assert buffered(w) == [(KEPT, 0)]
        store.trips.clear()
        arrive(w, record(KEPT, 1))
        w._completer.wait_claimed(10)
        assert store.trips == [1] and w._claims.queued() == 0
    finally:
        stop(w)
