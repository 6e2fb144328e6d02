"""Benchmark of the worker runtime: N tasks through an in-process Worker, in a namespace made for the run.

The namespace (topics, consumer group, Postgres schema) is created for one run and deleted after it, so a
benchmark never reads another run's tasks nor leaves records behind. Times come from the worker's events:
enqueue, attempt start and recorded completion of every idempotency key, on one monotonic clock.
"""

from __future__ import annotations

import cProfile
import statistics
import threading
import time
from dataclasses import replace
from typing import Any, Literal

from taskq._core.db import Database
from taskq._core.envelope import PRIORITIES, Topics
from taskq._core.errors import ConfigurationError, TaskqError
from taskq._core.kafka import Admin
from taskq._core.settings import Settings
from taskq.consumer.events import AttemptStarted, Event, PartitionsAssigned, TaskCompleted
from taskq.consumer.handlers import Handlers, TaskContext
from taskq.consumer.worker import Worker, WorkerConfig
from taskq.producer.admin import create_topics
from taskq.producer.producer import TaskProducer
from taskq.schemas import Registry

__all__ = ["BENCH_HANDLERS", "bench_worker"]

BenchHandler = Literal["noop", "transactional"]
BENCH_HANDLERS: tuple[BenchHandler, ...] = ("noop", "transactional")

_EFFECTS_TABLE = "bench_effects"


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


def _ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"p50": statistics.median(ordered) * 1e3, "p99": p99 * 1e3}


def bench_worker(
    settings: Settings,
    *,
    count: int,
    concurrency: int = 4,
    handler: BenchHandler = "noop",
    partitions: int = 6,
    timeout: float = 600.0,
    profile: str | None = None,
) -> dict[str, Any]:
    """Enqueue `count` tasks over the four tiers, time a Worker running them all, drop the namespace."""
    if count < 1:
        raise ConfigurationError(f"count must be >= 1, got {count}")
    if handler not in BENCH_HANDLERS:
        raise ConfigurationError(f"handler must be one of {', '.join(BENCH_HANDLERS)}, got {handler!r}")
    stamp = int(time.time() * 1000)
    # Topic names allow '-', Avro names and SQL identifiers do not: the record and the schema use '_'.
    s = replace(settings.with_namespace(f"bench-{stamp}"), database_schema=f"bench_{stamp}")
    avro_ns = f"bench_{stamp}"
    task_type = f"{avro_ns}.Noop"
    schema = {
        "type": "record",
        "name": "Noop",
        "namespace": avro_ns,
        "fields": [{"name": "i", "type": "int"}],
    }
    topics = Topics(s.namespace, s.delay_tiers)
    db = Database(s.database_url, schema=s.database_schema)

    lock = threading.Lock()
    enqueued: dict[str, float] = {}
    started: dict[str, float] = {}
    completed: dict[str, float] = {}
    assigned: list[float] = []
    all_done = threading.Event()

    def on_event(event: Event) -> None:
        now = time.perf_counter()
        with lock:
            if isinstance(event, TaskCompleted):
                completed.setdefault(event.key, now)
                if len(completed) >= count:
                    all_done.set()
            elif isinstance(event, AttemptStarted):
                started.setdefault(event.key, now)
            elif isinstance(event, PartitionsAssigned) and not assigned:
                assigned.append(now)

    try:
        create_topics(s, partitions=partitions)
        db.migrate()
        if handler == "transactional":
            with db.connection() as conn:
                conn.execute(f"CREATE TABLE {_EFFECTS_TABLE} (key text PRIMARY KEY, i int NOT NULL)")
        with Registry(s.schema_registry_url) as registry:
            registry.register(schema)

        with TaskProducer(s) as producer:
            t0 = time.perf_counter()
            for i in range(count):
                key = f"bench:{i}"
                enqueued[key] = time.perf_counter()
                producer.enqueue(task_type, {"i": i}, priority=PRIORITIES[i % 4], idempotency_key=key)
            producer.flush(60)
            enqueue_s = time.perf_counter() - t0

        worker = Worker(
            _handlers(task_type, schema, handler),
            s,
            WorkerConfig(concurrency=concurrency, forwarder=False, metrics_port=None),
            hooks=[on_event],
        )
        profiler = cProfile.Profile() if profile else None
        failure: list[BaseException] = []

        def run() -> None:
            try:
                if profiler is not None:
                    profiler.runcall(worker.run)
                else:
                    worker.run()
            except BaseException as exc:
                failure.append(exc)
                all_done.set()

        thread = threading.Thread(target=run, name="taskq-bench-worker", daemon=True)
        t_start = time.perf_counter()
        thread.start()
        try:
            if not all_done.wait(timeout):
                raise TaskqError(f"bench: {len(completed)} of {count} tasks completed within {timeout}s")
            if failure:
                raise TaskqError(f"bench: the worker stopped: {failure[0]!r}") from failure[0]
        finally:
            worker.stop()
            thread.join(60)
        if profiler is not None and profile is not None:
            profiler.dump_stats(profile)

        with lock:
            t_end = max(completed.values())
            end_to_end = [completed[k] - enqueued[k] for k in completed]
            attempt = [completed[k] - started[k] for k in completed if k in started]
            done = len(completed)
            t_assigned = assigned[0] if assigned else t_start
        effects = None
        if handler == "transactional":
            with db.connection() as conn:
                row = conn.execute(f"SELECT count(*) AS n FROM {_EFFECTS_TABLE}").fetchone()
                effects = int(row["n"]) if row else 0
    finally:
        Admin(s).delete_topics([*topics.priority_topics, *topics.delay_topics, topics.dlq])
        db.drop_schema()
        with Registry(s.schema_registry_url) as registry:
            registry.delete_subject(task_type)

    return {
        "tasks": count,
        "completed": done,
        "handler": handler,
        "concurrency": concurrency,
        "partitions": partitions,
        "namespace": s.namespace,
        "enqueue_s": enqueue_s,
        # From Worker.run() to the last recorded completion: joining the group included.
        "elapsed_s": t_end - t_start,
        "tasks_per_s": done / (t_end - t_start),
        "startup_s": t_assigned - t_start,
        "tasks_per_s_after_assignment": done / (t_end - t_assigned),
        # All tasks are enqueued before the worker starts, so this includes waiting behind the backlog.
        "enqueue_to_completion_ms": _ms(end_to_end),
        # From the handler's start to the completion recorded in Postgres (claim batching excluded).
        "attempt_to_recorded_ms": _ms(attempt),
        "effects": effects,
    }
