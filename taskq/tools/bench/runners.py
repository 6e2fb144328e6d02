"""The bench workers: Workers (or the framework-free loop of `bench ceiling`) in a thread or in spawned
processes of one group, reporting when each key's attempt started and its completion was recorded."""

from __future__ import annotations

import logging
import math
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

# The bare loop measures librdkafka itself, so this module and the ceiling's are the only ones besides
# taskq._core's Kafka adapter that hold its clients; their settings are the adapter's own (consumer_config).
from confluent_kafka import Consumer, Message, TopicPartition

from taskq._core.broker import TP
from taskq._core.db import Database
from taskq._core.envelope import H, Topics
from taskq._core.errors import ConfigurationError, TaskqError
from taskq._core.kafka import consumer_config
from taskq._core.settings import Settings
from taskq._core.store import ClaimRequest, Finished, Store
from taskq.consumer.claims import CLAIM_ENOUGH
from taskq.consumer.events import AttemptStarted, Event, PartitionsAssigned, PartitionsRevoked, TaskCompleted
from taskq.consumer.handlers import Handlers, TaskContext
from taskq.consumer.worker import Worker, WorkerConfig
from taskq.tools.bench.effects import EFFECTS_TABLE, BenchHandler

if TYPE_CHECKING:
    from taskq.tools.bench.run import _Run

#: The lease a bench task's claim asks for: the worker's default for a task type without a timeout.
_LEASE_SECONDS = WorkerConfig.default_lease
#: How often a bench worker reports its new start and completion times to the parent.
_REPORT_EVERY = 0.1


def _handlers(
    task_type: str, schema: dict[str, Any], handler: BenchHandler, database: Database, opened: list[Any]
) -> Handlers:
    """The bench's one task type with `handler`'s body; connections the handler opens are added to `opened`
    (the caller closes them)."""
    handlers = Handlers()
    if handler == "transactional":

        @handlers.task(task_type, schema=schema, transactional=True)
        def write_one_row(payload: dict[str, Any], ctx: TaskContext) -> None:
            ctx.db.execute(
                f"INSERT INTO {EFFECTS_TABLE} (key, i) VALUES (%s, %s)", (ctx.idempotency_key, payload["i"])
            )

    elif handler == "plain":
        # The effect as most queues' users write it: its own autocommitted INSERT on a connection kept per
        # thread, outside the completion's transaction (at least once, not exactly once).
        local = threading.local()

        @handlers.task(task_type, schema=schema)
        def write_own_row(payload: dict[str, Any], ctx: TaskContext) -> None:
            conn = getattr(local, "conn", None)
            if conn is None or conn.closed:
                conn = local.conn = database.connect(autocommit=True)
                opened.append(conn)
            conn.execute(
                f"INSERT INTO {EFFECTS_TABLE} (key, i) VALUES (%s, %s) ON CONFLICT (key) DO NOTHING",
                (ctx.idempotency_key, payload["i"]),
            )

    else:

        @handlers.task(task_type, schema=schema)
        def noop(payload: dict[str, Any], ctx: TaskContext) -> None:
            return None

    return handlers


@dataclass(frozen=True)
class _WorkerSpec:
    """What a bench worker is built from, picklable for a spawned process (Settings holds a mapping proxy)."""

    settings: dict[str, Any]
    task_type: str
    schema: dict[str, Any]
    handler: BenchHandler
    concurrency: int
    share_group: bool = False
    claim_linger: float = WorkerConfig.claim_linger

    @classmethod
    def of(
        cls,
        run: _Run,
        handler: BenchHandler,
        concurrency: int,
        *,
        share_group: bool = False,
        claim_linger: float = WorkerConfig.claim_linger,
    ) -> _WorkerSpec:
        """The spec of a worker in `run`'s namespace."""
        settings = _picklable(run.settings)
        return cls(settings, run.task_type, run.schema, handler, concurrency, share_group, claim_linger)


def _picklable(settings: Settings) -> dict[str, Any]:
    """Settings as keyword arguments a spawned process can be given (Settings holds a mapping proxy)."""
    values = {f.name: getattr(settings, f.name) for f in fields(settings)}
    values["kafka"] = dict(values["kafka"])
    return values


class _Channel(Protocol):
    def put(self, obj: Any) -> None: ...


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

    #: The only events it reads: the worker builds no other per-task event for it.
    event_types = (AttemptStarted, TaskCompleted, PartitionsAssigned, PartitionsRevoked)

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
    settings = Settings(**spec.settings)
    database = Database(settings.database_url, schema=settings.database_schema)
    opened: list[Any] = []  # the plain handler's connections
    worker = Worker(
        _handlers(spec.task_type, spec.schema, spec.handler, database, opened),
        settings,
        WorkerConfig(
            concurrency=spec.concurrency,
            forwarder=False,
            metrics_port=None,
            share_group=spec.share_group,
            claim_linger=spec.claim_linger,
        ),
        hooks=[recorder],
    )
    profiler = None
    if profile:
        import cProfile  # only for --profile: a spawned worker's launch imports what a deployed one does

        profiler = cProfile.Profile()

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
    for conn in opened:
        conn.close()
    if profiler is not None and profile is not None:
        profiler.dump_stats(profile)
    last = recorder.report(runner)
    last.launched_at, last.cpu_s, last.final = launched_at, cpu_s, True
    last.error = repr(failure[0]) if failure else None
    out.put(last)


def _spawned_worker(runner: int, spec: _WorkerSpec, out: _Channel, stop: _Flag, parent: int) -> None:
    """A runner process's work: one bench worker."""
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


def _headers(msg: Message) -> list[tuple[str, bytes]]:
    raw: Any = msg.headers() or []
    return [(str(k), v.encode() if isinstance(v, str) else (v or b"")) for k, v in raw]


def _spawned_bare(runner: int, spec: _WorkerSpec, out: _Channel, stop: _Flag, parent: int) -> None:
    """A runner process's work: the framework-free loop of `bench ceiling` in place of a worker, for as
    long as the bench runs. Per batch of records: claim every key, complete the claimed ones, commit (not
    waiting for the broker). A task counts as started when its claim answers and as completed when its
    completion does: what this design's floor is for a worker's enqueue->start and ->completion.

    As the worker's claims do, a batch smaller than CLAIM_ENOUGH waits up to `spec.claim_linger` for more
    records to share its round trips (the worker lingers only while tasks come fast enough for that to pay;
    the floor always does)."""
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
            if msgs and len(msgs) < CLAIM_ENOUGH and spec.claim_linger:
                msgs += consumer.consume(CLAIM_ENOUGH - len(msgs), math.ceil(spec.claim_linger * 1000) / 1000)
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


# A spawned runner's pipes: the parent writes one frame (what to run) to its stdin and closes it to stop it;
# the runner writes its reports to its stdout, each a frame: a 4-byte length, then the pickled object.
_LENGTH = struct.Struct(">I")


def _write_frame(stream: Any, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def _read_frame(stream: Any) -> Any:
    """The next object of `stream`; EOFError at its end."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError
    (size,) = _LENGTH.unpack(head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


class _PipeOut:
    """A runner's reports to its parent, over its stdout (a _Channel of one writer)."""

    def __init__(self, stream: Any) -> None:
        self._stream, self._lock = stream, threading.Lock()

    def put(self, obj: Any) -> None:
        with self._lock:
            _write_frame(self._stream, obj)


def _runner_main() -> None:
    """A runner process's entry (`python -c`, as the parent starts it): read what to run from stdin, run it
    until stdin closes (the parent asked it to stop, or died), reporting on stdout."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The reports own the real stdout; anything else printed goes to stderr, as the worker's logs do.
    out = _PipeOut(os.fdopen(os.dup(1), "wb"))
    os.dup2(2, 1)
    stdin = sys.stdin.buffer
    bare, runner, spec, parent = _read_frame(stdin)
    stop = threading.Event()

    def watch() -> None:
        stdin.read()  # returns at EOF
        stop.set()

    threading.Thread(target=watch, name="taskq-bench-stop", daemon=True).start()
    (_spawned_bare if bare else _spawned_worker)(runner, spec, out, stop, parent)


# How the parent starts a runner. taskq.cli first: a deployed worker starts through `taskq worker`, and the
# launch the bench reports is its launch: an interpreter's start and these imports, nothing else (spawning
# by multiprocessing would add its own bootstrap, some 25 ms, and import this process's main module).
_RUNNER_IMPORTS = "import taskq.cli, taskq.tools.bench.runners as r"
_RUNNER = f"{_RUNNER_IMPORTS}; r._runner_main()"


def _runner_argv(code: str) -> list[str]:
    """The command running `code` in a new interpreter that imports taskq from where this process did.

    `python -c` puts its working directory first on sys.path, so a bench started in one checkout, with
    PYTHONPATH naming another (how two versions are compared in alternation), ran its workers from the
    checkout it was started in. `-P` leaves the directory out: the runner's path is PYTHONPATH and the
    installation's, as a console script's is (`taskq worker`, `taskq bench`). Only when this process found
    taskq first on its own path (started from a checkout with `python -m`, say) is that put first."""
    import taskq  # the package this process runs

    root = Path(taskq.__file__).resolve().parents[1]
    if sys.path and root == Path(sys.path[0] or os.getcwd()).resolve():
        code = f"import sys; sys.path.insert(0, {str(root)!r}); {code}"
    return [sys.executable, "-P", "-c", code]


class _Runner:
    """A runner process: `python -c _RUNNER`, told what to run on its stdin; its reports go to `out`."""

    def __init__(self, bare: bool, runner: int, spec: _WorkerSpec, out: queue.Queue[Any]) -> None:
        self._job, self._out = (bare, runner, spec, os.getpid()), out
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        self._proc = proc = subprocess.Popen(
            _runner_argv(_RUNNER), stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert proc.stdin is not None
        try:
            _write_frame(proc.stdin, self._job)
        except BrokenPipeError:  # it died at once (its error is on stderr): `_Workers.wait` reports it
            pass
        self._reader = threading.Thread(target=self._read, name="taskq-bench-reports", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        while True:
            try:
                self._out.put(_read_frame(self._proc.stdout))
            except EOFError:
                return

    def stop(self) -> None:
        """Close its stdin: the runner stops, reports a last time and exits."""
        if self._proc is not None and self._proc.stdin is not None and not self._proc.stdin.closed:
            try:
                self._proc.stdin.close()
            except BrokenPipeError:  # it exited already
                pass

    def is_alive(self) -> bool:
        """Running, or its last reports not yet all read."""
        return self._proc is not None and (
            self._proc.poll() is None or (self._reader is not None and self._reader.is_alive())
        )

    def join(self, timeout: float) -> None:
        if self._proc is None:
            return
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._reader is not None:
            self._reader.join(timeout)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


def cache_bytecode(package: str | None = None) -> None:
    """Write the bytecode of a package's modules (taskq's by default) where it is missing or stale, as
    installing from a wheel does. Without it, an editable install under PYTHONDONTWRITEBYTECODE (which many
    shells set) compiles every module again at each start, which an installed worker does not: a spawned
    bench worker's launch would count some 90 ms of compiling. Quiet where it cannot write."""
    import compileall

    import taskq

    compileall.compile_dir(package or os.path.dirname(taskq.__file__), quiet=2)


class _Workers:
    """N bench workers in one group: a thread of this process for one (unless `spawn`), processes of their
    own for more (`_Runner`); `bare`: processes running the framework-free loop (`_spawned_bare`) instead."""

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
        #: Each runner's first partition assignment: a group's members get theirs over a few heartbeats.
        self.first_assigned: dict[int, float] = {}
        #: Each runner's share of the run: tasks it completed, its first start and its last completion.
        self.shares: dict[int, list[float]] = {}
        self.launched_at: float | None = None
        #: When the first runner was started (a spawned process's interpreter start and imports follow it).
        self.spawned_at: float | None = None
        self.spawned = processes > 1 or spawn or bare
        self.cpu_s = 0.0
        self._finals: list[_Report] = []
        self._out: queue.Queue[Any] = queue.Queue()
        self._stop = threading.Event()
        self._runners: list[threading.Thread | _Runner] = []
        if not self.spawned:
            self._runners.append(
                threading.Thread(
                    target=_run_worker, args=(0, spec, self._out, self._stop, None, profile), daemon=True
                )
            )
        else:
            cache_bytecode()
            # Started as programs (never forked: this process already runs librdkafka and psycopg threads).
            self._runners += [_Runner(bare, i, spec, self._out) for i in range(processes)]

    @property
    def assigned_at(self) -> float | None:
        """The group's first partition assignment, to any runner."""
        return min(self.first_assigned.values(), default=None)

    def __enter__(self) -> _Workers:
        # The monotonic clock is the machine's: the spawned processes' times compare with this one.
        self.spawned_at = time.monotonic()
        for runner in self._runners:
            runner.start()
        return self

    def _take(self, timeout: float) -> bool:
        try:
            report: _Report = self._out.get(timeout=timeout)
        except queue.Empty:
            return False
        share = self.shares.setdefault(report.runner, [0, math.inf, -math.inf])
        for key, t in report.started:
            self.started.setdefault(key, t)
            share[1] = min(share[1], t)
        for key, t in report.completed:
            if key not in self.completed:  # a copy redelivered across a rebalance counts once
                self.completed[key] = t
                share[0] += 1
            share[2] = max(share[2], t)
        self.partitions[report.runner] = report.partitions
        if report.assigned_at is not None:
            self.first_assigned.setdefault(report.runner, report.assigned_at)
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
        for runner in self._runners:
            if isinstance(runner, _Runner):
                runner.stop()
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
