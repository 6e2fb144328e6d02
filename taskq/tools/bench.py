"""Benchmarks of the worker runtime and of the ceiling its design allows, each in a namespace of its own.

The namespace (topics, consumer groups, Postgres schema, registry subject) is created for one run and deleted
after it, so a benchmark never reads another run's tasks nor leaves records behind. Times come from the
worker's events: enqueue, attempt start and recorded completion of every idempotency key, on the monotonic
clock (CLOCK_MONOTONIC on Linux: one clock for every process of the machine, so worker processes' times
compare with the parent's).
"""

from __future__ import annotations

import cProfile
import logging
import multiprocessing
import os
import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, Protocol

import psycopg

# The ceiling measures librdkafka itself, so this is the one module besides taskq._core.kafka that holds its
# clients; their settings are the adapter's own (producer_config, consumer_config).
from confluent_kafka import Consumer, Message, Producer, TopicPartition

from taskq._core.db import Database, Transaction
from taskq._core.envelope import PRIORITIES, H, Topics
from taskq._core.errors import ConfigurationError, KafkaUnavailableError, TaskqError
from taskq._core.kafka import TP, Admin, consumer_config, producer_config
from taskq._core.settings import Settings
from taskq._core.store import ClaimRequest, Finished, Store
from taskq.consumer.events import AttemptStarted, Event, PartitionsAssigned, PartitionsRevoked, TaskCompleted
from taskq.consumer.handlers import Handlers, TaskContext
from taskq.consumer.worker import GROUP_MAX, Worker, WorkerConfig
from taskq.producer.admin import create_topics
from taskq.producer.producer import TaskProducer
from taskq.schemas import Registry

__all__ = ["BENCH_HANDLERS", "bench_ceiling", "bench_latency", "bench_worker", "scratch_namespace"]

log = logging.getLogger("taskq.bench")

BenchHandler = Literal["noop", "transactional"]
BENCH_HANDLERS: tuple[BenchHandler, ...] = ("noop", "transactional")

_EFFECTS_TABLE = "bench_effects"
#: The lease a bench task's claim asks for: the worker's default for a task type without a timeout.
_LEASE_SECONDS = WorkerConfig.default_lease
#: The ceiling's consuming passes, each in a group of its own (`<namespace>.ceiling-<pass>`).
_CEILING_PASSES = ("commit", "claim", "transactional")
#: How often a bench worker reports its new start and completion times to the parent.
_REPORT_EVERY = 0.1


def _handlers(task_type: str, schema: dict[str, Any], handler: BenchHandler) -> Handlers:
    handlers = Handlers()
    if handler == "transactional":

        @handlers.task(task_type, schema=schema, transactional=True)
        def write_one_row(payload: dict[str, Any], ctx: TaskContext) -> None:
            ctx.db.execute(
                f"INSERT INTO {_EFFECTS_TABLE} (key, i) VALUES (%s, %s)", (ctx.idempotency_key, payload["i"])
            )

    else:

        @handlers.task(task_type, schema=schema)
        def noop(payload: dict[str, Any], ctx: TaskContext) -> None:
            return None

    return handlers


def _ms(values: Sequence[float]) -> dict[str, float | None]:
    """p50, p90, p99 and max of durations in seconds, in milliseconds."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1e3

    return {
        "p50": statistics.median(ordered) * 1e3,
        "p90": pct(0.9),
        "p99": pct(0.99),
        "max": ordered[-1] * 1e3,
    }


# ---------------------------------------------------------------------------------------------- namespace
@dataclass(frozen=True)
class _Run:
    """One benchmark's namespace: its settings and its one task type."""

    settings: Settings
    task_type: str
    schema: dict[str, Any]
    partitions: int


@contextmanager
def scratch_namespace(
    settings: Settings, prefix: str, *, partitions: int, groups: Sequence[str] = (), keep: bool = False
) -> Iterator[Settings]:
    """A namespace made for one run, `<prefix>-<stamp>`: its topics, and its own Postgres schema
    (`<prefix>_<stamp>`, migrated). After the run both are deleted, with the worker group, the forwarder's
    and `<namespace>.<group>` for each of `groups`, unless `keep`."""
    if partitions < 1:
        raise ConfigurationError(f"partitions must be >= 1, got {partitions}")
    stamp = time.time_ns() // 1000
    # Topic names allow '-', Avro names and SQL identifiers do not: the schema uses '_'.
    s = replace(settings.with_namespace(f"{prefix}-{stamp}"), database_schema=f"{prefix}_{stamp}")
    topics = Topics(s.namespace, s.delay_tiers)
    db = Database(s.database_url, schema=s.database_schema)
    broker_away = failed = False
    try:
        try:
            create_topics(s, partitions=partitions)
        except KafkaUnavailableError:
            broker_away = True  # nothing was made there; deleting would wait for the broker once more
            raise
        db.migrate(namespace=s.namespace)
        yield s
    except BaseException:
        failed = True
        raise
    finally:
        if not keep:
            try:
                if not broker_away:
                    admin = Admin(s)
                    admin.delete_topics([*topics.priority_topics, *topics.delay_topics, topics.dlq])
                    names = [s.worker_group, f"{s.namespace}.forwarder"]
                    names += [f"{s.namespace}.{g}" for g in groups]
                    try:
                        admin.delete_groups(names)
                    except KafkaUnavailableError as exc:  # a group the broker still sees members in: expires
                        log.warning("%s: %s", prefix, exc)
                db.drop_schema()
            except TaskqError as exc:
                if not failed:
                    raise
                # The run's own error is what to report (often the same outage): the clean-up's is a warning.
                log.warning("%s: namespace %s left behind: %s", prefix, s.namespace, exc)


@contextmanager
def _namespace(settings: Settings, *, partitions: int, handler: BenchHandler = "noop") -> Iterator[_Run]:
    """A scratch namespace with one task type, registered for the run; its effects table if transactional."""
    with scratch_namespace(
        settings, "bench", partitions=partitions, groups=[f"ceiling-{p}" for p in _CEILING_PASSES]
    ) as s:
        avro_ns = s.database_schema  # bench_<stamp>: a subject of the run's own
        schema = {
            "type": "record",
            "name": "Noop",
            "namespace": avro_ns,
            "fields": [{"name": "i", "type": "int"}],
        }
        run = _Run(s, f"{avro_ns}.Noop", schema, partitions)
        try:
            if handler == "transactional":
                db = Database(s.database_url, schema=s.database_schema)
                with db.connection() as conn:
                    conn.execute(f"CREATE TABLE {_EFFECTS_TABLE} (key text PRIMARY KEY, i int NOT NULL)")
            with Registry.from_settings(s) as registry:
                registry.register(schema)
            yield run
        finally:
            with Registry.from_settings(s) as registry:
                registry.delete_subject(run.task_type)


def _warm_up(producer: TaskProducer, run: _Run) -> None:
    """Send one task and wait for its ack, so the registry look-up and the producer id are not timed."""
    # Delayed to the longest delay tier, which no bench runs a forwarder for: it never joins the backlog.
    producer.enqueue(
        run.task_type,
        {"i": -1},
        idempotency_key="bench:warm-up",
        delay=run.settings.delay_tiers[-1],
        wait=True,
    )


def _enqueue(run: _Run, count: int) -> tuple[dict[str, float], float, float]:
    """`count` tasks over the four tiers by TaskProducer: (enqueue time of each key, seconds to all acked,
    process CPU seconds meanwhile, the Kafka client's threads included)."""
    enqueued: dict[str, float] = {}
    with TaskProducer(run.settings) as producer:
        _warm_up(producer, run)
        t0, cpu0 = time.monotonic(), time.process_time()
        for i in range(count):
            key = f"bench:{i}"
            enqueued[key] = time.monotonic()
            producer.enqueue(run.task_type, {"i": i}, priority=PRIORITIES[i % 4], idempotency_key=key)
        producer.flush(60)
        acked_s = time.monotonic() - t0
        cpu_s = time.process_time() - cpu0
    return enqueued, acked_s, cpu_s


def _enqueue_many(run: _Run, count: int, batch: int = 500) -> tuple[float, float]:
    """The tasks of _enqueue again, by enqueue_many in batches of `batch` per tier: (seconds to all acked,
    process CPU seconds meanwhile)."""
    with TaskProducer(run.settings) as producer:
        _warm_up(producer, run)
        t0, cpu0 = time.monotonic(), time.process_time()
        for tier, priority in enumerate(PRIORITIES):
            numbers = range(tier, count, 4)
            for start in range(0, len(numbers), batch):
                chunk = numbers[start : start + batch]
                producer.enqueue_many(
                    run.task_type,
                    [{"i": i} for i in chunk],
                    priority=priority,
                    idempotency_keys=[f"bench:{i}" for i in chunk],
                )
        producer.flush(60)
        return time.monotonic() - t0, time.process_time() - cpu0


# ------------------------------------------------------------------------------------------------ workers
@dataclass(frozen=True)
class _WorkerSpec:
    """What a bench worker is built from, picklable for a spawned process (Settings holds a mapping proxy)."""

    settings: dict[str, Any]
    task_type: str
    schema: dict[str, Any]
    handler: BenchHandler
    concurrency: int

    @classmethod
    def of(cls, run: _Run, handler: BenchHandler, concurrency: int) -> _WorkerSpec:
        """The spec of a worker in `run`'s namespace."""
        return cls(_picklable(run.settings), run.task_type, run.schema, handler, concurrency)


def _picklable(settings: Settings) -> dict[str, Any]:
    """Settings as keyword arguments a spawned process can be given (Settings holds a mapping proxy)."""
    values = {f.name: getattr(settings, f.name) for f in fields(settings)}
    values["kafka"] = dict(values["kafka"])
    return values


class _Channel(Protocol):
    def put(self, obj: Any) -> None: ...
    def get(self, block: bool = True, timeout: float | None = None) -> Any: ...


class _Flag(Protocol):
    def set(self) -> None: ...
    def wait(self, timeout: float | None = None) -> bool: ...


@dataclass
class _Report:
    """What one bench worker sends its parent every _REPORT_EVERY seconds, and once more when it stops."""

    runner: int
    started: list[tuple[str, float]] = field(default_factory=list)
    completed: list[tuple[str, float]] = field(default_factory=list)
    partitions: int = 0
    assigned_at: float | None = None
    launched_at: float | None = None
    cpu_s: float | None = None  # set in the last report: process CPU from launch to the stop request
    error: str | None = None
    final: bool = False


class _Recorder:
    """A worker hook keeping when each key's attempt started and its completion was recorded."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started: list[tuple[str, float]] = []
        self._completed: list[tuple[str, float]] = []
        self._partitions: set[TP] = set()
        self.assigned_at: float | None = None

    def __call__(self, event: Event) -> None:
        now = time.monotonic()
        with self._lock:
            if isinstance(event, TaskCompleted):
                self._completed.append((event.key, now))
            elif isinstance(event, AttemptStarted):
                self._started.append((event.key, now))
            elif isinstance(event, PartitionsAssigned):
                self._partitions.update(event.partitions)
                if self.assigned_at is None:
                    self.assigned_at = now
            elif isinstance(event, PartitionsRevoked):
                self._partitions.difference_update(event.partitions)

    def report(self, runner: int) -> _Report:
        """The times recorded since the last report."""
        with self._lock:
            started, self._started = self._started, []
            completed, self._completed = self._completed, []
            return _Report(runner, started, completed, len(self._partitions), self.assigned_at)


def _run_worker(
    runner: int, spec: _WorkerSpec, out: _Channel, stop: _Flag, parent: int | None, profile: str | None
) -> None:
    """Run one bench Worker until `stop` (or until its parent process dies), reporting to `out`."""
    recorder = _Recorder()
    failure: list[BaseException] = []
    cpu0 = time.process_time()
    worker = Worker(
        _handlers(spec.task_type, spec.schema, spec.handler),
        Settings(**spec.settings),
        WorkerConfig(concurrency=spec.concurrency, forwarder=False, metrics_port=None),
        hooks=[recorder],
    )
    profiler = cProfile.Profile() if profile else None

    def run() -> None:
        try:
            if profiler is not None:
                profiler.runcall(worker.run)
            else:
                worker.run()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name="taskq-bench-worker", daemon=True)
    launched_at = time.monotonic()
    thread.start()
    while not stop.wait(_REPORT_EVERY) and not failure and (parent is None or os.getppid() == parent):
        out.put(recorder.report(runner))
    cpu_s = time.process_time() - cpu0  # before shutdown: leaving the group is not part of the burn-down
    worker.stop()
    thread.join(60)
    if profiler is not None and profile is not None:
        profiler.dump_stats(profile)
    last = recorder.report(runner)
    last.launched_at, last.cpu_s, last.final = launched_at, cpu_s, True
    last.error = repr(failure[0]) if failure else None
    out.put(last)


def _spawned_worker(runner: int, spec: _WorkerSpec, out: _Channel, stop: _Flag, parent: int) -> None:
    """A spawned process's entry: one bench worker."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _run_worker(runner, spec, out, stop, parent, None)


def _commit_batch(consumer: Consumer, msgs: list[Message], *, asynchronous: bool) -> None:
    """Commit the offsets after a consumed batch, partition by partition."""
    offsets = {(m.topic() or "", m.partition() or 0): (m.offset() or 0) + 1 for m in msgs}
    parts = [TopicPartition(t, p, o) for (t, p), o in offsets.items()]
    if asynchronous:
        consumer.commit(offsets=parts, asynchronous=True)
    else:
        consumer.commit(offsets=parts, asynchronous=False)


def _claim_requests(msgs: list[Message]) -> list[ClaimRequest]:
    """What the worker asks of Postgres for a batch of task records: a claim of each one's key."""
    requests = []
    for m in msgs:
        h = dict(_headers(m))
        requests.append(
            ClaimRequest(
                h[H + "idempotency-key"].decode(),
                h[H + "task-id"].decode(),
                h[H + "task-type"].decode(),
                _LEASE_SECONDS,
            )
        )
    return requests


def _spawned_bare(runner: int, spec: _WorkerSpec, out: _Channel, stop: _Flag, parent: int) -> None:
    """A spawned process's entry: the framework-free loop of `bench ceiling` in place of a worker, for as
    long as the bench runs. Per batch of records: claim every key, complete the claimed ones, commit (not
    waiting for the broker). A task counts as started when its claim answers and as completed when its
    completion does: what this design's floor is for a worker's enqueue->start and ->completion."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    s = Settings(**spec.settings)
    launched_at, cpu0 = time.monotonic(), time.process_time()
    partitions: set[TP] = set()
    assigned_at: list[float] = []

    def on_assign(_: Consumer, parts: list[TopicPartition]) -> None:
        partitions.update((p.topic, p.partition) for p in parts)
        assigned_at[:] = assigned_at or [time.monotonic()]

    def on_revoke(_: Consumer, parts: list[TopicPartition]) -> None:
        partitions.difference_update((p.topic, p.partition) for p in parts)

    consumer = Consumer(consumer_config(s, group=s.worker_group))
    consumer.subscribe(Topics(s.namespace).priority_topics, on_assign=on_assign, on_revoke=on_revoke)
    store = Store(Database(s.database_url, schema=s.database_schema))
    owner = f"bench-bare:{os.getpid()}"
    report = _Report(runner)
    reported = time.monotonic()
    try:
        while not stop.wait(0) and os.getppid() == parent:
            # As the worker polls: what is there, else block for one record (and take what came with it).
            msgs = consumer.consume(500, 0)
            if not msgs:
                msgs = consumer.consume(1, 0.05)
                msgs += consumer.consume(499, 0) if msgs else []
            msgs = [m for m in msgs if m.error() is None]
            if msgs:
                claims = store.claim(s.namespace, owner, _claim_requests(msgs), stale_after=10.0)
                now = time.monotonic()
                claimed = [c for c in claims if c.outcome == "claimed"]
                report.started += [(c.idempotency_key, now) for c in claimed]
                done = [Finished(c.idempotency_key, c.attempts, "completed") for c in claimed]
                store.complete(s.namespace, owner, done)
                now = time.monotonic()
                report.completed += [(c.idempotency_key, now) for c in claimed]
                _commit_batch(consumer, msgs, asynchronous=True)
            if time.monotonic() - reported >= _REPORT_EVERY:
                report.partitions, report.assigned_at = len(partitions), next(iter(assigned_at), None)
                out.put(report)
                report, reported = _Report(runner), time.monotonic()
    except Exception as exc:  # reported to the parent, which stops the bench with it
        report.error = repr(exc)
    finally:
        report.cpu_s = time.process_time() - cpu0
        consumer.close()
        store.database.close()
    report.partitions, report.assigned_at = len(partitions), next(iter(assigned_at), None)
    report.launched_at, report.final = launched_at, True
    out.put(report)


class _Workers:
    """N bench workers in one group: a thread of this process for one (unless `spawn`), spawned processes
    for more; `bare`: spawned processes running the framework-free loop (`_spawned_bare`) instead."""

    def __init__(
        self,
        spec: _WorkerSpec,
        *,
        processes: int = 1,
        profile: str | None = None,
        spawn: bool = False,
        bare: bool = False,
    ) -> None:
        if processes < 1:
            raise ConfigurationError(f"processes must be >= 1, got {processes}")
        if profile and processes > 1:
            raise ConfigurationError("--profile profiles an in-process worker: use it with --processes 1")
        self.started: dict[str, float] = {}
        self.completed: dict[str, float] = {}
        self.partitions: dict[int, int] = {}
        self.assigned_at: float | None = None
        self.launched_at: float | None = None
        self.cpu_s = 0.0
        self._finals: list[_Report] = []
        self._runners: list[threading.Thread | multiprocessing.process.BaseProcess] = []
        if processes == 1 and not (spawn or bare):
            self._out: _Channel = queue.Queue()
            self._stop: _Flag = threading.Event()
            self._runners.append(
                threading.Thread(
                    target=_run_worker, args=(0, spec, self._out, self._stop, None, profile), daemon=True
                )
            )
        else:
            # spawn, never fork: this process already runs librdkafka and psycopg threads.
            ctx = multiprocessing.get_context("spawn")
            self._out, self._stop = ctx.Queue(), ctx.Event()
            target = _spawned_bare if bare else _spawned_worker
            self._runners += [
                ctx.Process(target=target, args=(i, spec, self._out, self._stop, os.getpid()), daemon=True)
                for i in range(processes)
            ]

    def __enter__(self) -> _Workers:
        for runner in self._runners:
            runner.start()
        return self

    def _take(self, timeout: float) -> bool:
        try:
            report: _Report = self._out.get(timeout=timeout)
        except queue.Empty:
            return False
        for key, t in report.started:
            self.started.setdefault(key, t)
        for key, t in report.completed:
            self.completed.setdefault(key, t)  # a copy redelivered across a rebalance counts once
        self.partitions[report.runner] = report.partitions
        if report.assigned_at is not None:
            self.assigned_at = min(self.assigned_at or report.assigned_at, report.assigned_at)
        if report.final:
            self._finals.append(report)
            self.cpu_s += report.cpu_s or 0.0
            if report.launched_at is not None:
                self.launched_at = min(self.launched_at or report.launched_at, report.launched_at)
        return True

    def wait(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        """Take reports until `done()`; TaskqError if a worker stopped or `timeout` seconds passed."""
        deadline = time.monotonic() + timeout
        while not done():
            if self._finals:
                raise TaskqError(f"bench: a worker stopped: {self._finals[0].error}")
            if not any(r.is_alive() for r in self._runners):  # died before it could report (see stderr)
                raise TaskqError("bench: every worker exited")
            if time.monotonic() > deadline:
                raise TaskqError(f"bench: {what} within {timeout}s")
            self._take(min(0.5, max(0.0, deadline - time.monotonic())))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        deadline = time.monotonic() + 90
        while len(self._finals) < len(self._runners) and time.monotonic() < deadline:
            if not any(r.is_alive() for r in self._runners):
                while self._take(1.0):  # what the runners put last may still be in the pipe
                    pass
                break
            self._take(0.5)
        for runner in self._runners:
            runner.join(30)
        errors = [r.error for r in self._finals if r.error]
        if errors and exc[0] is None:
            raise TaskqError(f"bench: a worker stopped: {errors[0]}")


# ------------------------------------------------------------------------------------------------- worker
def bench_worker(
    settings: Settings,
    *,
    count: int,
    concurrency: int = 4,
    processes: int = 1,
    handler: BenchHandler = "noop",
    partitions: int = 6,
    timeout: float = 600.0,
    profile: str | None = None,
) -> dict[str, Any]:
    """Enqueue `count` tasks over the four tiers, time `processes` Workers running them all, then clean up."""
    if count < 1:
        raise ConfigurationError(f"count must be >= 1, got {count}")
    if concurrency < 1:
        raise ConfigurationError(f"concurrency must be >= 1, got {concurrency}")
    if handler not in BENCH_HANDLERS:
        raise ConfigurationError(f"handler must be one of {', '.join(BENCH_HANDLERS)}, got {handler!r}")
    with _namespace(settings, partitions=partitions, handler=handler) as run:
        enqueued, enqueue_s, _ = _enqueue(run, count)
        workers = _Workers(_WorkerSpec.of(run, handler, concurrency), processes=processes, profile=profile)
        with workers:
            workers.wait(
                lambda: len(workers.completed) >= count, timeout, f"not every one of {count} tasks ran"
            )
        completed, started = workers.completed, workers.started
        effects = None
        if handler == "transactional":
            db = Database(run.settings.database_url, schema=run.settings.database_schema)
            with db.connection() as conn:
                row = conn.execute(f"SELECT count(*) AS n FROM {_EFFECTS_TABLE}").fetchone()
                effects = int(row["n"]) if row else 0

    done = len(completed)
    t_end = max(completed.values())
    t_launch = workers.launched_at or min(started.values())
    t_assigned = workers.assigned_at or t_launch
    t_first = min(enqueued.values())
    return {
        "tasks": count,
        "completed": done,
        "handler": handler,
        "concurrency": concurrency,
        "processes": processes,
        "partitions": partitions,
        "namespace": run.settings.namespace,
        "enqueue_s": enqueue_s,
        # From Worker.run() (the earliest, over the processes) to the last recorded completion: joining the
        # group included.
        "elapsed_s": t_end - t_launch,
        "tasks_per_s": done / (t_end - t_launch),
        "startup_s": t_assigned - t_launch,
        "tasks_per_s_after_assignment": done / (t_end - t_assigned),
        # From the first enqueue to the last completion: enqueueing the backlog included.
        "tasks_per_s_from_first_enqueue": done / (t_end - t_first),
        # Process CPU of the worker(s) from Worker.run() to the last completion, per task.
        "worker_cpu_ms_per_task": workers.cpu_s / done * 1e3,
        # All tasks are enqueued before the worker starts, so these include waiting behind the backlog.
        "enqueue_to_start_ms": _ms([started[k] - enqueued[k] for k in completed if k in started]),
        "enqueue_to_completion_ms": _ms([completed[k] - enqueued[k] for k in completed]),
        # From the handler's start to the completion recorded in Postgres (claim batching excluded).
        "attempt_to_recorded_ms": _ms([completed[k] - started[k] for k in completed if k in started]),
        "effects": effects,
    }


# ------------------------------------------------------------------------------------------------ latency
def bench_latency(
    settings: Settings,
    *,
    rate: float,
    duration: float = 10.0,
    concurrency: int = 4,
    processes: int = 1,
    partitions: int = 6,
    timeout: float = 120.0,
    bare: bool = False,
) -> dict[str, Any]:
    """Run Workers in processes of their own, enqueue `rate` tasks/s on a fixed schedule for `duration` s
    from this one, and time each task's way. `bare`: the framework-free loop of `bench ceiling` in place of
    the workers, the floor of these figures on the same machine."""
    if not rate > 0:
        raise ConfigurationError(f"rate must be > 0, got {rate}")
    if not duration > 0:
        raise ConfigurationError(f"duration must be > 0, got {duration}")
    if concurrency < 1:
        raise ConfigurationError(f"concurrency must be >= 1, got {concurrency}")
    count = max(1, round(rate * duration))
    enqueued: dict[str, float] = {}
    behind: list[float] = []
    with _namespace(settings, partitions=partitions) as run:
        all_partitions = 4 * partitions
        # The workers never share this process's interpreter with the sender: under one GIL each would
        # delay the other, and the figures would be of the benchmark.
        spec = _WorkerSpec.of(run, "noop", concurrency)
        with _Workers(spec, processes=processes, spawn=True, bare=bare) as workers:
            workers.wait(
                lambda: sum(workers.partitions.values()) >= all_partitions,
                timeout,
                f"the worker was not assigned all {all_partitions} partitions",
            )
            with TaskProducer(run.settings) as producer:
                _warm_up(producer, run)
                t0 = time.monotonic()
                for i in range(count):
                    # Open loop: the i-th send is due at t0 + i/rate whatever happened to the ones before, so
                    # a slow send makes the next ones late but never moves the schedule.
                    due = t0 + i / rate
                    now = time.monotonic()
                    if now < due:
                        time.sleep(due - now)
                    else:
                        behind.append(now - due)
                    key = f"bench:{i}"
                    enqueued[key] = time.monotonic()
                    producer.enqueue(run.task_type, {"i": i}, priority=PRIORITIES[i % 4], idempotency_key=key)
                sent_s = time.monotonic() - t0
                producer.flush(60)
            workers.wait(
                lambda: len(workers.completed) >= count, timeout, f"not every one of {count} tasks ran"
            )
        completed, started, cpu_s = workers.completed, workers.started, workers.cpu_s

    keys = [k for k in enqueued if k in completed]
    return {
        "rate": rate,
        "duration_s": duration,
        "tasks": count,
        "completed": len(keys),
        "concurrency": concurrency,
        "processes": processes,
        "partitions": partitions,
        "bare": bare,
        "namespace": run.settings.namespace,
        # Sends per second actually made over the schedule (the rate when the sender kept up).
        "achieved_rate_per_s": count / sent_s if sent_s > 0 else None,
        # Sends that found themselves behind their scheduled time, and by how much at most.
        "late_sends": len(behind),
        "max_behind_schedule_ms": max(behind, default=0.0) * 1e3,
        # Process CPU of the workers (or bare loops), all threads, from launch to the stop request (joining
        # the group and idle waits included), per task sent.
        "worker_cpu_ms_per_task": cpu_s / count * 1e3,
        "enqueue_to_start_ms": _ms([started[k] - enqueued[k] for k in keys if k in started]),
        "enqueue_to_completion_ms": _ms([completed[k] - enqueued[k] for k in keys]),
    }


# ------------------------------------------------------------------------------------------------ ceiling


def _headers(msg: Message) -> list[tuple[str, bytes]]:
    raw: Any = msg.headers() or []
    return [(str(k), v.encode() if isinstance(v, str) else (v or b"")) for k, v in raw]


def _consume_pass(
    run: _Run, group: str, count: int, timeout: float, batch: Callable[[list[Message]], None] | None
) -> dict[str, float]:
    """One framework-free pass over the backlog in its own group: consume(500), `batch` it, commit it."""
    consumer = Consumer(consumer_config(run.settings, group=group))
    assigned: list[float] = []
    consumer.subscribe(
        Topics(run.settings.namespace).priority_topics,
        on_assign=lambda c, parts: assigned.append(time.monotonic()) if not assigned else None,
    )
    t_subscribed = time.monotonic()
    deadline = t_subscribed + timeout
    seen = 0
    try:
        while seen < count:
            if time.monotonic() > deadline:
                raise TaskqError(f"bench: {seen} of {count} records consumed within {timeout}s")
            msgs = [m for m in consumer.consume(500, 0.25) if m.error() is None]
            if not msgs:
                continue
            if batch is not None:
                batch(msgs)
            _commit_batch(consumer, msgs, asynchronous=False)
            seen += len(msgs)
        t_end = time.monotonic()
    finally:
        consumer.close()
    t_assigned = assigned[0] if assigned else t_subscribed
    return {"tasks_per_s": seen / (t_end - t_assigned), "startup_s": t_assigned - t_subscribed}


def _transactional_loop(values: dict[str, Any], count: int, timeout: float, seen: Any, out: _Channel) -> None:
    """A spawned process's entry: the transactional ceiling's loop, in a group with the others, until they
    have consumed `count` records together (`seen`, shared). Per batch of records one claim, then per
    GROUP_MAX claimed tasks one transaction holding, per task, a savepoint and the transactional bench
    handler's INSERT, and the completions, its statements pipelined (two round trips a group), then the
    commit of the batch. Puts (first assignment, last commit, records consumed, error) to `out`."""
    s = Settings(**values)
    store = Store(Database(s.database_url, schema=s.database_schema))
    conn = store.database.connect(autocommit=False)
    tx = Transaction(store.database, conn)
    owner = f"bench-ceiling:{os.getpid()}"
    insert = f"INSERT INTO {_EFFECTS_TABLE} (key, i) VALUES (%s, %s)"
    consumer = Consumer(consumer_config(s, group=f"{s.namespace}.ceiling-transactional"))
    assigned: list[float] = []
    consumer.subscribe(
        Topics(s.namespace).priority_topics,
        on_assign=lambda c, parts: assigned.append(time.monotonic()) if not assigned else None,
    )
    mine, ended, error = 0, None, None
    deadline = time.monotonic() + timeout
    try:
        while seen.value < count and time.monotonic() < deadline:
            msgs = [m for m in consumer.consume(500, 0.1) if m.error() is None]
            if not msgs:
                continue
            answers = store.claim(s.namespace, owner, _claim_requests(msgs), stale_after=10.0)
            claimed = [c for c in answers if c.outcome == "claimed"]
            # Groups as the worker bounds them: past 64 subtransactions a transaction overflows a cache.
            for claims in (claimed[i : i + GROUP_MAX] for i in range(0, len(claimed), GROUP_MAX)):
                done = [Finished(c.idempotency_key, c.attempts, "completed") for c in claims]
                with conn.pipeline(), psycopg.Transaction(conn):
                    cur = conn.cursor()
                    for i, c in enumerate(claims):
                        cur.execute(f"SAVEPOINT taskq_member_{i}", prepare=False)
                        cur.execute(insert, (c.idempotency_key, i))
                    answered = store.send_complete(s.namespace, owner, done, tx=tx)
                if len(answered()) != len(done):
                    raise TaskqError("bench: a completion of the transactional pass was not recorded")
            _commit_batch(consumer, msgs, asynchronous=False)
            ended = time.monotonic()
            mine += len(msgs)
            with seen.get_lock():
                seen.value += len(msgs)
    except Exception as exc:  # reported to the parent, which raises it
        error = repr(exc)
    finally:
        consumer.close()
        conn.close()
        store.database.close()
    out.put((assigned[0] if assigned else None, ended, mine, error))


def _transactional_pass(run: _Run, count: int, timeout: float, processes: int) -> dict[str, float]:
    """The ceiling of group commit without the framework (`_transactional_loop`), in `processes` spawned
    processes of one group: tasks/s from the first assignment to the last commit."""
    values = _picklable(run.settings)
    ctx = multiprocessing.get_context("spawn")
    seen, out = ctx.Value("q", 0), ctx.Queue()
    loops = [
        ctx.Process(target=_transactional_loop, args=(values, count, timeout, seen, out), daemon=True)
        for _ in range(processes)
    ]
    for loop in loops:
        loop.start()
    try:
        results = [out.get(timeout=timeout + 60) for _ in loops]
    except queue.Empty:
        raise TaskqError(f"bench: the transactional pass did not end within {timeout}s") from None
    finally:
        for loop in loops:
            loop.join(30)
    errors = [r[3] for r in results if r[3]]
    if errors or seen.value < count:
        raise TaskqError(f"bench: transactional pass: {errors[0] if errors else f'{seen.value} of {count}'}")
    start = min(r[0] for r in results if r[0] is not None)
    end = max(r[1] for r in results if r[1] is not None)
    db = Database(run.settings.database_url, schema=run.settings.database_schema)
    with db.connection() as conn:
        row = conn.execute(f"SELECT count(*) AS n FROM {_EFFECTS_TABLE}").fetchone()
    completed = Store(db).counts(run.settings.namespace).get("completed", 0)
    db.close()
    return {
        "tasks_per_s": seen.value / (end - start),
        "effects": int(row["n"]) if row else 0,
        "completed": completed,
    }


def bench_ceiling(
    settings: Settings,
    *,
    count: int = 20_000,
    partitions: int = 6,
    timeout: float = 600.0,
    with_worker: bool = False,
    concurrency: int = 4,
    processes: int = 1,
) -> dict[str, Any]:
    """What Kafka and Postgres allow this design without the framework: consume, claim, complete, produce."""
    if count < 1:
        raise ConfigurationError(f"count must be >= 1, got {count}")
    with _namespace(settings, partitions=partitions) as run:
        s = run.settings
        _, enqueue_s, enqueue_cpu_s = _enqueue(run, count)
        commit_only = _consume_pass(run, f"{s.namespace}.ceiling-commit", count, timeout, None)

        store = Store(Database(s.database_url, schema=s.database_schema))
        owner = f"bench-ceiling:{os.getpid()}"
        sample: list[Message] = []
        claimed = 0

        def claim_and_complete(msgs: list[Message]) -> None:
            # The worker's own two statements, each once per batch: claim every key, complete the claimed.
            nonlocal claimed
            answers = store.claim(s.namespace, owner, _claim_requests(msgs), stale_after=10.0)
            claims = [c for c in answers if c.outcome == "claimed"]
            done = [Finished(c.idempotency_key, c.attempts, "completed") for c in claims]
            store.complete(s.namespace, owner, done)
            claimed += len(claims)
            sample[:] = sample or msgs[:1]

        claim_complete = _consume_pass(
            run, f"{s.namespace}.ceiling-claim", count, timeout, claim_and_complete
        )
        recorded = store.counts(s.namespace).get("completed", 0)

        store.database.close()

        # A real TaskProducer record, value and headers as they are, sent again as fast as acks=all allows.
        value, sampled = sample[0].value() or b"", _headers(sample[0])
        record_bytes = len(value) + sum(len(k) + len(v) for k, v in sampled)
        headers: list[tuple[str, str | bytes | None]] = list(sampled)
        topics = Topics(s.namespace).priority_topics
        admin = Admin(s)
        producer = Producer(producer_config(s))
        # One record to every partition first, acknowledged: the producer id, the metadata and (measured: half
        # a second at 2,000 tasks) a new producer's first write to a partition another producer wrote to.
        for topic in topics:
            for partition in range(run.partitions):
                producer.produce(
                    topic, value=value, key=b"bench:warm-up", headers=headers, partition=partition
                )
        producer.flush(60)
        before = sum(admin.end_offsets(topics).values())
        t0, cpu0 = time.monotonic(), time.process_time()
        for i in range(count):
            key = f"bench:{i}".encode()  # the same key TaskProducer gave the i-th task
            while True:
                try:
                    producer.produce(topics[i % 4], value=value, key=key, headers=headers)
                    break
                except BufferError:
                    producer.poll(0.05)
        if producer.flush(60):
            raise TaskqError(f"bench: {len(producer)} records not acknowledged within 60s")
        produce_s = time.monotonic() - t0
        produce_cpu_s = time.process_time() - cpu0
        acked = sum(admin.end_offsets(topics).values()) - before
        # Last, into topics nobody reads any more: the same tasks again, in batches of enqueue_many.
        before = sum(admin.end_offsets(topics).values())
        bulk_s, bulk_cpu_s = _enqueue_many(run, count)
        # The warm-up task goes to a delay topic, so these are the batches' records alone.
        bulk_acked = sum(admin.end_offsets(topics).values()) - before

    # Like every figure, from a new deployment's empty idempotency table: a namespace of its own each.
    transactional = {}
    for n in (1, 2):
        with _namespace(settings, partitions=partitions, handler="transactional") as tx_run:
            _enqueue(tx_run, count)
            transactional[n] = _transactional_pass(tx_run, count, timeout, n)

    data: dict[str, Any] = {
        "tasks": count,
        "partitions": partitions,
        "namespace": s.namespace,
        "record_bytes": record_bytes,
        # From the first partition assignment to the last commit, each in a group of its own.
        "consume_commit_per_s": commit_only["tasks_per_s"],
        "consume_claim_complete_commit_per_s": claim_complete["tasks_per_s"],
        "claimed": claimed,
        "completed": recorded,
        # Claim, then per task a savepoint and one INSERT, and the completions, in one transaction a batch.
        # In one process, and in two of one group (as `bench worker --processes 2` is compared with it).
        "group_max": GROUP_MAX,
        "transactional_per_s": transactional[1]["tasks_per_s"],
        "transactional_completed": transactional[1]["completed"],
        "transactional_effects": transactional[1]["effects"],
        "transactional_2_processes_per_s": transactional[2]["tasks_per_s"],
        "transactional_2_processes_completed": transactional[2]["completed"],
        "transactional_2_processes_effects": transactional[2]["effects"],
        # acks=all, idempotent, the producer's own settings; from the first send to the last ack.
        "raw_produce_per_s": acked / produce_s,
        "produced": acked,
        "task_producer_per_s": count / enqueue_s,
        "task_producer_fraction": count / enqueue_s / (acked / produce_s),
        # The same tasks by enqueue_many, 500 a call (one task type and tier each), until all acked.
        "task_producer_bulk_per_s": count / bulk_s,
        "produced_bulk": bulk_acked,
        # Process CPU per record of each (the Kafka client's threads included): steadier than the rates
        # on a busy machine.
        "raw_produce_cpu_us": produce_cpu_s / count * 1e6,
        "task_producer_cpu_us": enqueue_cpu_s / count * 1e6,
        "task_producer_bulk_cpu_us": bulk_cpu_s / count * 1e6,
        "task_producer_bulk_fraction": count / bulk_s / (acked / produce_s),
    }
    if with_worker:
        # In a namespace and idempotency table of its own, like every figure; compared from assignment on.
        worker = bench_worker(
            settings,
            count=count,
            concurrency=concurrency,
            processes=processes,
            partitions=partitions,
            timeout=timeout,
        )
        data["worker"] = worker
        data["worker_fraction"] = (
            worker["tasks_per_s_after_assignment"] / data["consume_claim_complete_commit_per_s"]
        )
    return data
