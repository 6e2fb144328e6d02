"""A bench run: its scratch namespace and one task type, the tasks it enqueues, and the percentiles of its
figures."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from taskq._core.db import Database
from taskq._core.envelope import PRIORITIES, Topics
from taskq._core.errors import ConfigurationError, KafkaUnavailableError, TaskqError
from taskq._core.kafka_admin import Admin
from taskq._core.settings import Settings
from taskq.producer.admin import create_topics
from taskq.schemas import Registry
from taskq.tools.bench.effects import EFFECTS_TABLE, BenchHandler

if TYPE_CHECKING:
    from taskq.producer.producer import TaskProducer

log = logging.getLogger("taskq.bench")

#: The ceiling's consuming passes, each in a group of its own (`<namespace>.ceiling-<pass>`).
_CEILING_PASSES = ("commit", "claim", "lean", "transactional")


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


def _wal_position(settings: Settings) -> str:
    """Where the Postgres server's WAL ends now (an LSN)."""
    with Database(settings.database_url, schema=settings.database_schema).connection() as conn:
        row = conn.execute("SELECT pg_current_wal_lsn()::text AS lsn").fetchone()
    return str(row["lsn"]) if row else "0/0"


def _wal_bytes_since(settings: Settings, start: str) -> int:
    """Bytes of WAL the Postgres server wrote since `start` (from `_wal_position`): every client's."""
    with Database(settings.database_url, schema=settings.database_schema).connection() as conn:
        query = "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn) AS n"
        row = conn.execute(query, (start,)).fetchone()
    return int(row["n"]) if row else 0


def machine_cpu(stat: str | None = None) -> tuple[int, int] | None:
    """The machine's CPU time so far, all cores, in clock ticks: (busy, total), from /proc/stat's `cpu`
    line (busy: all but idle and iowait). None where there is no /proc/stat (not Linux)."""
    if stat is None:
        try:
            with open("/proc/stat") as f:
                stat = f.readline()
        except OSError:
            return None
    fields = stat.split()
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    total = sum(ticks)
    return total - ticks[3] - ticks[4], total


def machine_busy_since(start: tuple[int, int] | None, now: tuple[int, int] | None = None) -> float | None:
    """The fraction of the machine's CPU (all cores) busy since `start` (from `machine_cpu`)."""
    now = now or machine_cpu()
    if start is None or now is None or now[1] <= start[1]:
        return None
    return (now[0] - start[0]) / (now[1] - start[1])


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
    """A scratch namespace with one task type, registered for the run; its effects table for a handler that
    writes one (plain, transactional)."""
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
            if handler != "noop":
                db = Database(s.database_url, schema=s.database_schema)
                with db.connection() as conn:
                    conn.execute(f"CREATE TABLE {EFFECTS_TABLE} (key text PRIMARY KEY, i int NOT NULL)")
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
    from taskq.producer.producer import TaskProducer  # the parent's alone: not in a spawned worker's start

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
    from taskq.producer.producer import TaskProducer

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
