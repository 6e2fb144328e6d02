"""The worker's revoke and assign path, without services: what a rebalance drops is only what it revokes."""

from __future__ import annotations

from typing import Any

import pytest

from taskq._core.envelope import Envelope
from taskq._core.kafka import TP, Record
from taskq._core.settings import Settings
from taskq.consumer.executor import Outcome
from taskq.consumer.handlers import Handlers
from taskq.consumer.store import ClaimRequest
from taskq.consumer.worker import Worker, WorkerConfig
from taskq.schemas import avro
from taskq.testing import InMemoryRegistry, InMemoryStore

NS = "unit"
SCHEMA = {"type": "record", "name": "Job", "namespace": NS, "fields": [{"name": "n", "type": "long"}]}
KEPT: TP = (f"{NS}.normal", 0)
MOVED: TP = (f"{NS}.normal", 1)
THIRD: TP = (f"{NS}.normal", 2)
SCHEMA_ID = 7


class RecordingSource:
    """Stands in for the Kafka consumer where the worker loop calls it: pauses, resumes and commits."""

    def __init__(self) -> None:
        self.paused: set[TP] = set()
        self.commits: list[dict[TP, int]] = []

    def pause(self, tps: Any) -> None:
        self.paused |= set(tps)

    def resume(self, tps: Any) -> None:
        self.paused -= set(tps)

    def commit(self, offsets: dict[TP, int], *, asynchronous: bool = False) -> None:
        self.commits.append(dict(offsets))

    def high_watermarks(self, tps: Any) -> dict[TP, int]:
        return dict.fromkeys(tps, -1)  # as a consumer that has fetched nothing yet

    def position(self, tp: TP) -> int:
        return -1


def record(tp: TP, offset: int) -> Record:
    env = Envelope(
        task_id=f"id-{tp[1]}-{offset}",
        task_type=f"{NS}.Job",
        idempotency_key=f"k-{tp[1]}-{offset}",
        priority="normal",
    )
    value = avro.frame(SCHEMA_ID, avro.encode(avro.parse(SCHEMA), {"n": offset}))
    return Record(tp[0], tp[1], offset, None, value, env.to_headers(), 0)


@pytest.fixture
def worker() -> Worker:
    handlers = Handlers()

    @handlers.task(f"{NS}.Job", schema=SCHEMA)
    def job(payload: dict[str, Any], ctx: Any) -> None:
        pass

    registry = InMemoryRegistry()
    registry._by_id[SCHEMA_ID] = registry.register(SCHEMA)  # the records' writer schema, under their id
    config = WorkerConfig(forwarder=False)
    w = Worker(handlers, Settings(namespace=NS), config, store=InMemoryStore(owner="w"), registry=registry)
    w._source = RecordingSource()  # type: ignore[assignment]
    return w


def accept(w: Worker, r: Record) -> None:
    """Fetched: decoded, and its key claimed (as a tick does for each poll's records)."""
    w._accept(r)
    w._claim_arrived()


def buffered(w: Worker) -> list[tuple[TP, int]]:
    """(partition, offset) of every task waiting in the worker's buffers."""
    return sorted((t.record.tp, t.record.offset) for tier in w._scheduler._buffers.values() for t in tier)


def test_a_revoke_keeps_the_retained_partitions_buffered_running_and_paused_work(worker: Worker) -> None:
    w = worker
    w._assigned_cb([KEPT, MOVED])
    for offset in range(5):
        accept(w, record(KEPT, offset))
        accept(w, record(MOVED, offset))
    running = w._scheduler.pop()  # the head of KEPT is running on a slot
    assert running is not None and running.record.tp == KEPT
    running.recorded = True  # its completion was recorded in the handler's transaction
    w._running[id(running)] = running
    w._source.pause([KEPT])  # type: ignore[union-attr]
    w._paused.add(KEPT)
    generation = w._generation[KEPT]

    w._revoked_cb([MOVED])

    assert buffered(w) == [(KEPT, o) for o in range(1, 5)], "buffered tasks of the kept partition"
    assert w._tracker.pending(KEPT) == 5 and w._tracker.pending(MOVED) == 0
    assert KEPT in w._paused and KEPT in w._assigned and MOVED not in w._assigned
    assert w._generation[KEPT] == generation
    # The kept partition's running task still counts when it reports, and its offset commits.
    w._outcomes.put((running, Outcome(ok=True)))
    w._collect(block=0.0)
    w._commit()
    assert w._source.commits[-1] == {KEPT: 1}  # type: ignore[union-attr]


def test_records_fetched_before_a_revoke_are_dropped_and_read_again_if_the_partition_returns(
    worker: Worker,
) -> None:
    w = worker
    w._assigned_cb([KEPT, MOVED])
    accept(w, record(MOVED, 0))
    w._revoked_cb([MOVED])
    # One consume() call can serve the revocation and still return records of the revoked partition.
    accept(w, record(MOVED, 1))
    assert buffered(w) == [] and w._tracker.pending(MOVED) == 0
    # The partition comes back (a later rebalance) and is read again from its committed offset: every
    # record is buffered and tracked, none is mistaken for a redelivery of something already held.
    w._assigned_cb([MOVED])
    for offset in range(3):
        accept(w, record(MOVED, offset))
    assert buffered(w) == [(MOVED, o) for o in range(3)]
    assert w._tracker.pending(MOVED) == 3


def test_a_partition_assigned_again_is_resumed_even_if_it_was_paused_when_revoked(worker: Worker) -> None:
    w = worker
    w._assigned_cb([KEPT])
    w._flow_control()
    w._source.pause([KEPT])  # type: ignore[union-attr]
    w._paused.add(KEPT)
    w._revoked_cb([KEPT])
    w._assigned_cb([KEPT])  # librdkafka kept the pause across revoke and re-assign
    w._flow_control()
    assert KEPT not in w._source.paused  # type: ignore[union-attr]


def test_keys_claimed_ahead_for_a_revoked_partition_are_claimed_at_once_by_its_new_owner(
    worker: Worker,
) -> None:
    w = worker
    w._assigned_cb([KEPT, MOVED])
    for offset in range(3):
        accept(w, record(MOVED, offset))
    assert buffered(w) == [(MOVED, o) for o in range(3)]  # claimed as they arrived, none started
    w._revoked_cb([MOVED])
    store = w.store
    assert isinstance(store, InMemoryStore)
    other = InMemoryStore(owner="other", rows=store.rows)
    claims = other.claim([ClaimRequest(f"k-1-{o}", f"id-1-{o}", f"{NS}.Job", 60.0) for o in range(3)])
    # Not held until the first worker's leases expire, and no attempt used up by the claim that never ran.
    assert [(c.outcome, c.attempts) for c in claims] == [("claimed", 1)] * 3


def test_a_stopping_worker_gives_back_the_keys_it_claimed_ahead(worker: Worker) -> None:
    w = worker
    w._assigned_cb([KEPT])
    for offset in range(3):
        accept(w, record(KEPT, offset))
    w._stop.set()
    w._shutdown()
    store = w.store
    assert isinstance(store, InMemoryStore)
    other = InMemoryStore(owner="other", rows=store.rows)
    claims = other.claim([ClaimRequest(f"k-0-{o}", f"id-0-{o}", f"{NS}.Job", 60.0) for o in range(3)])
    assert [(c.outcome, c.attempts) for c in claims] == [("claimed", 1)] * 3


def test_a_periodic_commit_counts_only_what_the_broker_committed_and_the_rest_is_sent_again(
    worker: Worker,
) -> None:
    w = worker
    w._assigned_cb([KEPT, MOVED])
    accept(w, record(KEPT, 0))
    accept(w, record(MOVED, 0))
    while (task := w._scheduler.pop()) is not None:
        w._done(task)  # completed and recorded
    w._commit(asynchronous=True)  # the loop's periodic commit: the outcome comes from a later poll
    assert w._source.commits[-1] == {KEPT: 1, MOVED: 1}  # type: ignore[union-attr]
    assert w._tracker.committable() == {KEPT: 1, MOVED: 1}  # not committed until the broker says so
    w._committed_cb({KEPT: 1}, "Broker: Group rebalance in progress (REBALANCE_IN_PROGRESS)")
    assert w._tracker.committable() == {MOVED: 1}
    w._commit(asynchronous=True)
    assert w._source.commits[-1] == {MOVED: 1}  # type: ignore[union-attr]
    w._committed_cb({MOVED: 1}, None)
    assert w._tracker.committable() == {}


def test_a_saturated_tier_resumes_its_partitions_in_turns_each_once_a_round(worker: Worker) -> None:
    w = worker
    w._assigned_cb([KEPT, MOVED, THIRD])
    w._flow_control()
    for tp in (KEPT, MOVED, THIRD):
        w._paused.add(tp)
    w._served["normal"].add(KEPT)  # delivered since the round began
    assert w._turn("normal", [KEPT, MOVED, THIRD], 0) == [MOVED, THIRD]
    w._served["normal"] |= {MOVED, THIRD}
    # Each has delivered: a new round, every partition.
    assert w._turn("normal", [KEPT, MOVED, THIRD], 0) == [KEPT, MOVED, THIRD]
    assert not w._served["normal"]


def test_a_tier_resumes_the_partitions_whose_turn_it_is_first_and_the_others_once_short_of_its_share(
    worker: Worker,
) -> None:
    w = worker
    w._assigned_cb([KEPT, MOVED])
    w._flow_control()
    w._paused |= {KEPT, MOVED}
    w._served["normal"].add(KEPT)
    reserve = w._scheduler.reserve("normal")
    assert w._turn("normal", [KEPT, MOVED], reserve) == [MOVED]  # MOVED has the tier's fetches to itself
    w._paused.discard(MOVED)
    assert w._turn("normal", [KEPT, MOVED], reserve) == []  # while the tier holds its share
    assert w._turn("normal", [KEPT, MOVED], reserve - 1) == [KEPT]  # then the others follow
    assert w._served["normal"] == {KEPT}  # the round goes on


def test_a_tier_is_not_held_for_a_partition_fetched_since_its_assignment(worker: Worker) -> None:
    # A newly assigned partition is fetched at once, outside the tier's turns. With nothing read yet its
    # position is unknown, and its end counts records to read (ones another member ran, a transaction's
    # marker). It must not hold the tier's paused partitions back: a form of the turns that waited for it as
    # for a turn's partition stood a worker still once Postgres was in reach again.
    w = worker
    w._assigned_cb([KEPT, MOVED])
    w._flow_control()  # both fresh: fetched
    w._paused.add(KEPT)  # the tier saturated; KEPT delivered, MOVED nothing
    w._served["normal"].add(KEPT)
    assert w._turn("normal", [KEPT, MOVED], 0) == [KEPT]
