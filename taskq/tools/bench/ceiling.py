"""`bench ceiling`: what Kafka and Postgres allow this design without the framework (consume, claim,
complete, commit; produce), to compare the worker and the producer with."""

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
from confluent_kafka import Consumer, Message, Producer

from taskq._core.db import Database, Transaction
from taskq._core.envelope import Topics
from taskq._core.errors import ConfigurationError, TaskqError
from taskq._core.kafka import consumer_config, producer_config
from taskq._core.kafka_admin import Admin
from taskq._core.settings import Settings
from taskq._core.store import Finished, Store
from taskq.consumer.worker import GROUP_MAX
from taskq.tools.bench.run import _EFFECTS_TABLE, _enqueue, _enqueue_many, _namespace, _Run
from taskq.tools.bench.runners import _Channel, _claim_requests, _commit_batch, _headers, _picklable
from taskq.tools.bench.worker import bench_worker


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
