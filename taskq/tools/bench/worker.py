"""`bench worker`: how fast Workers run a backlog of N tasks."""

from __future__ import annotations

from typing import Any

from taskq._core.db import Database
from taskq._core.errors import ConfigurationError
from taskq._core.settings import Settings
from taskq.tools.bench.run import (
    _EFFECTS_TABLE,
    BENCH_HANDLERS,
    BenchHandler,
    _enqueue,
    _ms,
    _namespace,
    _wal_bytes_since,
    _wal_position,
)
from taskq.tools.bench.runners import _Workers, _WorkerSpec

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
        # In spawned processes, as `taskq worker` runs: launch figures include the interpreter's start and the
        # imports. --profile runs the worker in a thread of this process, whose start is then not measured.
        spec = _WorkerSpec.of(run, handler, concurrency)
        workers = _Workers(spec, processes=processes, profile=profile, spawn=profile is None)
        wal_start = _wal_position(run.settings)
        with workers:
            workers.wait(
                lambda: len(workers.completed) >= count, timeout, f"not every one of {count} tasks ran"
            )
            wal_bytes = _wal_bytes_since(run.settings, wal_start)
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
    starts = sorted(started.values())
    t_spawned = workers.spawned_at if workers.spawned else None
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
        # All tasks are enqueued before the worker starts, so these include waiting behind the backlog.
        "enqueue_to_start_ms": _ms([started[k] - enqueued[k] for k in completed if k in started]),
        "enqueue_to_completion_ms": _ms([completed[k] - enqueued[k] for k in completed]),
        # From the handler's start to the completion recorded in Postgres (claim batching excluded).
        "attempt_to_recorded_ms": _ms([completed[k] - started[k] for k in completed if k in started]),
        "effects": effects,
        # Postgres WAL from launch to the last completion, per task: the whole server's (every client's).
        "wal_bytes_per_task": wal_bytes / done,
    }
