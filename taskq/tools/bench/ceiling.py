"""`bench ceiling`: what Kafka and Postgres allow this design without the framework (consume, claim,
complete, commit; produce), and the same work done plainly on a narrow table of its own (the lean
reference), to compare the worker and the producer with."""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
from collections.abc import Callable
from typing import Any

import psycopg

# The ceiling measures librdkafka itself, so this module and the bare loop's (runners) are the only ones
# besides taskq._core's Kafka adapter that hold its clients; their settings are the adapter's own
# (producer_config, consumer_config).
from confluent_kafka import Consumer, Message, Producer, TopicPartition

from taskq._core.db import Database, Statement, Transaction
from taskq._core.envelope import H, Topics
from taskq._core.errors import ConfigurationError, TaskqError
from taskq._core.kafka import consumer_config, producer_config
from taskq._core.kafka_admin import Admin
from taskq._core.settings import Settings
from taskq._core.store import Finished, Store
from taskq.consumer.dispatch import GROUP_MAX
from taskq.consumer.worker import WorkerConfig
from taskq.tools.bench.effects import EFFECTS_TABLE
from taskq.tools.bench.run import (
    _enqueue,
    _enqueue_many,
    _namespace,
    _Run,
    _wal_bytes_since,
    _wal_position,
)
from taskq.tools.bench.runners import _LEASE_SECONDS, _Channel, _claim_requests, _headers, _picklable
from taskq.tools.bench.worker import bench_worker

#: The lean reference's table: a key, its lease and whether it is done; no namespace, no history.
_LEAN_TABLE = "bench_lean"
# The lean reference's statements, each once per batch: what claiming and completing a batch costs done
# plainly. Not the project's queries (those live in sql/queries.sql): a yardstick for them. The completion
# reaches its rows by the primary key (`= ANY(keys)`), as the project's does: joined alone, its plan is a
# scan of the whole table per batch on a table without statistics, and the reference would slow down as
# its table grows.
_LEAN_CLAIM = Statement(
    "bench_lean_claim",
    f"""INSERT INTO {_LEAN_TABLE} AS l (key, owner, attempts, lease_expires_at)
SELECT key, %(owner)s, 1, now() + %(lease)s * interval '1 second' FROM unnest(%(keys)s::text[]) AS key
ON CONFLICT (key) DO UPDATE SET owner = EXCLUDED.owner, attempts = l.attempts + 1,
    lease_expires_at = EXCLUDED.lease_expires_at
WHERE NOT l.done AND l.lease_expires_at < now()
RETURNING key, attempts""",
)
_LEAN_COMPLETE = Statement(
    "bench_lean_complete",
    f"""UPDATE {_LEAN_TABLE} l SET done = true, lease_expires_at = NULL
FROM unnest(%(keys)s::text[], %(attempts)s::int[]) AS c(key, attempts)
WHERE l.key = ANY(%(keys)s::text[]) AND l.key = c.key AND l.owner = %(owner)s AND l.attempts = c.attempts
RETURNING l.key""",
)


class _Offsets:
    """A consumer's offsets committed as the worker commits them: asynchronously, every commit_interval
    (the outcome comes to a later consume), and what is left when the pass ends."""

    def __init__(self, consumer: Consumer, interval: float = WorkerConfig.commit_interval) -> None:
        self._consumer = consumer
        self._interval = interval
        self._next: dict[tuple[str, int], int] = {}
        self._last = time.monotonic()

    def consumed(self, msgs: list[Message]) -> None:
        """Records processed: their offsets are committable, and committed if the interval has passed."""
        for m in msgs:
            self._next[(m.topic() or "", m.partition() or 0)] = (m.offset() or 0) + 1
        if time.monotonic() - self._last >= self._interval:
            self.commit()

    def commit(self) -> None:
        """Commit what is committable now, not waiting for the broker."""
        self._last = time.monotonic()
        if self._next:
            parts = [TopicPartition(t, p, o) for (t, p), o in self._next.items()]
            self._consumer.commit(offsets=parts, asynchronous=True)
            self._next = {}


def _consume_pass(
    run: _Run, group: str, count: int, timeout: float, batch: Callable[[list[Message]], None] | None
) -> dict[str, float]:
    """One framework-free pass over the backlog in its own group: consume(500), `batch` it, commit as the
    worker does (`_Offsets`). Also the Postgres WAL written meanwhile, per record."""
    wal_start = _wal_position(run.settings)
    consumer = Consumer(consumer_config(run.settings, group=group))
    offsets = _Offsets(consumer)
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
            offsets.consumed(msgs)
            seen += len(msgs)
        offsets.commit()
        t_end = time.monotonic()
    finally:
        consumer.close()
    t_assigned = assigned[0] if assigned else t_subscribed
    return {
        "tasks_per_s": seen / (t_end - t_assigned),
        "startup_s": t_assigned - t_subscribed,
        # The whole server's WAL, so another client's writes meanwhile count too: read it on a quiet server.
        "wal_bytes_per_task": _wal_bytes_since(run.settings, wal_start) / seen,
    }


def _lean_keys(msgs: list[Message]) -> list[str]:
    """The idempotency keys of a batch of task records (headers only, as the project's pass reads them)."""
    name = H + "idempotency-key"
    return [next(v for k, v in _headers(m) if k == name).decode() for m in msgs]


def _lean_pass(run: _Run, count: int, timeout: float) -> dict[str, float]:
    """The lean reference (`_LEAN_CLAIM`, `_LEAN_COMPLETE`) in the same loop as the project's statements,
    on a table of its own: tasks/s, WAL per task, and how many keys it claimed and completed."""
    s = run.settings
    db = Database(s.database_url, schema=s.database_schema)
    with db.connection() as conn:
        conn.execute(
            f"CREATE TABLE {_LEAN_TABLE} (key text PRIMARY KEY, owner text NOT NULL, attempts int NOT NULL, "
            "lease_expires_at timestamptz, done boolean NOT NULL DEFAULT false)"
        )
    # Sent as the project's pass sends its statements: on the kept connection (its planner settings, so
    # both reach rows the same way), through libpq.
    owner = f"bench-ceiling:{os.getpid()}"
    claimed = 0

    def claim_and_complete(msgs: list[Message]) -> None:
        nonlocal claimed
        params = {"keys": _lean_keys(msgs), "owner": owner, "lease": _LEASE_SECONDS}
        [rows] = db.round_trip((_LEAN_CLAIM, params))
        keys, attempts = [r["key"] for r in rows], [r["attempts"] for r in rows]
        db.round_trip((_LEAN_COMPLETE, {"keys": keys, "attempts": attempts, "owner": owner}))
        claimed += len(rows)

    try:
        result = _consume_pass(run, f"{s.namespace}.ceiling-lean", count, timeout, claim_and_complete)
        with db.connection() as conn:
            row = conn.execute(f"SELECT count(*) AS n FROM {_LEAN_TABLE} WHERE done").fetchone()
    finally:
        db.close()
    return {**result, "claimed": claimed, "completed": int(row["n"]) if row else 0}


def _transactional_loop(
    values: dict[str, Any], count: int, timeout: float, recorded: Any, out: _Channel
) -> None:
    """A spawned process's entry: the transactional ceiling's loop, in a group with the others, until they
    have recorded `count` tasks together (`recorded`, shared: a record read again after a rebalance, its
    offset not committed yet, is skipped and not counted twice). Per batch of records one claim, then per
    GROUP_MAX claimed tasks one transaction holding, per task, the transactional bench handler's INSERT (no
    savepoint: the worker's groups run without while their handlers seldom raise), and the completions, its
    statements pipelined (two round trips a group); offsets are
    committed as the worker commits them (`_Offsets`). Puts (first assignment, end of the last batch,
    tasks recorded, error) to `out`."""
    s = Settings(**values)
    store = Store(Database(s.database_url, schema=s.database_schema))
    conn = store.database.connect(autocommit=False)
    tx = Transaction(store.database, conn)
    owner = f"bench-ceiling:{os.getpid()}"
    insert = f"INSERT INTO {EFFECTS_TABLE} (key, i) VALUES (%s, %s)"
    consumer = Consumer(consumer_config(s, group=f"{s.namespace}.ceiling-transactional"))
    offsets = _Offsets(consumer)
    assigned: list[float] = []
    consumer.subscribe(
        Topics(s.namespace).priority_topics,
        on_assign=lambda c, parts: assigned.append(time.monotonic()) if not assigned else None,
    )
    mine, ended, error = 0, None, None
    deadline = time.monotonic() + timeout
    try:
        while recorded.value < count and time.monotonic() < deadline:
            msgs = [m for m in consumer.consume(500, 0.1) if m.error() is None]
            if not msgs:
                continue
            answers = store.claim(s.namespace, owner, _claim_requests(msgs), stale_after=10.0)
            claimed = [c for c in answers if c.outcome == "claimed"]
            # Groups as the worker bounds them: with savepoints, past 64 subtransactions a transaction
            # overflows a cache.
            for claims in (claimed[i : i + GROUP_MAX] for i in range(0, len(claimed), GROUP_MAX)):
                done = [Finished(c.idempotency_key, c.attempts, "completed") for c in claims]
                with conn.pipeline(), psycopg.Transaction(conn):
                    cur = conn.cursor()
                    for i, c in enumerate(claims):
                        cur.execute(insert, (c.idempotency_key, i))
                    answered = store.send_complete(s.namespace, owner, done, tx=tx)
                if len(answered()) != len(done):
                    raise TaskqError("bench: a completion of the transactional pass was not recorded")
            offsets.consumed(msgs)
            ended = time.monotonic()
            mine += len(claimed)
            with recorded.get_lock():
                recorded.value += len(claimed)
        offsets.commit()
    except Exception as exc:  # reported to the parent, which raises it
        error = repr(exc)
    finally:
        consumer.close()
        conn.close()
        store.database.close()
    out.put((assigned[0] if assigned else None, ended, mine, error))


def _transactional_pass(run: _Run, count: int, timeout: float, processes: int) -> dict[str, float]:
    """The ceiling of group commit without the framework (`_transactional_loop`), in `processes` spawned
    processes of one group: tasks/s from the first assignment to the end of the last batch."""
    values = _picklable(run.settings)
    ctx = multiprocessing.get_context("spawn")
    recorded, out = ctx.Value("q", 0), ctx.Queue()
    loops = [
        ctx.Process(target=_transactional_loop, args=(values, count, timeout, recorded, out), daemon=True)
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
    if errors or recorded.value < count:
        what = errors[0] if errors else f"{recorded.value} of {count} tasks recorded"
        raise TaskqError(f"bench: transactional pass: {what}")
    start = min(r[0] for r in results if r[0] is not None)
    end = max(r[1] for r in results if r[1] is not None)
    db = Database(run.settings.database_url, schema=run.settings.database_schema)
    with db.connection() as conn:
        row = conn.execute(f"SELECT count(*) AS n FROM {EFFECTS_TABLE}").fetchone()
    completed = Store(db).counts(run.settings.namespace).get("completed", 0)
    db.close()
    return {
        "tasks_per_s": recorded.value / (end - start),
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
            # Sent as the worker sends them: prepared, through libpq (`Database.round_trip`).
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
        lean = _lean_pass(run, count, timeout)

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
        # From the first partition assignment to the last commit, each in a group of its own, committing
        # as the worker does: asynchronously, every commit_interval.
        "commit_interval_s": WorkerConfig.commit_interval,
        "consume_commit_per_s": commit_only["tasks_per_s"],
        # The design's statements: the worker's own claim and complete, through Store, once a batch each.
        "consume_claim_complete_commit_per_s": claim_complete["tasks_per_s"],
        "claimed": claimed,
        "completed": recorded,
        # Bytes of Postgres WAL per task (the whole server's, pg_current_wal_lsn before and after the pass).
        "claim_complete_wal_bytes_per_task": claim_complete["wal_bytes_per_task"],
        # The lean reference: one upsert and one update a batch on a narrow table of its own.
        "lean_per_s": lean["tasks_per_s"],
        "lean_claimed": lean["claimed"],
        "lean_completed": lean["completed"],
        "lean_wal_bytes_per_task": lean["wal_bytes_per_task"],
        "claim_complete_fraction_of_lean": claim_complete["tasks_per_s"] / lean["tasks_per_s"],
        # Claim, then per task one INSERT, and the completions, in one transaction a group.
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
        data["worker_fraction_of_lean"] = worker["tasks_per_s_after_assignment"] / data["lean_per_s"]
        data["worker_wal_bytes_per_task"] = worker["wal_bytes_per_task"]
    return data
