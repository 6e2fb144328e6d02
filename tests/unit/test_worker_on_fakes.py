"""The worker's own logic on the in-memory fakes: redelivery, a poison pill, a lost lease, flow control."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from taskq import Handlers, TaskContext
from taskq._core.envelope import Envelope
from taskq._core.errors import StoreUnavailableError
from taskq._core.settings import Settings
from taskq.consumer import events
from taskq.consumer.events import Event, Hooks, LoopSampled, TaskCompleted
from taskq.consumer.store import ClaimRequest, WorkerRecord
from taskq.consumer.worker import POLL_CHUNK, SAMPLE_EVERY, START_BUFFER, Worker, WorkerConfig
from taskq.producer.admin import topic_specs
from taskq.producer.producer import TaskProducer
from taskq.schemas import avro
from taskq.testing import Clock, InMemoryBroker, InMemoryQueue, InMemoryRegistry, InMemoryStore
from tests.acceptance.helpers import wait_until

JOB = {"type": "record", "name": "Job", "namespace": "unit", "fields": [{"name": "n", "type": "long"}]}


class Parts:
    """Fakes shared by several workers of one group, and a producer over them."""

    def __init__(self, handlers: Handlers, *, partitions: int = 2) -> None:
        self.settings = Settings(namespace="unit")
        self.clock = Clock()
        self.broker = InMemoryBroker()
        self.broker.admin().create_topics(topic_specs(self.settings, partitions=partitions))
        self.registry = InMemoryRegistry()
        self.registry.register(JOB)
        self.rows: dict[str, Any] = {}
        self.producer = TaskProducer(self.settings, registry=self.registry, broker=self.broker)
        self.handlers = handlers
        self.completed: dict[str, int] = {}  # completions per worker

    def worker(self, name: str, **config: Any) -> Worker:
        store = InMemoryStore(owner=name, clock=self.clock.time, rows=self.rows)
        w = Worker(
            self.handlers,
            self.settings,
            WorkerConfig(**{"worker_id": name, "forwarder": False, "commit_interval": 0.001, **config}),
            broker=self.broker,
            store=store,
            registry=self.registry,
            clock=self.clock.monotonic,
            hooks=[lambda event: self._count(name, event)],
        )
        w.start()
        return w

    def _count(self, worker: str, event: Event) -> None:
        if isinstance(event, TaskCompleted):
            self.completed[worker] = self.completed.get(worker, 0) + 1


def run(worker: Worker, until: Callable[[], bool], what: str) -> None:
    """Step the worker's loop until `until()` holds."""
    deadline = time.monotonic() + 30
    while not until():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        worker.step()


def _redelivered(parts: Parts, first: Worker) -> Worker:
    """`first` dies before committing; a second worker gets its records again and runs until it committed."""
    assert first._source is not None
    first._source.close()
    second = parts.worker("b")
    topics = second.topics.priority_topics
    run(
        second, lambda: second.idle() and not parts.broker.uncommitted(second.group, topics), "the redelivery"
    )
    return second


def test_a_task_redelivered_after_its_completion_is_skipped_not_run_again() -> None:
    handlers, runs = Handlers(), []

    @handlers.task("unit.Job", schema=JOB)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        runs.append(payload["n"])

    parts = Parts(handlers)
    parts.producer.enqueue("unit.Job", {"n": 1}, idempotency_key="once")
    parts.producer.flush()
    first = parts.worker("a", commit_interval=3600)  # never commits on its own
    run(first, lambda: "once" in parts.rows and parts.rows["once"].state == "completed", "the first run")
    second = _redelivered(parts, first)
    assert runs == [1]
    second.close()


def test_a_task_redelivered_after_it_was_dead_lettered_is_skipped_not_dead_lettered_again() -> None:
    handlers, runs = Handlers(), []

    @handlers.task("unit.Job", schema=JOB, max_attempts=1)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        runs.append(payload["n"])
        raise RuntimeError("boom")

    parts = Parts(handlers)
    parts.producer.enqueue("unit.Job", {"n": 1}, idempotency_key="doomed")
    parts.producer.flush()
    dlq = f"{parts.settings.namespace}.dlq"
    first = parts.worker("a", commit_interval=3600)  # never commits on its own
    run(
        first,
        lambda: "doomed" in parts.rows and parts.rows["doomed"].state == "dead" and parts.broker.records(dlq),
        "the dead-lettering",
    )
    second = _redelivered(parts, first)
    assert runs == [1]
    assert len(parts.broker.records(dlq)) == 1
    second.close()


def test_a_task_whose_attempts_never_reported_is_dead_lettered_as_a_poison_pill() -> None:
    handlers, runs = Handlers(), []

    @handlers.task("unit.Job", schema=JOB, max_attempts=2)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        runs.append(payload["n"])

    with InMemoryQueue(handlers, namespace="unit") as q:
        # Two earlier attempts claimed the key and killed their workers (leases long expired).
        for _ in range(2):
            q.store.claim([ClaimRequest("pill", "t", "unit.Job", 0.0)])
        q.producer.enqueue("unit.Job", {"n": 1}, idempotency_key="pill")
        q.run_until_idle()
        assert runs == []
        (dead,) = q.dead_letters
        assert dead.error_type == "taskq.PoisonPill" and dead.attempts == 3


def test_keys_of_a_dead_worker_run_at_once_uncharged_unless_their_runs_keep_killing_workers() -> None:
    handlers, runs = Handlers(), []

    @handlers.task("unit.Job", schema=JOB, max_attempts=1)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        runs.append((payload["n"], ctx.attempt))

    with InMemoryQueue(handlers, namespace="unit") as q:
        # Another worker leased both keys for 300 s, then died; "pill" had already killed workers before.
        ghost = InMemoryStore(owner="ghost", clock=q.clock.time, rows=q.store.rows, workers=q.store.workers)
        ghost.enter(WorkerRecord("ghost", "unit", "unit.workers", "h", 1, 4, datetime.now(UTC)), lambda pid: True)
        ghost.claim([ClaimRequest(k, "t", "unit.Job", 300.0) for k in ("healthy", "pill")])
        # "pill" had been taken over twice: its first run in quarantine (alone, marked started) killed a
        # worker already, and the ghost's own quarantined run of it was marked started too.
        row = q.store.rows["pill"]
        row.takeovers, row.interruptions, row.started = 2, 1, True
        q.clock.advance(11)  # the ghost's heartbeat is stale: no lease waited out
        q.producer.enqueue("unit.Job", {"n": 1}, idempotency_key="healthy")
        q.producer.enqueue("unit.Job", {"n": 2}, idempotency_key="pill")
        q.run_until_idle()
        assert runs == [(1, 1)]  # taken over as the same attempt: max_attempts=1 still lets it run
        row = q.store.get("healthy")
        assert (row["state"], row["takeovers"], row["interruptions"]) == ("completed", 1, 0)
        (dead,) = q.dead_letters
        assert dead.idempotency_key == "pill" and dead.error_type == "taskq.PoisonPill"
        assert "2 run(s) ended with their worker's death" in dead.reason


def test_a_healthy_task_claimed_ahead_by_two_workers_that_died_runs_with_one_attempt() -> None:
    handlers, runs = Handlers(), []

    @handlers.task("unit.Job", schema=JOB, max_attempts=1)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        runs.append((payload["n"], ctx.attempt))

    with InMemoryQueue(handlers, namespace="unit") as q:
        # Two workers in turn claimed the key ahead (it sat in their buffers, never started) and died.
        for name in ("ghost-1", "ghost-2"):
            ghost = InMemoryStore(owner=name, clock=q.clock.time, rows=q.store.rows, workers=q.store.workers)
            ghost.enter(WorkerRecord(name, "unit", "unit.workers", "h", 1, 4, datetime.now(UTC)), lambda pid: True)
            ghost.claim([ClaimRequest("healthy", "t", "unit.Job", 300.0)])
            q.clock.advance(11)  # its heartbeat goes stale
        q.producer.enqueue("unit.Job", {"n": 1}, idempotency_key="healthy")
        q.run_until_idle()
        assert q.dead_letters == []
        assert runs == [(1, 1)]
        row = q.store.get("healthy")
        assert (row["state"], row["takeovers"], row["interruptions"]) == ("completed", 2, 0)


def test_a_worker_marks_started_only_the_runs_of_keys_taken_over_before() -> None:
    handlers, started = Handlers(), {}

    @handlers.task("unit.Job", schema=JOB, max_attempts=1)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        started[ctx.idempotency_key] = q.store.get(ctx.idempotency_key)["started"]

    with InMemoryQueue(handlers, namespace="unit") as q:
        ghost = InMemoryStore(owner="ghost", clock=q.clock.time, rows=q.store.rows, workers=q.store.workers)
        ghost.enter(WorkerRecord("ghost", "unit", "unit.workers", "h", 1, 4, datetime.now(UTC)), lambda pid: True)
        ghost.claim([ClaimRequest("suspect", "t", "unit.Job", 300.0)])
        q.clock.advance(11)
        q.producer.enqueue("unit.Job", {"n": 1}, idempotency_key="suspect")
        q.producer.enqueue("unit.Job", {"n": 2}, idempotency_key="plain")
        q.run_until_idle()
        # Had this worker died running "suspect", the takeover would count an interruption; a plain task's
        # run writes nothing before it starts.
        assert started == {"suspect": True, "plain": False}


def test_a_run_that_cannot_be_marked_started_runs_unmarked_rather_than_wait_for_its_lease() -> None:
    handlers, runs = Handlers(), []

    @handlers.task("unit.Job", schema=JOB, max_attempts=1)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        runs.append((payload["n"], ctx.attempt))

    def unavailable(runs: Any) -> set[str]:
        raise StoreUnavailableError("Postgres query 'mark_started' failed: the server closed the connection")

    with InMemoryQueue(handlers, namespace="unit") as q:
        ghost = InMemoryStore(owner="ghost", clock=q.clock.time, rows=q.store.rows, workers=q.store.workers)
        ghost.enter(WorkerRecord("ghost", "unit", "unit.workers", "h", 1, 4, datetime.now(UTC)), lambda pid: True)
        ghost.claim([ClaimRequest("suspect", "t", "unit.Job", 300.0)])
        q.clock.advance(11)
        q.store.mark_started = unavailable  # type: ignore[method-assign]
        q.producer.enqueue("unit.Job", {"n": 1}, idempotency_key="suspect")
        q.run_until_idle()
        # Neither held until its lease ends nor charged an attempt for it (max_attempts=1: dead-lettered).
        assert (runs, q.dead_letters) == ([(1, 1)], [])
        assert q.store.get("suspect")["state"] == "completed"


def test_an_attempt_that_lost_its_lease_records_nothing_and_the_new_holder_decides() -> None:
    handlers = Handlers()

    @handlers.task("unit.Job", schema=JOB, transactional=True, timeout=1)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        # Meanwhile the lease expires and another worker takes the key over.
        q.clock.advance(60)
        (claim,) = InMemoryStore(owner="other", clock=q.clock.time, rows=q.store.rows).claim(
            [ClaimRequest(ctx.idempotency_key, ctx.task_id, ctx.task_type, 30)]
        )
        assert claim.outcome == "claimed"

    with InMemoryQueue(handlers, namespace="unit") as q:
        q.producer.enqueue("unit.Job", {"n": 1}, idempotency_key="taken")
        q.run_until_idle()
        assert q.completed == []
        row = q.store.get("taken")
        assert row is not None and row["state"] == "running" and row["lease_owner"] == "other"


def test_a_saturated_tier_is_paused_and_resumed_with_memory_bounded() -> None:
    handlers, release = Handlers(), threading.Event()

    @handlers.task("unit.Job", schema=JOB)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        release.wait(10)

    parts = Parts(handlers)
    for i in range(200):
        parts.producer.enqueue("unit.Job", {"n": i}, priority="normal")
    parts.producer.flush()
    w = parts.worker("a", concurrency=1, buffer_capacity=8)
    for _ in range(20):
        w.step()
        assert len(w._scheduler) + len(w._held) <= 8 + 1  # the bound, plus what one poll may add
    normal = {tp for tp in w._assigned if tp[0] == "unit.normal"}
    assert normal and normal <= w._paused
    release.set()
    run(w, lambda: len(parts.rows) == 200 and w.idle(), "every task")
    assert not normal & w._paused
    w.close()


def test_a_worker_starts_on_the_start_buffer_and_buffers_its_whole_capacity_once_running() -> None:
    # The first wave waits for what the start fetched and claimed, so the start holds START_BUFFER; once a
    # task runs, the worker buffers up to buffer_capacity (a pause drops what librdkafka fetched ahead, and
    # the resume fetches it again: a small buffer pauses often), and tiers paused at the start resume.
    handlers, release = Handlers(), threading.Event()

    @handlers.task("unit.Job", schema=JOB)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        release.wait(10)

    parts = Parts(handlers)
    for i in range(3000):
        parts.producer.enqueue("unit.Job", {"n": i}, priority=("critical", "normal")[i % 2])
    parts.producer.flush()
    w = parts.worker("a", concurrency=1, buffer_capacity=2000)
    assert w._scheduler.capacity == START_BUFFER < 2000
    while not w._dispatched:
        w.step()
        assert w._waiting() <= START_BUFFER + POLL_CHUNK  # the start's bound, plus what one take may add
    paused_at_start = set(w._paused)
    assert paused_at_start
    run(w, lambda: w._waiting() > START_BUFFER + POLL_CHUNK, "the buffer to grow")
    for _ in range(50):
        w.step()
        assert w._waiting() <= 2000 + 500  # the whole bound, plus what one poll may add
    assert w._scheduler.capacity == 2000
    assert {t.envelope.priority for t in w._scheduler} == {"critical", "normal"}
    release.set()
    run(w, lambda: len(parts.rows) == 3000 and w.idle(), "every task")
    w.close()


def test_a_second_worker_takes_half_of_each_tier_and_every_task_runs_once() -> None:
    handlers, runs = Handlers(), []

    @handlers.task("unit.Job", schema=JOB)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        runs.append((payload["n"], ctx.task_id))

    parts = Parts(handlers)
    for i in range(300):
        parts.producer.enqueue("unit.Job", {"n": i}, priority="normal", idempotency_key=f"k{i}")
    parts.producer.flush()
    a = parts.worker("a", concurrency=2, buffer_capacity=40)
    run(a, lambda: len(runs) >= 20, "the first worker to be busy")
    b = parts.worker("b", concurrency=2, buffer_capacity=40)  # joins: partitions of normal move to it
    topics = a.topics.priority_topics

    def both() -> bool:
        b.step()
        return a.idle() and b.idle() and not parts.broker.uncommitted(a.group, topics)

    run(a, both, "every task with two workers")
    assert sorted(n for n, _ in runs) == list(range(300))  # each once: nothing dropped, nothing doubled
    assert {tp[0] for tp in a._assigned} == {tp[0] for tp in b._assigned} == set(topics)  # per tier
    assert parts.completed["b"] >= 60, parts.completed  # the joiner ran a share of the busy tier
    a.close()
    b.close()


def test_large_records_are_bounded_in_bytes_not_only_in_count() -> None:
    handlers, release = Handlers(), threading.Event()

    @handlers.task("unit.Job", schema=JOB)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        release.wait(10)

    parts = Parts(handlers)
    job_id = parts.registry.latest("unit.Job").schema_id
    value = avro.frame(job_id, avro.encode(avro.parse(JOB), {"n": 1}))
    sink = parts.broker.sink()
    for i in range(100):  # 900 KB of headers each: 90 MB in all, far under the buffer's task count
        env = Envelope(task_id=f"t{i}", task_type="unit.Job", idempotency_key=f"k{i}", priority="normal")
        sink.send("unit.normal", value, key=None, headers=[*env.to_headers(), ("blob", b"x" * 900_000)])
    sink.flush()
    w = parts.worker("a", concurrency=1, buffer_bytes=8 * 1024 * 1024)
    most = 0
    for _ in range(30):
        w.step()
        buffered = [t.record for t in w._scheduler] + [h.task.record for h in w._held]
        most = max(most, sum(len(r.value or b"") + sum(len(k) + len(v) for k, v in r.headers) for r in buffered))
    assert most <= 8 * 1024 * 1024 + 16 * 1024 * 1024  # the bound plus what one fetch may add
    release.set()
    run(w, lambda: len(parts.rows) == 100 and w.idle(), "every task")
    w.close()


def test_transactional_tasks_ready_together_share_a_group_and_a_raising_one_fails_alone() -> None:
    handlers, connections = Handlers(), []

    @handlers.task("unit.Job", schema=JOB, transactional=True, max_attempts=1)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        connections.append(ctx.db)  # kept alive, so no two connections share an id
        if payload["n"] == 3:
            raise ValueError("three is rejected")

    parts = Parts(handlers)
    for n in range(6):
        parts.producer.enqueue("unit.Job", {"n": n}, idempotency_key=f"k{n}")
    parts.producer.flush()
    w = parts.worker("a", concurrency=1)
    for _ in range(50):
        w.step()
        if len(connections) == 6 and w.idle():
            break
    # One slot, six ready tasks: the first group takes half of them, in one transaction.
    assert len({id(c) for c in connections}) == 4
    assert sorted(k for k, row in parts.rows.items() if row.state == "completed") == ["k0", "k1", "k2", "k4", "k5"]
    assert parts.rows["k3"].state == "dead"
    w.close()


def test_a_deep_buffer_goes_into_few_large_groups_not_one_per_free_slot() -> None:
    handlers, connections = Handlers(), []

    @handlers.task("unit.Job", schema=JOB, transactional=True)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        connections.append(ctx.db)  # kept alive, so no two connections share an id

    parts = Parts(handlers)
    for n in range(12):
        parts.producer.enqueue("unit.Job", {"n": n}, idempotency_key=f"k{n}")
    parts.producer.flush()
    w = parts.worker("a", concurrency=4)
    for _ in range(50):
        w.step()
        if len(connections) == 12 and w.idle():
            break
    # Twelve ready tasks, four free slots: half of them in one group of six, not four groups of one.
    assert max(Counter(id(c) for c in connections).values()) == 6
    assert len([k for k, row in parts.rows.items() if row.state == "completed"]) == 12
    w.close()


def test_a_task_abandoned_at_shutdown_keeps_its_offset_uncommitted_whatever_it_reports_later() -> None:
    handlers, started, release = Handlers(), threading.Event(), threading.Event()

    @handlers.task("unit.Job", schema=JOB, transactional=True, group_commit=False)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        started.set()
        release.wait(10)

    parts = Parts(handlers)
    parts.producer.enqueue("unit.Job", {"n": 1}, idempotency_key="slow")
    parts.producer.flush()
    w = parts.worker("a", concurrency=1, shutdown_timeout=0.2)
    for _ in range(100):
        if started.is_set():
            break
        w.step()
    assert started.wait(10)
    w.stop()
    w._shutdown()  # the attempt outlives the shutdown timeout: abandoned, its key freed for the next owner
    assert parts.rows["slow"].state == "failed"
    release.set()  # the abandoned attempt ends; its completion finds the lease gone (LeaseLostError)
    wait_until(lambda: not w._outcomes.empty(), timeout=10, what="the abandoned attempt to report")
    w._revoked_cb(sorted(w._assigned))  # what closing the Kafka consumer does: a last revocation and commit
    # Had the late outcome marked its offset done, that commit would skip the task for good.
    assert parts.broker.uncommitted(w.group, w.topics.priority_topics) == 1


def test_a_stopping_worker_hands_its_partitions_over_while_it_finishes_what_runs() -> None:
    # SIGTERM, then a second worker joins while the first still finishes a long task: the first keeps
    # serving the group, so the newcomer gets its share at once instead of after the first one has left.
    handlers, started, release = Handlers(), threading.Event(), threading.Event()
    runs: list[int] = []

    @handlers.task("unit.Job", schema=JOB)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        if payload["n"] == 0:
            started.set()
            release.wait(30)
        runs.append(payload["n"])

    parts = Parts(handlers)
    parts.producer.enqueue("unit.Job", {"n": 0}, priority="critical")
    for n in range(1, 41):
        parts.producer.enqueue("unit.Job", {"n": n}, priority="normal")
    parts.producer.flush()
    a = parts.worker("a", concurrency=1, shutdown_timeout=30, revoke_timeout=0.2)
    run(a, started.is_set, "the long task to start")
    a.stop()
    stopping = threading.Thread(target=a._shutdown)
    stopping.start()
    b = parts.worker("b", concurrency=2)
    run(b, lambda: parts.completed.get("b", 0) > 0, "the newcomer to run tasks while the first one stops")
    assert stopping.is_alive()  # the first worker is still finishing its long task
    release.set()
    stopping.join(30)
    a.close()
    topics = b.topics.priority_topics
    run(b, lambda: b.idle() and parts.broker.uncommitted(b.group, topics) == 0, "everything committed")
    assert sorted(runs) == list(range(41))
    b.close()


def test_tasks_that_waited_long_renew_their_leases_and_one_taken_over_meanwhile_is_dropped() -> None:
    handlers, runs = Handlers(), []

    @handlers.task("unit.Job", schema=JOB)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        runs.append(payload["n"])

    parts = Parts(handlers)
    for n in range(3):
        parts.producer.enqueue("unit.Job", {"n": n}, priority="normal", idempotency_key=f"k{n}")
    parts.producer.flush()
    w = parts.worker("a", concurrency=2, claim_wait=10.0)
    w._source.poll(0, 0.0)  # type: ignore[union-attr]  # joins the group: partitions assigned
    for record in w._source.poll(10, 0.0):  # type: ignore[union-attr]
        w._accept(record)
    w._claim_arrived()
    parts.clock.advance(400)  # they waited past their leases (the default lease plus claim_wait)
    other = InMemoryStore(owner="b", clock=parts.clock.time, rows=parts.rows)
    (taken,) = other.claim([ClaimRequest("k1", "t", "unit.Job", 300.0)])
    assert taken.outcome == "claimed"
    run(w, lambda: w.idle(), "the buffered tasks")
    assert sorted(runs) == [0, 2]  # k1 belongs to the worker that took it over
    assert parts.rows["k0"].state == parts.rows["k2"].state == "completed"
    w.close()


def test_a_starting_worker_waits_for_no_partition_that_flow_control_paused() -> None:
    # librdkafka delivers partition by partition: a tier whose buffered share filled from its first
    # partitions is paused, and its other partitions deliver nothing. The first dispatch waits (SETTLE) for
    # partitions that have records to deliver, but not for these: their tier has its share already.
    handlers = Handlers()

    @handlers.task("unit.Job", schema=JOB)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        pass

    parts = Parts(handlers, partitions=6)
    for n in range(100):
        parts.producer.enqueue("unit.Job", {"n": n}, priority="normal", idempotency_key=f"k{n}")
    parts.producer.flush()
    w = parts.worker("a", buffer_capacity=64, concurrency=4)
    w.step()  # assigned, fetched
    undelivered = next(tp for tp in sorted(w._assigned) if tp[0].endswith(".normal"))
    # As librdkafka leaves it: the partition has records, delivered none yet, and its tier was paused full.
    w._dispatched, w._settling = False, {undelivered: parts.clock.monotonic()}
    w._paused.add(undelivered)
    assert w._settled()
    w._paused.discard(undelivered)  # a partition still fetched is waited for (until SETTLE)
    w._dispatched, w._settling = False, {undelivered: parts.clock.monotonic()}
    assert not w._settled()
    w.close()


def test_a_starting_worker_with_a_full_buffer_waits_only_for_tiers_short_of_their_reserve() -> None:
    # The buffer filled before every partition delivered (the first tiers fetched came first). A partition
    # of a tier that holds its reserve is not waited for (a worker started on a backlog stood still for
    # SETTLE); one of a short tier is, and its records are taken at once though the buffer is full (started
    # without them, the first hundreds of tasks ran that tier below its weight).
    handlers = Handlers()

    @handlers.task("unit.Job", schema=JOB)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        pass

    parts = Parts(handlers, partitions=6)
    for n in range(300):
        tier = ("high", "normal", "low")[n % 3]
        parts.producer.enqueue("unit.Job", {"n": n}, priority=tier, idempotency_key=f"k{n}")
    parts.producer.flush()
    w = parts.worker("a", buffer_capacity=16, concurrency=4)
    w.step()  # assigned, fetched, claimed
    w._source.resume(sorted(w._paused))  # type: ignore[union-attr]
    for record in w._source.poll(16 - len(w._scheduler), 0.0):  # type: ignore[union-attr]
        w._accept(record)  # as a take larger than flow control's headroom leaves it: full
    w._claim_arrived()
    w._completer.settle()
    assert len(w._scheduler) == 16
    for n in range(12):  # critical's records, on their way
        parts.producer.enqueue("unit.Job", {"n": n}, priority="critical", idempotency_key=f"c{n}")
    parts.producer.flush()
    critical = [tp for tp in sorted(w._assigned) if tp[0].endswith(".critical")]
    undelivered = next(tp for tp, end in w._source.high_watermarks(critical).items() if end)  # type: ignore[union-attr]
    full = next(tp for tp in sorted(w._assigned) if tp[0].endswith(".high"))
    w._dispatched, w._settling = False, {full: parts.clock.monotonic()}
    assert w._settled()  # high holds its reserve: nothing to wait for
    w._dispatched, w._settling = False, {undelivered: parts.clock.monotonic()}
    w._paused.discard(undelivered)  # still fetched, and it has records (high watermark below)
    assert not w._settled()  # critical holds none of its reserve
    w.step()  # takes critical's records though the buffer is full, and starts
    assert w._dispatched
    assert any(t.envelope.priority == "critical" for t in [*w._scheduler, *w._running.values()])
    w.close()


def test_the_loop_is_sampled_for_the_gauges_every_sample_interval_not_every_tick() -> None:
    # A sample (and the gauges it sets) per tick cost more than a burn-down's tick did, one tick per few tasks.
    handlers = Handlers()

    @handlers.task("unit.Job", schema=JOB)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        pass

    parts = Parts(handlers, partitions=2)
    samples: list[LoopSampled] = []
    w = parts.worker("a")
    w._hooks = Hooks(
        (*w._hooks.all, lambda event: samples.append(event) if isinstance(event, LoopSampled) else None)
    )
    for _ in range(5):
        w._observe()  # as five ticks in a row do (an idle step waits for Kafka: real time passes)
    assert len(samples) == 1
    parts.clock.advance(SAMPLE_EVERY)
    w._observe()
    assert len(samples) == 2
    w.close()



class _Only:
    """A hook that takes the kinds of event it names and records them."""

    def __init__(self, *kinds: type[Any]) -> None:
        self.event_types = kinds
        self.seen: list[Event] = []

    def __call__(self, event: Event) -> None:
        self.seen.append(event)


def test_a_hook_naming_its_event_types_gets_only_those_and_the_worker_builds_no_other_per_task_event(
    monkeypatch: Any,
) -> None:
    built: Counter[str] = Counter()
    for name in ("AttemptStarted", "AttemptSucceeded", "TaskCompleted"):
        kind = getattr(events, name)

        class Counted(kind):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, name: str = name, **kwargs: Any) -> None:
                built[name] += 1
                super().__init__(*args, **kwargs)

        monkeypatch.setattr(events, name, Counted)  # as the worker's stages build them
    handlers = Handlers()

    @handlers.task("unit.Job", schema=JOB)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        pass

    parts = Parts(handlers)
    hook = _Only(events.TaskCompleted, events.PartitionsAssigned)
    worker = Worker(
        handlers,
        parts.settings,
        WorkerConfig(worker_id="a", forwarder=False, commit_interval=0.001),
        broker=parts.broker,
        store=InMemoryStore(owner="a", clock=parts.clock.time, rows=parts.rows),
        registry=parts.registry,
        clock=parts.clock.monotonic,
        hooks=[hook],
    )
    worker.start()
    for n in range(5):
        parts.producer.enqueue("unit.Job", {"n": n}, idempotency_key=f"k{n}")
    parts.producer.flush()
    run(worker, lambda: built["TaskCompleted"] == 5, "5 completions")

    kinds = Counter(type(e).__mro__[1 if type(e).__name__ == "Counted" else 0].__name__ for e in hook.seen)
    assert kinds["TaskCompleted"] == 5 and kinds["PartitionsAssigned"] >= 1
    assert set(kinds) == {"TaskCompleted", "PartitionsAssigned"}  # no start, commit or loop sample
    assert built == Counter({"TaskCompleted": 5})  # nor a start or a success built for no hook
    worker.close()
