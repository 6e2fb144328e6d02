"""`bench latency`: enqueue-to-start and enqueue-to-completion times at a fixed rate, to running workers, per
window of the run; with `seed_history`, on an idempotency table holding days of keys, and how it grew."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping
from typing import Any

from taskq._core.db import Database
from taskq._core.envelope import PRIORITIES
from taskq._core.errors import ConfigurationError
from taskq._core.settings import Settings
from taskq.consumer.store import IdempotencyStore
from taskq.consumer.worker import WorkerConfig
from taskq.producer.producer import TaskProducer
from taskq.tools.bench.run import _ms, _namespace, _warm_up
from taskq.tools.bench.runners import _Workers, _WorkerSpec

#: How long a deployment keeps finished keys (`taskq db purge --older-than 7d`, run daily). The seeded history
#: is the table just before that purge: 8 days of keys, the oldest day of them due, and the run's purge
#: (half-way through the schedule) deletes it.
RETENTION_S = 7 * 86400.0
_HISTORY_S = 8 * 86400.0
#: How often the table's counters and autovacuum's progress on it are sampled during the run.
_SAMPLE_EVERY = 5.0

# One statement: the rows in created_at order, as days of claims left them. One key in a hundred is dead
# (dead-lettered after 3 attempts), the rest completed; keys and task ids as wide as UUIDs in hex, spread over
# the primary key as real ones are.
_SEED = """
INSERT INTO taskq_tasks (namespace, idempotency_key, task_id, task_type, state, attempts, last_error,
                         created_at, updated_at, completed_at, dlq_partition, dlq_offset)
SELECT %(namespace)s, md5('history:' || i), md5('task:' || i), %(task_type)s,
       CASE WHEN i %% 100 = 0 THEN 'dead' ELSE 'completed' END,
       CASE WHEN i %% 100 = 0 THEN 3 ELSE 1 END,
       CASE WHEN i %% 100 = 0 THEN 'RuntimeError: seeded' END,
       at, at + interval '20 ms', CASE WHEN i %% 100 <> 0 THEN at + interval '20 ms' END,
       CASE WHEN i %% 100 = 0 THEN i %% 6 END, CASE WHEN i %% 100 = 0 THEN i / 100 END
FROM generate_series(1, %(count)s) AS i,
     LATERAL (SELECT statement_timestamp() - %(span)s * interval '1 second'
                     + i * (%(span)s / %(count)s) * interval '1 second' AS at) t
"""

_TABLE = """
SELECT pg_relation_size(s.relid) AS table_bytes, pg_indexes_size(s.relid) AS indexes_bytes,
       s.n_live_tup, s.n_dead_tup, s.n_tup_ins, s.n_tup_upd, s.n_tup_hot_upd, s.n_tup_del,
       s.autovacuum_count, s.autoanalyze_count, s.vacuum_count, s.analyze_count,
       (SELECT reloptions FROM pg_class WHERE oid = s.relid) AS options
FROM pg_stat_user_tables s WHERE s.relid = 'taskq_tasks'::regclass
"""

_INDEXES = """
SELECT c.relname AS name, pg_relation_size(c.oid) AS bytes
FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
WHERE i.indrelid = 'taskq_tasks'::regclass ORDER BY 1
"""

_SAMPLE = """
SELECT s.n_live_tup, s.n_dead_tup, s.autovacuum_count, s.autoanalyze_count,
       (SELECT phase FROM pg_stat_progress_vacuum v WHERE v.relid = s.relid LIMIT 1) AS vacuum_phase
FROM pg_stat_user_tables s WHERE s.relid = 'taskq_tasks'::regclass
"""

#: The storage parameters migration 0013 sets, reset by `default_autovacuum`.
_AUTOVACUUM = (
    "autovacuum_vacuum_threshold",
    "autovacuum_vacuum_scale_factor",
    "autovacuum_vacuum_insert_threshold",
    "autovacuum_vacuum_insert_scale_factor",
    "autovacuum_analyze_threshold",
    "autovacuum_analyze_scale_factor",
)


def _seed_history(db: Database, namespace: str, task_type: str, count: int) -> tuple[int, float]:
    """Insert `count` finished keys of `namespace` spread over 8 days, then vacuum and analyze the table as
    autovacuum would have by then: (rows inserted, seconds it took)."""
    t0 = time.monotonic()
    with db.connection() as conn:
        params = {"namespace": namespace, "task_type": task_type, "count": count, "span": _HISTORY_S}
        inserted = conn.execute(_SEED, params).rowcount
        # The insert's counters reach pg_stat_user_tables before the vacuum sets the live tuples, not after
        # it (where they would be counted twice).
        conn.execute("SELECT pg_stat_force_next_flush()")
        conn.execute("VACUUM (ANALYZE) taskq_tasks")
    return inserted, time.monotonic() - t0


def _table_stats(db: Database) -> dict[str, Any]:
    """taskq_tasks' size, its indexes' sizes and its counters from pg_stat_user_tables."""
    with db.connection() as conn:
        row = conn.execute(_TABLE).fetchone()
        indexes = {r["name"]: r["bytes"] for r in conn.execute(_INDEXES)}
    return {**(row or {}), "index_bytes": indexes}


class _Sampler:
    """A thread reading taskq_tasks' dead tuples and autovacuum's progress on it every _SAMPLE_EVERY s."""

    def __init__(self, db: Database, t0: float) -> None:
        self.samples: list[dict[str, Any]] = []
        self._db, self._t0 = db, t0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="taskq-bench-sampler", daemon=True)

    def _run(self) -> None:
        with self._db.connection() as conn:
            while True:
                row = conn.execute(_SAMPLE).fetchone()
                if row is not None:
                    self.samples.append({"at_s": round(time.monotonic() - self._t0, 1), **row})
                if self._stop.wait(_SAMPLE_EVERY):
                    return

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


class _Purge:
    """The daily `taskq db purge --older-than 7d`, in a thread of its own, started during the run."""

    def __init__(self, db: Database, namespace: str) -> None:
        self.rows: int | None = None
        self.started_s = self.seconds = 0.0
        self.error: str | None = None
        self._store = IdempotencyStore(db, owner="bench-purge", namespace=namespace)
        self._thread = threading.Thread(target=self._run, name="taskq-bench-purge", daemon=True)

    def _run(self) -> None:
        t = time.monotonic()
        try:
            self.rows = self._store.purge(RETENTION_S)
        except Exception as exc:  # reported with the run's figures
            self.error = repr(exc)
        finally:
            self.seconds = time.monotonic() - t
            self._store.close()

    def start(self, at_s: float) -> None:
        """Start the purge, `at_s` seconds into the run."""
        self.started_s = at_s
        self._thread.start()

    def join(self) -> None:
        """Wait for the purge, if it was started."""
        if self._thread.ident is not None:
            self._thread.join()


def _key(i: int) -> str:
    """The idempotency key of the run's i-th send."""
    return f"bench:{i}"


def _tier(key: str) -> str:
    """The priority a key of `_key` was sent with: the run deals its sends to the tiers in turn."""
    return PRIORITIES[int(key.rpartition(":")[2]) % len(PRIORITIES)]


def _windows(
    t0: float,
    duration: float,
    window: float,
    due: Mapping[str, float],
    enqueued: Mapping[str, float],
    started: Mapping[str, float],
    completed: Mapping[str, float],
) -> list[dict[str, Any]]:
    """Per `window` seconds of the schedule: the tasks whose send was due in it (`due`: seconds from `t0`),
    completions recorded in it per second, and the enqueue->start times (from the send actually made) of its
    tasks, all of them and per tier (which tiers a worker behind its schedule keeps waiting). A send made late
    counts in the window it was due in, so each window holds rate x window tasks."""
    n = max(1, math.ceil(duration / window - 1e-9))
    starts: list[dict[str, list[float]]] = [{tier: [] for tier in PRIORITIES} for _ in range(n)]
    sent, done = [0] * n, [0] * n
    for key, t in enqueued.items():
        k = min(n - 1, int(due[key] // window))
        sent[k] += 1
        if key in started:
            starts[k][_tier(key)].append(started[key] - t)
    for t in completed.values():
        k = int((t - t0) // window)
        if 0 <= k < n and t - t0 < duration:
            done[k] += 1
    out = []
    for k in range(n):
        lo, hi = k * window, min(duration, (k + 1) * window)
        out.append(
            {
                "from_s": lo,
                "to_s": hi,
                "enqueued": sent[k],
                "completed": done[k],
                "completed_per_s": done[k] / (hi - lo),
                "enqueue_to_start_ms": _ms([w for waits in starts[k].values() for w in waits]),
                "enqueue_to_start_p99_ms_by_tier": {tier: _ms(w)["p99"] for tier, w in starts[k].items()},
            }
        )
    return out


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
    seed_history: int = 0,
    window: float = 120.0,
    default_autovacuum: bool = False,
    claim_linger: float = WorkerConfig.claim_linger,
) -> dict[str, Any]:
    """Run Workers in processes of their own, enqueue `rate` tasks/s on a fixed schedule for `duration` s
    from this one, and time each task's way, overall and per `window` s. `bare`: the framework-free loop of
    `bench ceiling` in place of the workers, the floor of these figures on the same machine.

    `seed_history`: the run's idempotency table first holds that many finished keys of its namespace over
    8 days, the 7-day purge runs half-way through the schedule, and the report gives the table's and its
    indexes' sizes and counters before and after, with samples of its dead tuples.
    `default_autovacuum`: the table's autovacuum settings are the server's, not migration 0013's."""
    for name, value in (("rate", rate), ("duration", duration)):  # their product is the task count
        if not (value > 0 and math.isfinite(value)):
            raise ConfigurationError(f"{name} must be a finite number > 0, got {value}")
    if concurrency < 1:
        raise ConfigurationError(f"concurrency must be >= 1, got {concurrency}")
    WorkerConfig(claim_linger=claim_linger)  # refused here in one line, not in each spawned worker
    if seed_history < 0:
        raise ConfigurationError(f"seed_history must be >= 0, got {seed_history}")
    if not window > 0:
        raise ConfigurationError(f"window must be > 0, got {window}")
    count = max(1, round(rate * duration))
    scheduled: dict[str, float] = {}
    enqueued: dict[str, float] = {}
    behind: list[float] = []
    seeded, seeded_s = 0, None
    with _namespace(settings, partitions=partitions) as run:
        db = Database(run.settings.database_url, schema=run.settings.database_schema)
        if default_autovacuum:
            with db.connection() as conn:
                conn.execute(f"ALTER TABLE taskq_tasks RESET ({', '.join(_AUTOVACUUM)})")
        if seed_history:
            # The run's own namespace: its claims and completions probe the same primary key as the history,
            # and the purge (one namespace's keys) finds the history's oldest day.
            seeded, seeded_s = _seed_history(db, run.settings.namespace, run.task_type, seed_history)
        before = _table_stats(db)
        all_partitions = 4 * partitions
        purge = _Purge(Database(db.url, schema=db.schema), run.settings.namespace)
        # The workers never share this process's interpreter with the sender: under one GIL each would
        # delay the other, and the figures would be of the benchmark.
        spec = _WorkerSpec.of(run, "noop", concurrency, claim_linger=claim_linger)
        with _Workers(spec, processes=processes, spawn=True, bare=bare) as workers:
            workers.wait(
                lambda: sum(workers.partitions.values()) >= all_partitions,
                timeout,
                f"the worker was not assigned all {all_partitions} partitions",
            )
            with TaskProducer(run.settings) as producer:
                _warm_up(producer, run)
                t0 = time.monotonic()
                with _Sampler(db, t0) as sampler:
                    for i in range(count):
                        # Open loop: the i-th send is due at t0 + i/rate whatever happened to the ones before,
                        # so a slow send makes the next ones late but never moves the schedule.
                        due = t0 + i / rate
                        now = time.monotonic()
                        if now < due:
                            time.sleep(due - now)
                        else:
                            behind.append(now - due)
                        if seed_history and i == count // 2:
                            purge.start(time.monotonic() - t0)
                        key = _key(i)
                        scheduled[key] = i / rate  # not due - t0: exact where a window starts
                        enqueued[key] = time.monotonic()
                        producer.enqueue(run.task_type, {"i": i}, priority=_tier(key), idempotency_key=key)
                    sent_s = time.monotonic() - t0
                    producer.flush(60)
                    workers.wait(
                        lambda: len(workers.completed) >= count,
                        timeout,
                        f"not every one of {count} tasks ran",
                    )
                    purge.join()
        completed, started, cpu_s = workers.completed, workers.started, workers.cpu_s
        # A backend's counters reach pg_stat_user_tables when it ends, a moment after its client closed it:
        # wait until they count every claim (an insert) and completion (an update) of the run.
        deadline = time.monotonic() + 10
        after = _table_stats(db)
        while (after["n_tup_ins"] < seeded + count or after["n_tup_upd"] < count) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.2)
            after = _table_stats(db)
        samples = [*sampler.samples, {"at_s": round(time.monotonic() - t0, 1), **_sample(db)}]

    keys = [k for k in enqueued if k in completed]
    windows = _windows(t0, duration, window, scheduled, enqueued, started, completed)
    first, last = windows[0], windows[-1]
    return {
        "rate": rate,
        "duration_s": duration,
        "tasks": count,
        "completed": len(keys),
        "concurrency": concurrency,
        "claim_linger_ms": claim_linger * 1000,
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
        "window_s": window,
        "windows": windows,
        # The last window against the first: completions per second and enqueue->start p99, as ratios.
        "last_to_first": {
            "completed_per_s": _ratio(last["completed_per_s"], first["completed_per_s"]),
            "enqueue_to_start_p99": _ratio(
                last["enqueue_to_start_ms"]["p99"], first["enqueue_to_start_ms"]["p99"]
            ),
        },
        "seed_history": seed_history,
        "seeded": seeded,  # rows the seeding inserted
        "seed_s": seeded_s,
        "default_autovacuum": default_autovacuum,
        "purge": (
            {"rows": purge.rows, "started_s": purge.started_s, "seconds": purge.seconds, "error": purge.error}
            if seed_history
            else None
        ),
        "table_before": before,
        "table_after": after,
        "max_dead_tuples": max((s["n_dead_tup"] for s in samples), default=None),
        "samples": samples,
    }


def _sample(db: Database) -> dict[str, Any]:
    with db.connection() as conn:
        return dict(conn.execute(_SAMPLE).fetchone() or {})


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
