"""`bench worker`: how fast Workers run a backlog of N tasks."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from taskq._core.db import Database
from taskq._core.envelope import PRIORITIES
from taskq._core.errors import ConfigurationError
from taskq._core.settings import Settings
from taskq.consumer.worker import WorkerConfig
from taskq.producer.producer import TaskProducer
from taskq.producer.tasks import TaskSpec
from taskq.producer.workflows import group
from taskq.tools.bench.effects import BENCH_HANDLERS, EFFECTS_TABLE, BenchHandler
from taskq.tools.bench.run import (
    _enqueue,
    _ms,
    _namespace,
    _Run,
    _wal_bytes_since,
    _wal_position,
    machine_busy_since,
    machine_cpu,
)
from taskq.tools.bench.runners import _Workers, _WorkerSpec

#: Seconds a Postgres backend may keep the statistics of its last transactions before it reports them (the
#: server's PGSTAT_MIN_INTERVAL), and some margin: the counters are read this long after the workers stopped.
_STATS_DELAY = 1.5

#: The most tasks the worker's loop claims in one round trip: a worker on a backlog is at full pace once it
#: has started this many (its first claims split them, e.g. 85 + 415, as the tiers' first fetches arrive).
FULL_BATCH = 500


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
    workflow: str | None = None,
    share_group: bool = False,
    claim_linger: float = WorkerConfig.claim_linger,
) -> dict[str, Any]:
    """Enqueue `count` tasks over the four tiers, time `processes` Workers running them all, then clean up.

    With `workflow="group"`, the tasks are the members of one group with a callback (`count` + 1 tasks, the
    callback staged by the transaction that records the last member's end): the cost of a workflow's
    bookkeeping, against the same run without it."""
    if count < 1:
        raise ConfigurationError(f"count must be >= 1, got {count}")
    if concurrency < 1:
        raise ConfigurationError(f"concurrency must be >= 1, got {concurrency}")
    WorkerConfig(claim_linger=claim_linger)  # refused here in one line, not in each spawned worker
    if workflow not in (None, "group"):
        raise ConfigurationError(f"workflow must be group, got {workflow!r}")
    if handler not in BENCH_HANDLERS:
        raise ConfigurationError(f"handler must be one of {', '.join(BENCH_HANDLERS)}, got {handler!r}")
    with _namespace(settings, partitions=partitions, handler=handler) as run:
        enqueued, enqueue_s = _enqueue_group(run, count) if workflow else _enqueue(run, count)[:2]
        tasks = len(enqueued)
        # In spawned processes, as `taskq worker` runs: launch figures include the interpreter's start and the
        # imports. --profile runs the worker in a thread of this process, whose start is then not measured.
        spec = _WorkerSpec.of(run, handler, concurrency, share_group=share_group, claim_linger=claim_linger)
        workers = _Workers(spec, processes=processes, profile=profile, spawn=profile is None)
        wal_start = _wal_position(run.settings)
        counters_start, table_start = _pg_counters(run.settings), _table_bytes(run.settings)
        with workers:
            cpu_start = machine_cpu()
            workers.wait(
                lambda: len(workers.completed) >= tasks, timeout, f"not every one of {tasks} tasks ran"
            )
            busy = machine_busy_since(cpu_start)
            wal_bytes = _wal_bytes_since(run.settings, wal_start)
        time.sleep(_STATS_DELAY)  # the workers' backends have exited or are idle: their counts are reported
        counters = _pg_counters(run.settings).since(counters_start)
        table_bytes = _table_bytes(run.settings) - table_start
        completed, started = workers.completed, workers.started
        effects = None
        if handler != "noop":
            db = Database(run.settings.database_url, schema=run.settings.database_schema)
            with db.connection() as conn:
                row = conn.execute(f"SELECT count(*) AS n FROM {EFFECTS_TABLE}").fetchone()
                effects = int(row["n"]) if row else 0

    done = len(completed)
    t_end = max(completed.values())
    t_launch = workers.launched_at or min(started.values())
    t_assigned = workers.assigned_at or t_launch
    t_first = min(enqueued.values())
    starts = sorted(started.values())
    t_spawned = workers.spawned_at if workers.spawned else None
    return {
        "tasks": tasks,
        "completed": done,
        "handler": handler,
        "workflow": workflow,
        "concurrency": concurrency,
        "claim_linger_ms": claim_linger * 1000,
        "processes": processes,
        "partitions": partitions,
        "namespace": run.settings.namespace,
        "enqueue_s": enqueue_s,
        # From Worker.run() (the earliest, over the processes) to the last recorded completion: joining the
        # group included.
        "elapsed_s": t_end - t_launch,
        "tasks_per_s": done / (t_end - t_launch),
        "startup_s": t_assigned - t_launch,
        # Until the last process's first assignment: a member joining a group gets its partitions only once
        # the others gave them up, each step at a heartbeat (KIP-848), so a second process idles meanwhile.
        # None if a process got none before the run ended.
        "all_assigned_s": (
            max(workers.first_assigned.values()) - t_launch
            if len(workers.first_assigned) == processes
            else None
        ),
        "tasks_per_s_after_assignment": done / (t_end - t_assigned),
        # Each process's share: its tasks, and when (s from the earliest Worker.run()) it got its first
        # partitions, started its first task and recorded its last completion (None where it had none).
        # Where a process that gave partitions up to a newcomer started late, or one finished long after the
        # other, a run of several processes lost what the second could have added.
        "by_process": [
            {
                "tasks": int(n),
                "assigned_s": workers.first_assigned[i] - t_launch if i in workers.first_assigned else None,
                "first_start_s": first - t_launch if n else None,
                "last_completion_s": last - t_launch if n else None,
            }
            for i, (n, first, last) in sorted(workers.shares.items())
        ],
        # From the moment the worker processes were spawned (interpreter start and imports included, as for
        # `taskq worker`) to the first attempt's start, to FULL_BATCH attempts started, and to the last
        # completion. None with --profile (a thread of this process, already started).
        "launch_to_first_task_s": starts[0] - t_spawned if t_spawned is not None and starts else None,
        "launch_to_full_batch_s": (
            starts[min(FULL_BATCH, len(starts)) - 1] - t_spawned if t_spawned is not None and starts else None
        ),
        "tasks_per_s_from_launch": done / (t_end - t_spawned) if t_spawned is not None else None,
        # From the first enqueue to the last completion: enqueueing the backlog included.
        "tasks_per_s_from_first_enqueue": done / (t_end - t_first),
        # Process CPU of the worker(s) from Worker.run() to the last completion, per task.
        "worker_cpu_ms_per_task": workers.cpu_s / done * 1e3,
        # The whole machine's CPU, all cores, busy from the launch to the last completion (within a report
        # interval of it): the workers, the broker, Postgres, this process and anything else running. Below
        # 1, a burn-down waits on round trips rather than on the CPU. None off Linux.
        "machine_busy": busy,
        # All tasks are enqueued before the worker starts, so these include waiting behind the backlog.
        "enqueue_to_start_ms": _ms([started[k] - enqueued[k] for k in completed if k in started]),
        "enqueue_to_completion_ms": _ms([completed[k] - enqueued[k] for k in completed]),
        # From the handler's start to the completion recorded in Postgres (claim batching excluded).
        "attempt_to_recorded_ms": _ms([completed[k] - started[k] for k in completed if k in started]),
        "effects": effects,
        # Postgres WAL from launch to the last completion, per task: the whole server's (every client's).
        "wal_bytes_per_task": wal_bytes / done,
        # The database's counters from launch to the workers' exit, per task: every client's, so read them
        # on a database nothing else uses. Transactions committed or rolled back, rows inserted, updated or
        # deleted, and statements (each BEGIN, COMMIT and SAVEPOINT too) if pg_stat_statements is installed.
        "pg_transactions_per_task": counters.transactions / done,
        "pg_rows_written_per_task": counters.rows_written / done,
        "pg_statements_per_task": (
            sum(counters.statements.values()) / done if counters.statements is not None else None
        ),
        # What the run's tables grew by on disk (heap, indexes, TOAST), per task: what its record (and with
        # --handler transactional, its effect's row) holds until purged.
        "pg_table_bytes_per_task": table_bytes / done,
        "pg_statements": (
            {q: n / done for q, n in sorted(counters.statements.items(), key=lambda kv: -kv[1]) if n}
            if counters.statements is not None
            else None
        ),
    }


@dataclass(frozen=True)
class _PgCounters:
    """What the Postgres database has counted: transactions, rows written, and calls by statement (None
    without pg_stat_statements)."""

    transactions: int
    rows_written: int
    statements: dict[str, int] | None

    def since(self, start: _PgCounters) -> _PgCounters:
        """The counts from `start` to these."""
        statements = None
        if self.statements is not None and start.statements is not None:
            before = start.statements
            statements = {q: n - before.get(q, 0) for q, n in self.statements.items()}
        return _PgCounters(
            self.transactions - start.transactions, self.rows_written - start.rows_written, statements
        )


def _table_bytes(settings: Settings) -> int:
    """Bytes on disk of the tables of the settings' schema, their indexes and TOAST included."""
    with Database(settings.database_url, schema=settings.database_schema).connection() as conn:
        row = conn.execute(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) AS n FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relkind = 'r'",
            (settings.database_schema,),
        ).fetchone()
    return int(row["n"]) if row else 0


def _pg_counters(settings: Settings) -> _PgCounters:
    """The current database's counters now (pg_stat_database, and pg_stat_statements if installed)."""
    with Database(settings.database_url, schema=settings.database_schema).connection() as conn:
        row = conn.execute(
            "SELECT xact_commit + xact_rollback AS transactions,"
            " tup_inserted + tup_updated + tup_deleted AS rows_written"
            " FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
        ext = conn.execute(
            "SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace"
            " WHERE e.extname = 'pg_stat_statements'"
            # Created but not loaded (a server started without it) counts nothing: reading it would fail.
            " AND current_setting('shared_preload_libraries') LIKE '%%pg_stat_statements%%'"
        ).fetchone()
        statements: dict[str, int] | None = None
        if ext is not None:
            rows = conn.execute(
                f'SELECT query, calls FROM "{ext["nspname"]}".pg_stat_statements'
                " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
            ).fetchall()
            statements = {}
            for r in rows:  # one entry per statement, named by its first words (a query per user and plan)
                name = re.sub(r"\s+", " ", str(r["query"])).strip()[:80]
                statements[name] = statements.get(name, 0) + int(r["calls"])
    return _PgCounters(
        int(row["transactions"]) if row else 0, int(row["rows_written"]) if row else 0, statements
    )


def _enqueue_group(run: _Run, count: int) -> tuple[dict[str, float], float]:
    """One workflow: a group of `count` members over the four tiers and a callback, its members staged in
    the outbox and published by the producer as a relay would: (the enqueue time of each key, seconds to
    enqueue it)."""
    members = [
        TaskSpec(
            task_type=run.task_type,
            payload={"i": i},
            priority=PRIORITIES[i % 4],
            idempotency_key=f"bench:{i}",
        )
        for i in range(count)
    ]
    callback = TaskSpec(task_type=run.task_type, payload={"i": -1}, idempotency_key="bench:callback")
    with TaskProducer(run.settings) as producer:
        t0 = time.monotonic()
        producer.enqueue_workflow(group(*members, then=callback))
        enqueue_s = time.monotonic() - t0
    return dict.fromkeys([*(s.idempotency_key or "" for s in members), "bench:callback"], t0), enqueue_s
