"""`taskq chaos`: a ledger workload run while workers are killed and services restarted, then checked.

A run has a namespace of its own (`chaos-<stamp>`: topics, a Postgres schema with the idempotency tables and
the ledger, consumer groups), made by `scratch_namespace` and deleted after it. It starts N `taskq worker`
processes running the handlers of this module, enqueues at a steady rate, and meanwhile `kill -9`s and
restarts workers at random intervals and, when given the commands, restarts the broker and Postgres. Then it
drains and checks the guarantees from the outside: every key's effect once (ledger rows per key), no record
left uncommitted, and the DLQ holding exactly the tasks meant to fail.

The task type `taskq_chaos.Ledger` is the same for every run (its subject stays registered); each task says
what it is meant to do: `ok` writes its ledger row, `retry` fails its first attempt then writes it,
`delayed` is enqueued with a delay, `fail` always fails and must end in the DLQ, and `pill` (a poison pill,
a few per thousand) kills the worker process running it: it must end in the DLQ, and it alone may be
dead-lettered for the deaths of workers (invariant 10).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO, Any, Literal

from taskq._core.broker import TP
from taskq._core.db import Database
from taskq._core.envelope import PRIORITIES, Topics
from taskq._core.errors import ConfigurationError, TaskqError
from taskq._core.kafka_admin import Admin
from taskq._core.kafka_clients import Source
from taskq._core.settings import Settings
from taskq._core.store import Store
from taskq.consumer.dlq import DeadLetters
from taskq.consumer.handlers import Handlers, TaskContext
from taskq.consumer.retry import RetryPolicy
from taskq.producer.producer import Receipt, TaskProducer
from taskq.schemas import Registry
from taskq.schemas.errors import SchemaError
from taskq.tools.bench import scratch_namespace

__all__ = ["ChaosReport", "LedgerCheck", "check_ledger", "run_chaos", "uncommitted"]

log = logging.getLogger("taskq.chaos")

TASK_TYPE = "taskq_chaos.Ledger"
SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "Ledger",
    "namespace": "taskq_chaos",
    "fields": [{"name": "i", "type": "long"}, {"name": "kind", "type": "string"}],
}
#: `taskq worker` runs these; the handlers are built when the worker reads the attribute (see __getattr__).
HANDLERS = "taskq.tools.chaos:handlers"
#: In the run's own Postgres schema. No unique key on purpose: a second effect of one key is a second row.
LEDGER_TABLE = "chaos_ledger"
CREATE_LEDGER = (
    f"CREATE TABLE {LEDGER_TABLE} (key text NOT NULL, attempt int NOT NULL, "
    "at timestamptz NOT NULL DEFAULT clock_timestamp())"
)

Kind = Literal["ok", "retry", "delayed", "fail", "pill"]
#: Share of each kind of task but pills (`pills` per thousand, an option); the rest are `ok`.
_SHARES: tuple[tuple[Kind, float], ...] = (("fail", 0.05), ("retry", 0.10), ("delayed", 0.10))
#: The exit code of a worker process a poison pill kills.
PILL_EXIT = 17
#: Attempts of a `fail` task and of a pill (a header of their own): they reach the DLQ after these.
_FAIL_ATTEMPTS = 2
#: Attempts of every other task: room for several kills while it is claimed, none of them its fault.
_ATTEMPTS = 10
#: The handler's timeout: the lease of a killed worker's key runs out 1.5 x this + 5 s after its claim.
_TIMEOUT = 5.0
_RETRIES = RetryPolicy(max_attempts=_ATTEMPTS, base=timedelta(milliseconds=200), cap=timedelta(seconds=1))


class ChaosFailure(RuntimeError):
    """A failure the chaos workload raises on purpose."""


@functools.cache
def _handlers() -> Handlers:
    handlers = Handlers()

    @handlers.task(TASK_TYPE, schema=SCHEMA, transactional=True, timeout=_TIMEOUT, retry=_RETRIES)
    def ledger(payload: dict[str, Any], ctx: TaskContext) -> None:
        if payload["kind"] == "pill":
            os._exit(PILL_EXIT)  # the whole worker process goes down, as a segfaulting library would take it
        if payload["kind"] == "fail":
            raise ChaosFailure(f"task {payload['i']} is meant to fail (attempt {ctx.attempt})")
        if payload["kind"] == "retry" and ctx.attempt == 1:
            raise ChaosFailure(f"task {payload['i']} fails its first attempt on purpose")
        # In the transaction that records the completion: the row exists if and only if the task completed.
        ctx.db.execute(
            f"INSERT INTO {LEDGER_TABLE} (key, attempt) VALUES (%s, %s)", (ctx.idempotency_key, ctx.attempt)
        )

    return handlers


def __getattr__(name: str) -> Any:
    # `taskq worker taskq.tools.chaos:handlers` reads this attribute: nothing is registered at import.
    if name == "handlers":
        return _handlers()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------------------------- checks
@dataclass(frozen=True)
class LedgerCheck:
    """Effects of a run, per key: expected ones with no row, keys with more than one, rows of other keys."""

    lost: list[str]
    duplicated: dict[str, int]
    unexpected: list[str]
    rows: int

    @property
    def ok(self) -> bool:
        """Every expected key has exactly one row, and no other key has any."""
        return not (self.lost or self.duplicated or self.unexpected)


def check_ledger(database: Database, expected: Collection[str]) -> LedgerCheck:
    """Count the ledger rows of each key against the keys whose effect must exist exactly once."""
    with database.connection() as conn:
        rows = conn.execute(f"SELECT key, count(*) AS n FROM {LEDGER_TABLE} GROUP BY key").fetchall()
    counts = {str(r["key"]): int(r["n"]) for r in rows}
    want = set(expected)
    return LedgerCheck(
        lost=sorted(want - counts.keys()),
        duplicated={k: n for k, n in sorted(counts.items()) if n > 1},
        unexpected=sorted(counts.keys() - want),
        rows=sum(counts.values()),
    )


def uncommitted(settings: Settings) -> dict[TP, int]:
    """Records of the namespace's tier topics past its worker group's committed offsets, per partition.

    Read, not subtracted: the forwarder writes to the tiers in transactions, whose commit markers take an
    offset at a partition's end that no consumer receives or commits past.
    """
    admin = Admin(settings)
    topics = Topics(settings.namespace).priority_topics
    end = admin.end_offsets(topics)
    committed = admin.committed(settings.worker_group, topics)
    start = {tp: max(0, committed.get(tp, -1)) for tp in end}  # -1: nothing committed, from the start
    behind = {tp: start[tp] for tp, hw in end.items() if start[tp] < hw}
    if not behind:
        return {}
    # read_committed like the workers; assigned, so it joins no group and commits nothing.
    source = Source(settings, group=f"{settings.namespace}.checker")
    source.assign([(t, p, o) for (t, p), o in behind.items()])
    left: Counter[TP] = Counter()
    try:
        # Read to the end offsets (the position moves past transaction markers); what comes back was never
        # committed. What could not be read within the deadline counts as uncommitted too.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all(max(source.position(tp), behind[tp]) >= end[tp] for tp in behind):
                break
            left.update(r.tp for r in source.poll(1000, 0.3))
        else:
            for tp in behind:
                left[tp] += max(0, end[tp] - max(source.position(tp), behind[tp]))
    finally:
        source.close()
    return {tp: n for tp, n in left.items() if n}


# -------------------------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class _Task:
    i: int
    kind: Kind
    delay: float | None

    @property
    def key(self) -> str:
        return f"chaos:{self.i}"


def _plan(rng: random.Random, i: int, pills: float = 0.0) -> _Task:
    """Task `i` of a run: its kind drawn by the shares (`pills` per thousand of poison pills), a delay of 1
    to 8 s if delayed."""
    draw = rng.random()
    kind: Kind = "ok"
    for k, share in (("pill", pills / 1000), *_SHARES):
        if draw < share:
            kind = k
            break
        draw -= share
    delay = rng.uniform(1.0, 8.0) if kind == "delayed" else None
    return _Task(i, kind, delay)


class _Sender:
    """Enqueues planned tasks; a task counts as enqueued only once the broker acknowledged it, and one
    whose send failed is sent again (same idempotency key) until it is."""

    def __init__(self, settings: Settings) -> None:
        self.planned: dict[str, _Task] = {}
        self.acked: dict[str, _Task] = {}
        self.send_errors = 0
        self.delivery_errors = 0
        self._again: deque[_Task] = deque()
        self._lock = threading.Lock()
        self.producer = TaskProducer(settings, on_delivery=self._delivered)

    def _delivered(self, receipt: Receipt, err: str | None) -> None:
        task = self.planned[receipt.idempotency_key]
        with self._lock:
            if err is None:
                self.acked[task.key] = task
            else:
                self.delivery_errors += 1
                self._again.append(task)

    def send(self, task: _Task) -> bool:
        """Hand one task to the producer; False (and counted) if it was refused, e.g. while a service is
        down: the caller tries again."""
        first = task.key not in self.planned
        self.planned[task.key] = task
        try:
            self.producer.enqueue(
                TASK_TYPE,
                {"i": task.i, "kind": task.kind},
                priority=PRIORITIES[task.i % len(PRIORITIES)],
                idempotency_key=task.key,
                delay=task.delay,
                max_attempts=_FAIL_ATTEMPTS if task.kind in ("fail", "pill") else None,
            )
        except (TaskqError, SchemaError, BufferError) as exc:
            if first:  # never handed over: it does not count until it is
                del self.planned[task.key]
            self.send_errors += 1
            log.warning("chaos: send of %s refused (will retry): %s", task.key, exc)
            return False
        return True

    def resend_failed(self) -> None:
        """Send again what the broker did not acknowledge."""
        while True:
            with self._lock:
                if not self._again:
                    return
                task = self._again.popleft()
            if not self.send(task):
                with self._lock:
                    self._again.appendleft(task)
                return

    def settle(self, timeout: float) -> None:
        """Wait until every planned task is acknowledged, sending again the failed ones, up to `timeout`."""
        deadline = time.monotonic() + timeout
        while len(self.acked) < len(self.planned) and time.monotonic() < deadline:
            self.resend_failed()
            try:
                self.producer.flush(min(10.0, max(0.1, deadline - time.monotonic())))
            except TaskqError:  # failures come back through _delivered, and are sent again
                pass

    def close(self) -> None:
        """Release the producer (what is still unacknowledged is given up)."""
        try:
            self.producer.close(1.0)
        except TaskqError:
            pass


# ------------------------------------------------------------------------------------------------ workers
class _Workers:
    """N `taskq worker` processes of the run's namespace, each appending its output to a log file."""

    def __init__(
        self, env: dict[str, str], count: int, concurrency: int, log_dir: Path, *, share_group: bool = False
    ) -> None:
        self._env = env
        self._argv = [sys.executable, "-m", "taskq.cli", "worker", HANDLERS, "--concurrency"]
        self._argv += [str(concurrency), *(["--share-group"] if share_group else [])]
        self._log_dir = log_dir
        self._procs: list[subprocess.Popen[bytes] | None] = [None] * count
        self._logs: list[IO[bytes] | None] = [None] * count
        self.exits: list[str] = []  # workers that exited on their own (e.g. started while Postgres was down)
        self.stop_failures: list[str] = []  # workers that did not stop cleanly on SIGTERM at the end
        self._lock = threading.RLock()  # the chaos thread and the run's thread both look

    def __len__(self) -> int:
        return len(self._procs)

    def start(self, i: int) -> int:
        """Start worker `i`; its pid."""
        with self._lock:
            if self._logs[i] is None:
                self._logs[i] = (self._log_dir / f"worker-{i}.log").open("ab")
            proc = subprocess.Popen(
                self._argv,
                env=self._env,
                stdout=self._logs[i],
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
            self._procs[i] = proc
            return proc.pid

    def kill(self, i: int) -> int:
        """kill -9 worker `i`; its pid."""
        with self._lock:
            proc = self._procs[i]
            assert proc is not None
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            self._procs[i] = None
            return proc.pid

    def running(self) -> list[int]:
        """The workers running now; one that exited on its own is recorded in `exits`."""
        out = []
        with self._lock:
            for i, proc in enumerate(self._procs):
                if proc is None:
                    continue
                if proc.poll() is None:
                    out.append(i)
                else:
                    self.exits.append(f"worker {i} (pid {proc.pid}) exited with {proc.returncode}")
                    self._procs[i] = None
        return out

    def stopped(self) -> list[int]:
        """The workers not running now."""
        running = set(self.running())
        return [i for i in range(len(self._procs)) if i not in running]

    def stop(self, timeout: float) -> None:
        """SIGTERM every worker (each finishes its tasks and commits), then kill what is left at `timeout`."""
        with self._lock:
            for live in [p for p in self._procs if p is not None]:
                live.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for i, proc in enumerate(self._procs):
                if proc is None:
                    continue
                try:
                    code = proc.wait(max(0.1, deadline - time.monotonic()))
                    if code != 0:
                        self.stop_failures.append(f"worker {i} (pid {proc.pid}) stopped with {code}")
                except subprocess.TimeoutExpired:
                    self.stop_failures.append(
                        f"worker {i} (pid {proc.pid}) did not stop within {timeout:g}s: killed"
                    )
                    proc.kill()
                    proc.wait()
                self._procs[i] = None
            for f in self._logs:
                if f is not None:
                    f.close()


class _Monkey(threading.Thread):
    """Kills workers (kill -9) and restarts them at random intervals, and runs the service restart commands
    at random times of the run, until calmed; then starts every worker that is down. Like a supervisor, it
    starts a worker that exited on its own (a poison pill's) again a second later, until stopped: a drain
    waits on workers that a pill may still kill."""

    def __init__(
        self,
        workers: _Workers,
        rng: random.Random,
        *,
        duration: float,
        kill_every: float,
        services: dict[str, str],
        service_restarts: int,
        progress: Callable[[str], None],
    ) -> None:
        super().__init__(name="taskq-chaos", daemon=True)
        self.workers = workers
        self.rng = rng
        self.progress = progress
        self.kills = 0
        self.restarts = 0
        self.service_runs: Counter[str] = Counter()
        self.service_failures: list[str] = []
        self._halt = threading.Event()
        self._calm = threading.Event()  # no more kills or service restarts; exited workers still restarted
        self._events: list[tuple[float, int, str, str]] = []  # (due, seq, action, argument)
        self._seq = itertools.count()
        self._down: set[int] = set()  # workers known to be down, their start scheduled
        t0 = time.monotonic()
        if kill_every > 0:
            self._at(t0 + rng.uniform(0.5, 1.5) * kill_every, "kill", "")
        self._kill_every = kill_every
        for name in services:
            for _ in range(service_restarts):
                self._at(t0 + rng.uniform(0.15, 0.85) * duration, "service", name)
        self._services = services

    def _at(self, due: float, action: str, arg: str) -> None:
        heapq.heappush(self._events, (due, next(self._seq), action, arg))

    def calm(self) -> None:
        """Stop the chaos: no more kills or service restarts; workers down are started again, as before."""
        self._calm.set()

    def stop(self) -> None:
        """Stop the chaos and the supervision; the thread then starts the workers that are down and ends."""
        self._calm.set()
        self._halt.set()

    def run(self) -> None:
        while not self._halt.is_set():
            due = self._events[0][0] if self._events else time.monotonic() + 1.0
            # A worker that exits on its own is noticed within a second.
            if self._halt.wait(max(0.0, min(due - time.monotonic(), 1.0))):
                break
            for i in self.workers.stopped():
                if i not in self._down:
                    self._down.add(i)
                    why = self.workers.exits[-1] if self.workers.exits else f"worker {i} is down"
                    self.progress(f"{why}; starting it again in 1 s")
                    self._at(time.monotonic() + 1.0, "start", str(i))
            if not self._events or self._events[0][0] > time.monotonic():
                continue
            _, _, action, arg = heapq.heappop(self._events)
            if self._calm.is_set() and action != "start":
                continue
            if action == "kill":
                running = self.workers.running()
                if running:
                    i = self.rng.choice(running)
                    pid = self.workers.kill(i)
                    self._down.add(i)
                    self.kills += 1
                    self.progress(f"kill -9 worker {i} (pid {pid})")
                    self._at(time.monotonic() + self.rng.uniform(0.5, 3.0), "start", str(i))
                self._at(time.monotonic() + self.rng.uniform(0.5, 1.5) * self._kill_every, "kill", "")
            elif action == "start":
                self._start(int(arg))
            else:
                self._service(arg)
        for i in self.workers.stopped():
            self._start(i)

    def _start(self, i: int) -> None:
        self._down.discard(i)
        if i in self.workers.running():
            return
        pid = self.workers.start(i)
        self.restarts += 1
        self.progress(f"started worker {i} again (pid {pid})")

    def _service(self, name: str) -> None:
        command = self._services[name]
        self.progress(f"restarting {name}: {command}")
        t0 = time.monotonic()
        try:
            done = subprocess.run(
                command, shell=True, capture_output=True, text=True, timeout=300, check=False
            )
            failed = None
            if done.returncode:
                # The command's last words say why (e.g. a broker not ready within the stack's timeout).
                said = [line for line in done.stderr.splitlines() if line.strip()]
                said = said or [line for line in done.stdout.splitlines() if line.strip()]
                failed = f"exit code {done.returncode}" + (f": {said[-1].strip()[:300]}" if said else "")
        except subprocess.TimeoutExpired:
            failed = "no answer within 300s"
        self.service_runs[name] += 1
        if failed:
            self.service_failures.append(f"{name} restart ({command!r}): {failed}")
            self.progress(f"{name} restart failed: {failed}")
        else:
            self.progress(f"{name} restarted in {time.monotonic() - t0:.1f}s")


# ------------------------------------------------------------------------------------------------- report
@dataclass
class ChaosReport:
    """What a chaos run did and what its checks found; `passed` only if every check holds."""

    namespace: str
    seed: int
    workers: int
    duration_s: float
    rate: float
    enqueued: int = 0
    meant_to_fail: int = 0
    unacknowledged: int = 0
    send_retries: int = 0
    completed: int = 0
    dead_lettered: int = 0
    drained: bool = False
    #: Idempotency records neither completed nor dead at the end, by state (where an undrained run stuck).
    pending: dict[str, int] = field(default_factory=dict)
    #: Offsets of the delay topics past the forwarder group's commits (an estimate: markers count too).
    unforwarded: int = 0
    lost: int = 0
    duplicated: int = 0
    unexpected_effects: int = 0
    uncommitted: int = 0
    dlq_records: int = 0
    #: DLQ records beyond one per key (a key dead-lettered again after a kill): reported, not a failure.
    dlq_repeats: int = 0
    dlq_missing: int = 0
    dlq_unexpected: int = 0
    #: Poison pills enqueued; of them dead-lettered for their workers' deaths; other tasks so dead-lettered.
    pills: int = 0
    pills_dead: int = 0
    blamed_for_deaths: int = 0
    kills: int = 0
    worker_restarts: int = 0
    #: Workers that exited on their own and were started again (not a failed check: a worker may refuse to
    #: start while Postgres is down, as under systemd; the effects are what is checked).
    worker_exits: list[str] = field(default_factory=list)
    service_restarts: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    examples: dict[str, list[str]] = field(default_factory=dict)
    drain_s: float = 0.0
    took_s: float = 0.0
    logs: str | None = None

    @property
    def passed(self) -> bool:
        """Every check held."""
        return self.drained and not (
            self.lost
            or self.duplicated
            or self.unexpected_effects
            or self.uncommitted
            or self.dlq_missing
            or self.dlq_unexpected
            or self.blamed_for_deaths
            or self.unacknowledged
            or self.problems
        )

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data."""
        return {**asdict(self), "passed": self.passed}

    def text(self) -> str:
        """The report as printed."""
        services = ", ".join(f"{name} {n}" for name, n in self.service_restarts.items()) or "none"
        lines = [
            f"taskq chaos: namespace {self.namespace}, {self.workers} workers, {self.duration_s:g} s at "
            f"{self.rate:g} tasks/s, seed {self.seed}",
            f"  enqueued            {self.enqueued} acknowledged ({self.meant_to_fail} meant to fail; "
            f"{self.send_retries} sends retried, {self.unacknowledged} never acknowledged)",
            f"  completed           {self.completed}, dead-lettered {self.dead_lettered}"
            + (
                ""
                if self.drained
                else f"  (NOT drained: still pending {self.pending or 'before their first claim'}; "
                f"about {self.unforwarded} records of the delay topics not yet forwarded)"
            ),
            f"  lost                {self.lost}{'' if self.drained else ' (or still pending: not drained)'}",
            f"  duplicated          {self.duplicated}",
            f"  unexpected effects  {self.unexpected_effects}",
            f"  uncommitted         {self.uncommitted} records on the tier topics",
            f"  DLQ                 {self.dlq_records} records ({self.dlq_repeats} repeating a key): "
            f"{self.meant_to_fail - self.dlq_missing} of "
            f"{self.meant_to_fail} meant to fail, {self.dlq_missing} missing, {self.dlq_unexpected} others",
            f"  poison pills        {self.pills}: {self.pills_dead} dead-lettered for their workers' deaths, "
            f"{self.blamed_for_deaths} other tasks blamed for deaths",
            f"  kills               {self.kills} (kill -9), {self.worker_restarts} worker restarts, "
            f"{len(self.worker_exits)} exits on their own",
            f"  service restarts    {services}",
            f"  took                {self.took_s:.1f} s (drain {self.drain_s:.1f} s)",
        ]
        lines += [f"  exit: {e}" for e in self.worker_exits]
        lines += [f"  problem: {p}" for p in self.problems]
        lines += [f"  e.g. {what}: {', '.join(keys)}" for what, keys in self.examples.items() if keys]
        if self.logs:
            lines.append(f"  worker logs in {self.logs}")
        lines.append(f"result: {'PASS' if self.passed else 'FAIL'}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- run
def run_chaos(
    settings: Settings,
    *,
    workers: int = 3,
    duration: float = 60.0,
    rate: float = 20.0,
    concurrency: int = 4,
    seed: int | None = None,
    kill_every: float = 5.0,
    pills: float = 3.0,
    restart_kafka_cmd: str | None = None,
    restart_postgres_cmd: str | None = None,
    service_restarts: int = 1,
    partitions: int = 3,
    drain_timeout: float = 180.0,
    keep: bool = False,
    progress: Callable[[str], None] | None = None,
    share_group: bool = False,
) -> ChaosReport:
    """Run the chaos workload in a namespace of its own against the stack `settings` point at; check it.
    `share_group`: the workers read the tiers through share groups (`taskq worker --share-group`)."""
    if workers < 1:
        raise ConfigurationError(f"workers must be >= 1, got {workers}")
    if concurrency < 1:
        raise ConfigurationError(f"concurrency must be >= 1, got {concurrency}")
    for name, value in (("duration", duration), ("rate", rate)):  # their product is the task count
        if not (value > 0 and math.isfinite(value)):
            raise ConfigurationError(f"{name} must be a finite number > 0, got {value}")
    if not drain_timeout > 0:
        raise ConfigurationError(f"drain_timeout must be > 0, got {drain_timeout}")
    if kill_every < 0:
        raise ConfigurationError(f"kill_every must be >= 0 seconds (0: no kills), got {kill_every}")
    if not 0 <= pills <= 100:
        raise ConfigurationError(f"pills must be from 0 to 100 per thousand tasks, got {pills}")
    if service_restarts < 0:
        raise ConfigurationError(f"service_restarts must be >= 0, got {service_restarts}")
    say = progress or (lambda line: log.info("chaos: %s", line))
    seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    services = {
        name: cmd for name, cmd in (("kafka", restart_kafka_cmd), ("postgres", restart_postgres_cmd)) if cmd
    }
    started = time.monotonic()
    log_dir = Path(tempfile.mkdtemp(prefix="taskq-chaos-"))
    with Registry.from_settings(settings) as registry:
        registry.register(SCHEMA)
    with scratch_namespace(settings, "chaos", partitions=partitions, groups=["checker"], keep=keep) as s:
        report = ChaosReport(s.namespace, seed, workers, duration, rate)
        db = Database(s.database_url, schema=s.database_schema)
        with db.connection() as conn:
            conn.execute(CREATE_LEDGER)
        env = {k: v for k, v in os.environ.items() if k != "TASKQ_WORKER_GROUP"}
        env |= {"TASKQ_NAMESPACE": s.namespace, "TASKQ_DATABASE_SCHEMA": s.database_schema}
        pool = _Workers(env, workers, concurrency, log_dir, share_group=share_group)
        sender = _Sender(s)
        monkey = _Monkey(
            pool,
            random.Random(f"{seed}:chaos"),
            duration=duration,
            kill_every=kill_every,
            services=services,
            service_restarts=service_restarts,
            progress=say,
        )
        try:
            for i in range(workers):
                pool.start(i)
            say(f"namespace {s.namespace}: {workers} workers; enqueueing for {duration:g} s, seed {seed}")
            monkey.start()
            _produce(sender, random.Random(f"{seed}:plan"), rate=rate, duration=duration, pills=pills)
            sender.settle(120.0)
            monkey.calm()
            report.enqueued = len(sender.acked)
            report.unacknowledged = len(sender.planned) - len(sender.acked)
            report.send_retries = sender.send_errors + sender.delivery_errors
            say(f"enqueued {report.enqueued}; draining (at most {drain_timeout:g} s)")
            t_drain = time.monotonic()
            store = Store(db)
            report.drained = _wait(
                lambda: _settled(store, s.namespace) >= report.enqueued, drain_timeout, pool=pool, every=0.5
            )
            # Workers commit every second; once drained, nothing may stay behind (share groups commit none).
            if report.drained and not share_group:
                _wait(lambda: not uncommitted(s), 60.0, pool=pool, every=1.0)
            lag = {} if share_group else uncommitted(s)
            report.drain_s = time.monotonic() - t_drain
            monkey.stop()
            monkey.join()
            counts = store.counts(s.namespace)
            report.completed, report.dead_lettered = counts.get("completed", 0), counts.get("dead", 0)
            report.pending = {k: n for k, n in counts.items() if k not in ("completed", "dead")}
            if not report.drained:
                try:
                    report.unforwarded = _unforwarded(s)
                except TaskqError as exc:
                    log.warning("chaos: cannot read the forwarder's offsets: %s", exc)
            pool.stop(60.0)
            _check(report, s, db, sender.acked, lag)
        finally:
            monkey.stop()
            try:
                if monkey.is_alive():
                    monkey.join()
            finally:
                pool.stop(60.0)  # whatever failed: no worker outlives the run
                sender.close()
        report.kills, report.worker_restarts = monkey.kills, monkey.restarts
        report.service_restarts = {name: monkey.service_runs[name] for name in services}
        report.worker_exits = pool.exits
        report.problems += pool.stop_failures + monkey.service_failures
        report.took_s = time.monotonic() - started
    if keep or not report.passed:
        report.logs = str(log_dir)
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    return report


def _produce(
    sender: _Sender, rng: random.Random, *, rate: float, duration: float, pills: float = 0.0
) -> None:
    """Send planned tasks on a fixed schedule of `rate` per second for `duration` seconds."""
    t0 = time.monotonic()
    i = 0
    pending: _Task | None = None
    while True:
        now = time.monotonic()
        if now - t0 >= duration:
            break
        due = t0 + i / rate
        if now < due:
            time.sleep(due - now)  # each enqueue serves the delivery reports that arrived meanwhile
            continue
        task = pending or _plan(rng, i, pills)
        sender.resend_failed()
        if sender.send(task):
            pending = None
            i += 1
        else:
            pending = task  # tried again at the next turn, once the service is back
            time.sleep(0.2)


def _unforwarded(s: Settings) -> int:
    """Offsets of the delay topics past the forwarder group's commits (markers included: an estimate)."""
    admin = Admin(s)
    topics = Topics(s.namespace, s.delay_tiers).delay_topics
    committed = admin.committed(f"{s.namespace}.forwarder", topics)
    return sum(end - max(0, committed.get(tp, 0)) for tp, end in admin.end_offsets(topics).items())


def _settled(store: Store, namespace: str) -> int:
    counts = store.counts(namespace)
    return counts.get("completed", 0) + counts.get("dead", 0)


def _wait(done: Callable[[], bool], timeout: float, *, pool: _Workers, every: float) -> bool:
    """Poll `done` until it holds (True) or `timeout` passes (False); errors of a service still coming back
    count as not done."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if done():
                return True
        except TaskqError as exc:
            log.warning("chaos: %s", exc)
        pool.running()  # a worker that exits meanwhile is recorded
        time.sleep(every)
    return False


def _check(
    report: ChaosReport, s: Settings, db: Database, acked: dict[str, _Task], lag: dict[TP, int]
) -> None:
    """Fill in the report's checks: ledger, commits, DLQ."""
    meant_to_fail = {k for k, t in acked.items() if t.kind in ("fail", "pill")}
    pills = {k for k, t in acked.items() if t.kind == "pill"}
    ledger = check_ledger(db, acked.keys() - meant_to_fail)
    report.meant_to_fail = len(meant_to_fail)
    report.lost, report.duplicated = len(ledger.lost), len(ledger.duplicated)
    report.unexpected_effects = len(ledger.unexpected)
    report.uncommitted = sum(lag.values())
    with DeadLetters(s) as dlq:
        records = dlq.list(include_replayed=True)
    in_dlq = {r.idempotency_key or f"<no key: offset {r.offset}>" for r in records}
    report.dlq_records = len(records)
    report.dlq_repeats = len(records) - len({r.idempotency_key for r in records})
    report.dlq_missing = len(meant_to_fail - in_dlq)
    report.dlq_unexpected = len(in_dlq - meant_to_fail)
    # Invariant 10: a worker's death is charged only to the task that ran alone when it died.
    blamed = {r.idempotency_key or "" for r in records if r.error_type == "taskq.PoisonPill"}
    report.pills = len(pills)
    report.pills_dead = len(blamed & pills)
    report.blamed_for_deaths = len(blamed - pills)
    report.examples = {
        "lost": ledger.lost[:5],
        "duplicated": [f"{k} x{n}" for k, n in list(ledger.duplicated.items())[:5]],
        "unexpected effects": ledger.unexpected[:5],
        "missing from the DLQ": sorted(meant_to_fail - in_dlq)[:5],
        "in the DLQ, not meant to fail": sorted(in_dlq - meant_to_fail)[:5],
        "dead-lettered for a worker's death, not a pill": sorted(blamed - pills)[:5],
        "uncommitted": [f"{t}[{p}] {n}" for (t, p), n in sorted(lag.items())[:5]],
    }
