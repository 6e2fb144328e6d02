"""The `taskq` command line."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from taskq._core.durations import parse_duration
from taskq._core.envelope import PRIORITIES
from taskq._core.errors import ConfigurationError, TaskqError
from taskq._core.settings import Settings
from taskq.schemas.errors import SchemaError


def _print(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, default=str) if args.json else text, flush=True)


def _progress(args: argparse.Namespace, prefix: str, logger: str) -> Callable[[str], None]:
    """Where a command reports its progress: stderr lines `PREFIX: ...`, or with --log-format json INFO lines
    of `logger`, so that every line on stderr is JSON."""
    if args.log_format == "json":
        log = logging.getLogger(logger)
        log.setLevel(logging.INFO)
        return log.info
    return lambda line: print(f"{prefix}: {line}", file=sys.stderr, flush=True)


#: Commands that run until stopped: they wait out a broker that is away, the others report it.
_LONG_RUNNING = ("worker", "forwarder", "relay")
#: Commands that log as they run, and take --log-format after their name (any command takes it before).
_LOGGING = (*_LONG_RUNNING, "chaos", "stats", "console")
LOG_FORMATS = ("text", "json")


def _settings(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {}
    if getattr(args, "namespace", None):
        overrides["namespace"] = args.namespace
    if args.command not in _LONG_RUNNING:
        # Fail fast: a one-off command that cannot reach the broker says so in about 10 s.
        overrides["kafka_timeout"] = 10.0
    return Settings.from_env(**overrides)


# ------------------------------------------------------------------------------------------------ topics
def cmd_topics_create(args: argparse.Namespace) -> int:
    from taskq.producer.admin import create_topics

    created = create_topics(_settings(args), partitions=args.partitions, replication=args.replication)
    lines = [f"{'created' if new else 'exists '}  {name}" for name, new in sorted(created.items())]
    _print(args, created, "\n".join(lines))
    return 0


# ----------------------------------------------------------------------------------------------- schemas
def cmd_schemas_register(args: argparse.Namespace) -> int:
    from taskq.schemas import Registry, load_schema

    out = []
    with Registry.from_settings(_settings(args)) as registry:
        for path in args.paths:
            reg = registry.register(load_schema(path))
            out.append(
                {"subject": reg.subject, "version": reg.version, "id": reg.schema_id, "path": str(path)}
            )
    _print(
        args,
        out,
        "\n".join(f"{o['subject']}  version {o['version']}  id {o['id']}  ({o['path']})" for o in out),
    )
    return 0


def cmd_schemas_list(args: argparse.Namespace) -> int:
    from taskq.schemas import Registry

    rows = []
    with Registry.from_settings(_settings(args)) as registry:
        for subject in sorted(registry.subjects()):
            latest = registry.latest(subject)
            rows.append({"subject": subject, "latest_version": latest.version, "id": latest.schema_id})
    _print(args, rows, "\n".join(f"{r['subject']}  v{r['latest_version']}  id {r['id']}" for r in rows))
    return 0


def cmd_schemas_check(args: argparse.Namespace) -> int:
    from taskq.schemas import Registry, full_name, load_schema

    results = []
    with Registry.from_settings(_settings(args)) as registry:
        for path in args.paths:
            schema = load_schema(path)
            results.append(
                {"path": str(path), "subject": full_name(schema), "compatible": registry.check(schema)}
            )
    _print(
        args,
        results,
        "\n".join(
            f"{'compatible  ' if r['compatible'] else 'INCOMPATIBLE'}  {r['subject']}  ({r['path']})"
            for r in results
        ),
    )
    return 0 if all(r["compatible"] for r in results) else 1


# ----------------------------------------------------------------------------------------------- enqueue
def cmd_enqueue(args: argparse.Namespace) -> int:
    from taskq.producer.producer import TaskProducer

    try:
        payload = json.loads(args.json_payload)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"taskq enqueue: --json is not valid JSON: {exc}") from None
    # Fail fast: a command that cannot reach the broker says so in about 10 s, not after librdkafka's
    # two-minute delivery timeout.
    quick = {"message.timeout.ms": 10_000, "socket.connection.setup.timeout.ms": 5_000}
    with TaskProducer(_settings(args), kafka_config=quick) as producer:
        receipt = producer.enqueue(
            args.task_type,
            payload,
            priority=args.priority,
            key=args.key,
            idempotency_key=args.idempotency_key,
            delay=parse_duration(args.delay) if args.delay else None,
            max_attempts=args.max_attempts,
            timeout=args.timeout,
            wait=True,
        )
    data = {
        "task_id": receipt.task_id,
        "topic": receipt.topic,
        "partition": receipt.partition,
        "offset": receipt.offset,
        "idempotency_key": receipt.idempotency_key,
        "not_before": receipt.not_before.isoformat() if receipt.not_before else None,
    }
    _print(args, data, f"{receipt.task_id}  {receipt.topic}")
    return 0


# -------------------------------------------------------------------------------------------------- bench
def cmd_bench_produce(args: argparse.Namespace) -> int:
    from taskq.demo import schema as demo_schema
    from taskq.producer.admin import create_topics
    from taskq.producer.producer import TaskProducer
    from taskq.schemas import Registry

    if args.batch < 1:
        raise ConfigurationError(f"--batch must be >= 1, got {args.batch}")
    settings = _settings(args)
    with Registry.from_settings(settings) as registry:
        registry.register(demo_schema("send_email"))
    create_topics(settings)
    n = args.count
    latencies: list[float] = []
    with TaskProducer(settings) as producer:
        producer.enqueue("demo.SendEmail", {"to": "warm@example.com", "subject": "warm-up"}, wait=True)
        started = time.perf_counter()
        batch = args.batch
        for first in range(0, n, batch):
            numbers = range(first, min(n, first + batch))
            payloads = [
                {"to": f"user{i}@example.com", "subject": "bench", "body": "x" * args.body_bytes}
                for i in numbers
            ]
            t0 = time.perf_counter()
            if batch == 1:
                producer.enqueue(
                    "demo.SendEmail",
                    payloads[0],
                    priority=PRIORITIES[first % 4],
                    idempotency_key=f"bench:{started}:{first}",
                )
            else:
                producer.enqueue_many(
                    "demo.SendEmail",
                    payloads,
                    priority=PRIORITIES[(first // batch) % 4],
                    idempotency_keys=[f"bench:{started}:{i}" for i in numbers],
                )
            latencies.append(time.perf_counter() - t0)
        accepted = time.perf_counter() - started
        producer.flush()
        acked = time.perf_counter() - started
    latencies.sort()

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1e6

    data = {
        "tasks": n,
        "batch": batch,
        "accept_rate_per_s": n / accepted,
        "acked_rate_per_s": n / acked,
        "enqueue_us": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "max": latencies[-1] * 1e6},
        "mean_us": statistics.fmean(latencies) * 1e6,
    }
    _print(
        args,
        data,
        f"{n} tasks{f' in calls of {batch}' if batch > 1 else ''}: "
        f"{data['acked_rate_per_s']:.0f} tasks/s acknowledged "
        f"({data['accept_rate_per_s']:.0f}/s accepted); "
        f"latency per call p50 {data['enqueue_us']['p50']:.0f} us, p90 {data['enqueue_us']['p90']:.0f} us, "
        f"p99 {data['enqueue_us']['p99']:.0f} us",
    )
    return 0


def cmd_bench_worker(args: argparse.Namespace) -> int:
    from taskq.tools.bench import bench_worker

    data = bench_worker(
        _settings(args),
        count=args.count,
        concurrency=args.concurrency,
        processes=args.processes,
        handler=args.handler,
        partitions=args.partitions,
        timeout=args.timeout,
        profile=args.profile,
    )
    _print(args, data, _worker_text(data))
    return 0


def _worker_text(data: dict[str, Any]) -> str:
    start, e2e, attempt = (
        data["enqueue_to_start_ms"],
        data["enqueue_to_completion_ms"],
        data["attempt_to_recorded_ms"],
    )
    return (
        f"{data['completed']} tasks ({data['handler']}, {data['processes']} x concurrency "
        f"{data['concurrency']}): {data['tasks_per_s']:.0f} tasks/s from worker start "
        f"({data['tasks_per_s_after_assignment']:.0f}/s after partition assignment at "
        f"{data['startup_s']:.2f} s, {data['tasks_per_s_from_first_enqueue']:.0f}/s from the first enqueue); "
        f"worker CPU {data['worker_cpu_ms_per_task']:.2f} ms/task; "
        f"enqueue-to-start p50 {start['p50']:.0f} ms, p99 {start['p99']:.0f} ms, "
        f"enqueue-to-completion p50 {e2e['p50']:.0f} ms, p99 {e2e['p99']:.0f} ms (backlog included); "
        f"attempt start to recorded p50 {attempt['p50']:.1f} ms, p99 {attempt['p99']:.1f} ms"
    )


def cmd_bench_ceiling(args: argparse.Namespace) -> int:
    from taskq.tools.bench import bench_ceiling

    data = bench_ceiling(
        _settings(args),
        count=args.count,
        partitions=args.partitions,
        timeout=args.timeout,
        with_worker=args.with_worker,
        concurrency=args.concurrency,
        processes=args.processes,
    )

    def row(label: str, rate: float, note: str = "") -> str:
        return f"  {label:<38}{rate:8.0f} tasks/s{'   ' + note if note else ''}"

    lines = [
        f"{data['tasks']} tasks of {data['record_bytes']} bytes (value and headers), "
        f"{data['partitions']} partitions per tier:",
        row("consume + commit", data["consume_commit_per_s"]),
        row(
            "consume + claim + complete + commit",
            data["consume_claim_complete_commit_per_s"],
            f"(the ceiling of a worker; {data['completed']} completions recorded)",
        ),
        row(
            "+ a savepoint and an INSERT per task",
            data["transactional_per_s"],
            f"(the ceiling of a transactional worker, groups of {data['group_max']}; "
            f"{data['transactional_effects']} effects, {data['transactional_completed']} completions)",
        ),
        row(
            "the same in 2 processes",
            data["transactional_2_processes_per_s"],
            f"({data['transactional_2_processes_effects']} effects, "
            f"{data['transactional_2_processes_completed']} completions)",
        ),
        row(
            "raw produce, acks=all",
            data["raw_produce_per_s"],
            f"(CPU {data['raw_produce_cpu_us']:.1f} us/task)",
        ),
        row(
            "TaskProducer.enqueue, same records",
            data["task_producer_per_s"],
            f"({data['task_producer_fraction']:.0%} of raw produce; "
            f"CPU {data['task_producer_cpu_us']:.1f} us/task)",
        ),
        row(
            "TaskProducer.enqueue_many, 500 a call",
            data["task_producer_bulk_per_s"],
            f"({data['task_producer_bulk_fraction']:.0%} of raw produce; "
            f"CPU {data['task_producer_bulk_cpu_us']:.1f} us/task)",
        ),
    ]
    if "worker" in data:
        w = data["worker"]
        lines.append(
            row(
                f"worker ({w['processes']} x concurrency {w['concurrency']})",
                w["tasks_per_s_after_assignment"],
                f"({data['worker_fraction']:.0%} of the ceiling)",
            )
        )
    _print(args, data, "\n".join(lines))
    return 0


def cmd_bench_latency(args: argparse.Namespace) -> int:
    from taskq.tools.bench import bench_latency

    data = bench_latency(
        _settings(args),
        rate=args.rate,
        duration=args.duration,
        concurrency=args.concurrency,
        processes=args.processes,
        partitions=args.partitions,
        timeout=args.timeout,
        bare=args.bare,
    )

    def ms(d: dict[str, float]) -> str:
        return f"p50 {d['p50']:.1f}, p90 {d['p90']:.1f}, p99 {d['p99']:.1f}, max {d['max']:.1f} ms"

    _print(
        args,
        data,
        ("framework-free loop (--bare): " if data["bare"] else "")
        + f"{data['completed']} of {data['tasks']} tasks at {data['achieved_rate_per_s']:.0f}/s "
        f"(asked {data['rate']:g}/s; {data['late_sends']} sends late, at most "
        f"{data['max_behind_schedule_ms']:.1f} ms; "
        f"worker CPU {data['worker_cpu_ms_per_task']:.2f} ms/task):\n"
        f"  enqueue to start       {ms(data['enqueue_to_start_ms'])}\n"
        f"  enqueue to completion  {ms(data['enqueue_to_completion_ms'])}",
    )
    return 0


# -------------------------------------------------------------------------------------------------- chaos
def cmd_chaos(args: argparse.Namespace) -> int:
    from taskq.tools.chaos import run_chaos

    report = run_chaos(
        _settings(args),
        workers=args.workers,
        duration=args.duration,
        rate=args.rate,
        concurrency=args.concurrency,
        seed=args.seed,
        kill_every=args.kill_every,
        restart_kafka_cmd=args.restart_kafka_cmd,
        restart_postgres_cmd=args.restart_postgres_cmd,
        service_restarts=args.service_restarts,
        partitions=args.partitions,
        drain_timeout=args.drain_timeout,
        keep=args.keep,
        progress=_progress(args, "chaos", "taskq.chaos"),
    )
    _print(args, report.to_dict(), report.text())
    return 0 if report.passed else 1


# ----------------------------------------------------------------------------------------------------- db
def cmd_db_migrate(args: argparse.Namespace) -> int:
    from taskq._core.db import Database

    s = _settings(args)
    applied = Database(s.database_url, schema=s.database_schema).migrate(namespace=s.namespace)
    _print(args, applied, "\n".join(f"applied {m}" for m in applied) or "up to date")
    return 0


# ------------------------------------------------------------------------------------------------- worker
def cmd_worker(args: argparse.Namespace) -> int:
    from taskq._core.envelope import DEFAULT_WEIGHTS
    from taskq.consumer.handlers import load
    from taskq.consumer.worker import Worker, WorkerConfig

    if args.processes < 1:
        raise ConfigurationError(f"--processes must be >= 1, got {args.processes}")
    sys.path.insert(0, os.getcwd())
    handlers = load(args.handlers)  # with --processes too: a bad MODULE:ATTR fails here, in one line
    weights = DEFAULT_WEIGHTS
    if args.weights:
        parts = args.weights.split(",")
        if len(parts) != len(PRIORITIES):
            raise ConfigurationError(
                f"--weights needs {len(PRIORITIES)} comma-separated integers (critical,high,normal,low)"
            )
        try:
            weights = dict(zip(PRIORITIES, (int(x) for x in parts), strict=True))
        except ValueError:
            raise ConfigurationError(f"--weights must be integers, got {args.weights!r}") from None
    config = WorkerConfig(
        concurrency=args.concurrency,
        group=args.group,
        weights=weights,
        shutdown_timeout=args.shutdown_timeout,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        buffer_capacity=args.buffer,
        buffer_bytes=args.buffer_mb * 1024 * 1024,
        forwarder=not args.no_forwarder,
        relay=not args.no_relay,
        stale_after=args.stale_after,
    )
    if args.processes > 1:
        from taskq.consumer.supervisor import Supervisor

        supervisor = Supervisor(
            args.handlers,
            _settings(args),
            config,
            processes=args.processes,
            setup=functools.partial(
                _configure_logging, args.verbose, args.command, pids=True, log_format=args.log_format
            ),
        )
        return supervisor.run()
    worker = Worker(handlers, _settings(args), config)
    worker.install_signal_handlers()
    log = logging.getLogger("taskq.worker")
    log.info("worker %s: %d handler(s), group %s", worker.worker_id, len(handlers), worker.group)
    worker.run()
    return 0


def cmd_periodic_list(args: argparse.Namespace) -> int:
    """The periodic tasks of the namespace: schedule, last slot staged, next slot."""
    from taskq._core.db import Database
    from taskq._core.store import Store
    from taskq.consumer.handlers import load
    from taskq.consumer.periodic import schedule_from_text

    s = _settings(args)
    database = Database(s.database_url, schema=s.database_schema)
    try:
        rows = {r["name"]: dict(r) for r in Store(database).periodic_list(s.namespace)}
    finally:
        database.close()
    if args.handlers:
        sys.path.insert(0, os.getcwd())
        for spec in load(args.handlers).periodic_tasks:
            row = rows.setdefault(spec.name, {"name": spec.name, "last_slot": None, "staged_at": None})
            row.update(schedule=spec.schedule.text, catch_up=spec.catch_up, task_type=spec.task_type)
    now = datetime.now(UTC)
    out = []
    for name in sorted(rows):
        row = rows[name]
        last = row.get("last_slot")
        nxt = schedule_from_text(row["schedule"]).next_after(max(now, last) if last else now)
        out.append(
            {
                "name": name,
                "schedule": row["schedule"],
                "catch_up": row["catch_up"],
                "last_slot": last.isoformat() if last else None,
                "next_slot": nxt.isoformat(),
            }
        )
    text = "\n".join(
        f"{r['name']:<30} {r['schedule']:<16} last {r['last_slot'] or 'never':<32} next {r['next_slot']}"
        for r in out
    )
    _print(args, out, text or "no periodic tasks")
    return 0


def cmd_relay(args: argparse.Namespace) -> int:
    """Publish the outbox (tasks staged with enqueue(..., conn=)) until SIGTERM/SIGINT."""
    import signal

    from taskq._core.db import Database
    from taskq.producer.outbox import OutboxRelay

    relay = OutboxRelay(_settings(args), batch=args.batch)
    Database(relay.settings.database_url, schema=relay.settings.database_schema).migrate(
        namespace=relay.settings.namespace
    )
    signal.signal(signal.SIGTERM, lambda signum, frame: relay.stop())
    signal.signal(signal.SIGINT, lambda signum, frame: relay.stop())
    logging.getLogger("taskq.relay").info("relay: publishing the outbox of %s", relay.namespace)
    relay.run()
    return 0


def cmd_forwarder(args: argparse.Namespace) -> int:
    import signal

    from taskq.consumer.forwarder import Forwarder

    forwarder = Forwarder(_settings(args))
    signal.signal(signal.SIGTERM, lambda signum, frame: forwarder.stop())
    signal.signal(signal.SIGINT, lambda signum, frame: forwarder.stop())
    logging.getLogger("taskq.forwarder").info(
        "forwarder %s: delay tiers of %s", forwarder.instance_id, forwarder.topics.namespace
    )
    forwarder.run()
    return 0


def cmd_db_purge(args: argparse.Namespace) -> int:
    from taskq._core.db import Database
    from taskq.consumer.dlq import DeadLetters
    from taskq.consumer.store import IdempotencyStore

    s = _settings(args)
    ttl = parse_duration(args.older_than).total_seconds()
    # Keys of tasks still in the DLQ are kept, whatever their age: a replay must find the key's record,
    # or a task whose effect already happened (through another copy) would run a second time.
    with DeadLetters(s) as dlq:
        keep = {r.idempotency_key for r in dlq.list(include_replayed=True) if r.idempotency_key}
    store = IdempotencyStore(
        Database(s.database_url, schema=s.database_schema), owner="taskq-cli", namespace=s.namespace
    )
    try:
        n = store.purge(ttl, keep=sorted(keep))
        buckets, slots = store.purge_idle()
    finally:
        store.close()
    _print(
        args,
        {"purged": n, "idle_rate_buckets": buckets, "expired_slots": slots},
        f"purged {n} record(s) older than {args.older_than}, "
        f"{buckets} full rate bucket(s) and {slots} expired concurrency slot(s)",
    )
    return 0


# ---------------------------------------------------------------------------------------------------- dlq
def cmd_dlq_list(args: argparse.Namespace) -> int:
    from taskq.consumer.dlq import DeadLetters

    since = parse_duration(args.since) if args.since else None
    with DeadLetters(_settings(args)) as dlq:
        records = dlq.list(task_type=args.type, since=since, limit=args.limit, include_replayed=args.all)
    if args.json:
        for r in records:  # one JSON object per record per line
            print(json.dumps(r.to_dict(), default=str), flush=True)
        return 0
    rows = [("OFFSET", "FAILED AT", "TASK TYPE", "IDEMPOTENCY KEY", "ATTEMPTS", "REASON")]
    for r in records:
        reason = r.reason if len(r.reason) <= 60 else r.reason[:59] + "…"
        if r.replayed_at is not None:
            reason = f"[replayed] {reason}"
        rows.append(
            (
                str(r.offset),
                r.failed_at.isoformat(timespec="seconds"),
                r.task_type or "-",
                r.idempotency_key or "-",
                str(r.attempts),
                reason,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1])
    print(f"{len(records)} DLQ record(s)" + ("" if args.all else " not yet replayed"))
    return 0


def cmd_dlq_show(args: argparse.Namespace) -> int:
    from taskq.consumer.dlq import DeadLetters

    settings = _settings(args)
    with DeadLetters(settings) as dlq:
        data = dlq.show(args.offset).redacted([*settings.dlq_redact, *args.redact]).to_dict(full=True)
    lines = [f"DLQ record {data['offset']}"]
    fields = "task_type task_id idempotency_key priority attempts failed_at worker reason error_type original"
    for name in [*fields.split(), "replayed_at", "envelope_error"]:
        lines.append(f"  {name}: {data[name]}")
    if data["payload_error"] is None:
        lines.append("payload:\n" + json.dumps(data["payload"], indent=2, default=str))
    else:
        lines.append(f"payload: cannot decode: {data['payload_error']}")
        lines.append(f"  value (hex prefix): {data['value_hex']}")
    lines.append("headers:")
    lines += [f"  {k}: {v}" for k, v in data["headers"].items()]
    if data["traceback"]:
        lines.append("traceback:\n" + data["traceback"])
    _print(args, data, "\n".join(lines))
    return 0


def cmd_dlq_replay(args: argparse.Namespace) -> int:
    from taskq.consumer.dlq import DeadLetters

    if args.all == bool(args.offsets):
        raise ConfigurationError("taskq dlq replay: give DLQ offsets or --all, not both")
    with DeadLetters(_settings(args)) as dlq:
        results = dlq.replay(args.offsets, all=args.all, task_type=args.type, force=args.force)
    lines = []
    for r in results:
        if r.refused:
            lines.append(f"refused   {r.offset}  {r.idempotency_key or '-'}: {r.refused}")
        else:
            note = "  (already completed: the worker will skip it)" if r.already_completed else ""
            lines.append(f"replayed  {r.offset}  {r.idempotency_key}  -> {r.topic}{note}")
    if args.json:
        for r in results:
            print(json.dumps(r.to_dict()), flush=True)
    else:
        print("\n".join(lines) or "nothing to replay", flush=True)
    return 1 if any(r.refused for r in results) else 0


# -------------------------------------------------------------------------------------------------- stats
def cmd_stats(args: argparse.Namespace) -> int:
    from taskq._core.db import Database
    from taskq._core.envelope import Topics
    from taskq._core.kafka import Admin
    from taskq._core.store import Store
    from taskq.consumer.dlq import DeadLetters
    from taskq.consumer.store import IdempotencyStore
    from taskq.producer.backpressure import tier_depths

    s = _settings(args)
    if args.metrics_port is not None:
        progress = _progress(args, "taskq stats", "taskq.stats")
        return _serve_stats(s, args.metrics_port, args.interval, args.metrics_host, progress)
    tiers = tier_depths(Admin(s), Topics(s.namespace, s.delay_tiers), s.worker_group)
    with DeadLetters(s) as dlq:
        dlq_depth = dlq.depth()
    store = IdempotencyStore(
        Database(s.database_url, schema=s.database_schema), owner="taskq-cli", namespace=s.namespace
    )
    try:
        counts = store.counts()
        retried_tasks, retries = store.retries()
        outbox_rows, outbox_oldest = Store(store.database).outbox_backlog(s.namespace)
    finally:
        store.close()
    data = {
        "tiers": tiers,
        "group": s.worker_group,
        "dlq_depth": dlq_depth,
        "idempotency": counts,
        "retries": retries,
        "retried_tasks": retried_tasks,
        "outbox": {"waiting": outbox_rows, "oldest_seconds": round(outbox_oldest, 3)},
    }
    # Tier depths are offsets, not records: each of the forwarder's transactions leaves a commit marker
    # in the tiers it wrote to. Counting records would mean reading every tier, so they are estimates.
    lines = [f"tier depth, estimated (offsets not yet committed by {s.worker_group}, markers included):"]
    lines += [f"  {p:<9} {n}" for p, n in tiers.items()]
    lines.append(f"DLQ depth (not replayed): {dlq_depth}")
    by_state = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    lines.append(f"idempotency records: {by_state or 'none'}")
    lines.append(f"retries: {retries} attempt(s) beyond the first, over {retried_tasks} task(s)")
    lines.append(f"outbox: {outbox_rows} task(s) waiting for the relay, the oldest for {outbox_oldest:.1f}s")
    _print(args, data, "\n".join(lines))
    return 0


# ----------------------------------------------------------------------------------------- pause, console
def cmd_pause(args: argparse.Namespace) -> int:
    """Pause or resume a tier or a task type (workers honour it within seconds); with neither, list."""
    from taskq._core.db import Database
    from taskq._core.store import Store, pause_target

    s = _settings(args)
    database = Database(s.database_url, schema=s.database_schema)
    try:
        database.migrate(namespace=s.namespace)
        store = Store(database)
        if args.tier or args.task_type:
            kind, name = pause_target(*(("tier", args.tier) if args.tier else ("task_type", args.task_type)))
            if args.command == "pause":
                changed = store.pause(s.namespace, kind, name)
                text = f"paused {kind} {name}" if changed else f"{kind} {name} was paused already"
            else:
                changed = store.resume(s.namespace, kind, name)
                text = f"resumed {kind} {name}" if changed else f"{kind} {name} was not paused"
            _print(args, {"kind": kind, "name": name, "changed": changed}, text)
            return 0
        rows = [
            {"kind": kind, "name": name, "paused_at": at.isoformat()}
            for kind, name, at in store.pauses(s.namespace)
        ]
    finally:
        database.close()
    text = "\n".join(f"{r['kind']:<10} {r['name']:<40} since {r['paused_at']}" for r in rows)
    _print(args, rows, text or "nothing paused")
    return 0


def cmd_console(args: argparse.Namespace) -> int:
    """Serve the web console until SIGINT/SIGTERM."""
    from taskq.console import serve

    hours = args.session_hours
    if not 0 < hours <= 24 * 365:  # also refuses nan
        raise ConfigurationError(f"--session-hours must be in (0, 8760], got {hours:g}")
    token = os.environ.get("TASKQ_CONSOLE_TOKEN", "")
    serve(_settings(args), host=args.host, port=args.port, token=token, session_hours=hours)
    return 0


@functools.cache
def _tier_depth_gauge() -> Any:
    # Created on first use, not at import: only `taskq stats --metrics-port` exports it.
    from prometheus_client import Gauge

    return Gauge(
        "taskq_tier_depth",
        "Estimated tasks of a tier the worker group has not committed (offsets: transaction markers count)",
        ["priority"],
    )


def _serve_stats(s: Settings, port: int, interval: float, host: str, progress: Callable[[str], None]) -> int:
    """Serve tier and DLQ depths on /metrics, refreshed every `interval` seconds, until SIGTERM/SIGINT."""
    import signal
    import threading

    from taskq._core.envelope import Topics
    from taskq._core.kafka import Admin
    from taskq.consumer.dlq import DeadLetters
    from taskq.consumer.metrics import serve
    from taskq.producer.backpressure import tier_depths

    if interval <= 0:
        raise ConfigurationError(f"--interval must be > 0 seconds, got {interval}")
    log = logging.getLogger("taskq.stats")
    gauge = _tier_depth_gauge()
    admin, topics = Admin(s), Topics(s.namespace, s.delay_tiers)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    with DeadLetters(s) as dlq:
        last_ok = time.monotonic()

        def refresh() -> None:
            nonlocal last_ok
            for tier, n in tier_depths(admin, topics, s.worker_group).items():
                gauge.labels(tier).set(n)
            dlq.depth()  # sets taskq_dlq_depth
            last_ok = time.monotonic()

        refresh()  # a wrong namespace or an unreachable broker fails here, before anything is served
        # Unhealthy once several refreshes in a row failed: the gauges are stale.
        server = serve(port, lambda: time.monotonic() - last_ok < max(3 * interval, 30.0), host=host)
        progress(f"serving /metrics on port {port}, refreshed every {interval:g}s")
        try:
            while not stop.wait(interval):
                try:
                    refresh()
                except TaskqError as exc:  # keep the last values; the next refresh may succeed
                    log.warning("cannot refresh depths: %s", exc)
        finally:
            server.shutdown()
            server.server_close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every taskq command."""
    p = argparse.ArgumentParser(prog="taskq", description="A distributed task queue on Kafka.")
    p.add_argument("--namespace", help="topic prefix (default: TASKQ_NAMESPACE or 'taskq')")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    log_format: dict[str, Any] = {
        "choices": LOG_FORMATS,
        "help": "log lines as text, or as one JSON object each (default: TASKQ_LOG_FORMAT or text)",
    }
    p.add_argument("--log-format", **log_format)
    sub = p.add_subparsers(dest="command", required=True)

    def leaf(
        parent: Any, name: str, fn: Any, help: str, *, json_flag: bool = True
    ) -> argparse.ArgumentParser:
        sp: argparse.ArgumentParser = parent.add_parser(name, help=help, description=help)
        if json_flag:
            sp.add_argument("--json", action="store_true", help="print JSON")
        sp.set_defaults(fn=fn)
        return sp

    topics = sub.add_parser("topics", help="provision topics").add_subparsers(dest="sub", required=True)
    sp = leaf(
        topics, "create", cmd_topics_create, "create the priority, delay-tier and DLQ topics (idempotent)"
    )
    sp.add_argument("--partitions", type=int, default=6)
    sp.add_argument(
        "--replication",
        type=int,
        default=None,
        help="copies of each partition (default: the broker's default.replication.factor, with its "
        "min.insync.replicas; given: min.insync.replicas is 2, or 1 below 3 copies)",
    )

    schemas = sub.add_parser("schemas", help="task type schemas").add_subparsers(dest="sub", required=True)
    sp = leaf(schemas, "register", cmd_schemas_register, "register .avsc files under their record names")
    sp.add_argument("paths", nargs="+", type=Path)
    leaf(schemas, "list", cmd_schemas_list, "list registered task types")
    sp = leaf(
        schemas, "check", cmd_schemas_check, "check .avsc files against the registry (exit 1 if incompatible)"
    )
    sp.add_argument("paths", nargs="+", type=Path)

    sp = leaf(
        sub,
        "enqueue",
        cmd_enqueue,
        "enqueue one task and wait for the broker's acknowledgement",
        json_flag=False,
    )
    sp.add_argument("task_type")
    sp.add_argument(
        "--json", dest="json_payload", required=True, metavar="PAYLOAD", help="the payload as JSON"
    )
    sp.add_argument("--output-json", dest="json", action="store_true", help="print the receipt as JSON")
    sp.add_argument("--priority", default="normal", choices=PRIORITIES)
    sp.add_argument("--key")
    sp.add_argument("--idempotency-key")
    sp.add_argument("--delay", help="e.g. 30s, 5m")
    sp.add_argument("--max-attempts", type=int)
    sp.add_argument("--timeout", type=float)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="sub", required=True)
    sp = leaf(bench, "produce", cmd_bench_produce, "enqueue N tasks as fast as the API allows")
    sp.add_argument("-n", "--count", type=int, default=50_000)
    sp.add_argument("--body-bytes", type=int, default=100)
    sp.add_argument(
        "--batch", type=int, default=1, help="tasks per call: 1 calls enqueue, more call enqueue_many"
    )
    sp = leaf(
        bench,
        "worker",
        cmd_bench_worker,
        "time a worker running N tasks, in a namespace created for the run and deleted after it",
    )
    sp.add_argument("-n", "--count", type=int, default=5000)
    sp.add_argument("--concurrency", type=int, default=4)
    sp.add_argument("--processes", type=int, default=1, help="worker processes in the group (spawned)")
    sp.add_argument(
        "--handler",
        choices=("noop", "transactional"),
        default="noop",
        help="noop: do nothing; transactional: write one row in the completion's transaction",
    )
    sp.add_argument("--partitions", type=int, default=6, help="partitions per topic")
    sp.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for every completion")
    sp.add_argument("--profile", metavar="PATH", help="write a cProfile of the worker loop's thread to PATH")
    sp = leaf(
        bench,
        "ceiling",
        cmd_bench_ceiling,
        "what Kafka and Postgres allow without the framework: consume, claim, complete, commit; produce",
    )
    sp.add_argument("-n", "--count", type=int, default=20_000)
    sp.add_argument("--partitions", type=int, default=6, help="partitions per topic")
    sp.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for each pass")
    sp.add_argument(
        "--with-worker", action="store_true", help="also run `bench worker` on N tasks, as a fraction of it"
    )
    sp.add_argument("--concurrency", type=int, default=4, help="with --with-worker: the worker's slots")
    sp.add_argument("--processes", type=int, default=1, help="with --with-worker: worker processes")
    sp = leaf(
        bench,
        "latency",
        cmd_bench_latency,
        "enqueue at a fixed rate to a running worker; enqueue-to-start and -completion percentiles",
    )
    sp.add_argument("--rate", type=float, required=True, help="tasks per second, on a fixed schedule")
    sp.add_argument("--duration", type=float, default=10.0, help="seconds of sending (default 10)")
    sp.add_argument("--concurrency", type=int, default=4)
    sp.add_argument(
        "--processes", type=int, default=1, help="worker processes, apart from the sender's (default 1)"
    )
    sp.add_argument("--partitions", type=int, default=6, help="partitions per topic")
    sp.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for assignment, then tasks")
    sp.add_argument(
        "--bare",
        action="store_true",
        help="run the framework-free loop of `bench ceiling` (consume, claim, complete, commit) instead of "
        "workers: the floor of these latencies on this machine",
    )

    sp = leaf(
        sub,
        "chaos",
        cmd_chaos,
        "run a ledger workload in a namespace of its own while killing workers (and, if told how, "
        "restarting Kafka and Postgres); check every effect happened once (exit 1 if not)",
    )
    sp.add_argument("--duration", type=float, default=60.0, help="seconds of enqueueing (default 60)")
    sp.add_argument("--workers", type=int, default=3, help="`taskq worker` processes (default 3)")
    sp.add_argument("--concurrency", type=int, default=4, help="slots of each worker (default 4)")
    sp.add_argument("--rate", type=float, default=20.0, help="tasks enqueued per second (default 20)")
    sp.add_argument("--seed", type=int, help="seed of the task mix and the chaos (default: random)")
    sp.add_argument(
        "--kill-every",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="mean seconds between two kill -9 of a random worker, each restarted after 0.5-3 s (0: none)",
    )
    sp.add_argument(
        "--restart-kafka-cmd",
        metavar="COMMAND",
        help="shell command restarting the broker(s), run at random times; local stacks only, e.g. "
        "'compose/stack restart kafka'",
    )
    sp.add_argument(
        "--restart-postgres-cmd",
        metavar="COMMAND",
        help="shell command restarting Postgres, likewise, e.g. 'compose/stack restart postgres'",
    )
    sp.add_argument(
        "--service-restarts", type=int, default=1, help="runs of each restart command per run (default 1)"
    )
    sp.add_argument("--partitions", type=int, default=3, help="partitions per topic (default 3)")
    sp.add_argument(
        "--drain-timeout", type=float, default=180.0, help="seconds to wait for every task to finish"
    )
    sp.add_argument(
        "--keep", action="store_true", help="keep the run's topics, Postgres schema and worker logs"
    )

    db = sub.add_parser("db", help="the Postgres store").add_subparsers(dest="sub", required=True)
    leaf(db, "migrate", cmd_db_migrate, "apply pending migrations")
    sp = leaf(db, "purge", cmd_db_purge, "delete completed and dead idempotency records older than the TTL")
    sp.add_argument("--older-than", default="7d", help="TTL, e.g. 7d (default), 12h")

    sp = leaf(sub, "worker", cmd_worker, "run tasks with the handlers at MODULE:ATTR", json_flag=False)
    sp.add_argument("handlers", metavar="MODULE:ATTR")
    sp.add_argument("--concurrency", type=int, default=4)
    sp.add_argument("--group", help="consumer group (default: <namespace>.workers)")
    sp.add_argument("--weights", help="critical,high,normal,low weights (default 8,4,2,1)")
    sp.add_argument("--metrics-port", type=int, help="serve /metrics and /healthz on this port")
    sp.add_argument(
        "--metrics-host", default="127.0.0.1", help="address /metrics listens on (default: loopback)"
    )
    sp.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to finish in-flight tasks")
    sp.add_argument("--buffer", type=int, default=500, help="max fetched tasks waiting for a slot")
    sp.add_argument("--buffer-mb", type=int, default=64, help="max megabytes of them (values and headers)")
    sp.add_argument(
        "--stale-after",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a worker whose heartbeat (every 3 s) is older than this is presumed dead, and the keys it "
        "leased are taken over at once (default 10)",
    )
    sp.add_argument(
        "--no-forwarder", action="store_true", help="do not run the delay forwarder in this process"
    )
    sp.add_argument(
        "--no-relay", action="store_true", help="do not run the outbox relay in this process (taskq relay)"
    )
    sp.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="run N worker processes (each with --concurrency slots) under a supervisor, which forwards "
        "SIGTERM/SIGINT to them, runs the delay forwarder and the outbox relay in one of them, serves one "
        "/metrics summing them all, and restarts one that dies after 1 s, doubling up to 30 s (back to 1 s "
        "once it ran 60 s); it stops them and exits 2 when one died 5 times within 60 s "
        "(default: 1, no supervisor)",
    )

    periodic = sub.add_parser("periodic", help="periodic tasks").add_subparsers(dest="sub", required=True)
    sp = leaf(periodic, "list", cmd_periodic_list, "each periodic task's schedule, last and next slot")
    sp.add_argument(
        "handlers", nargs="?", metavar="MODULE:ATTR", help="also list tasks no scheduler has run yet"
    )
    sp = leaf(
        sub,
        "relay",
        cmd_relay,
        "publish tasks staged in the outbox by enqueue(..., conn=) (also runs inside workers)",
        json_flag=False,
    )
    sp.add_argument("--batch", type=int, default=500, help="rows published per transaction (default 500)")
    leaf(
        sub,
        "forwarder",
        cmd_forwarder,
        "release due tasks from the delay tiers (also runs inside workers)",
        json_flag=False,
    )
    dlq = sub.add_parser("dlq", help="inspect and replay the DLQ").add_subparsers(dest="sub", required=True)
    sp = leaf(dlq, "list", cmd_dlq_list, "list DLQ records not yet replayed, oldest first")
    sp.add_argument("--type", help="only this task type")
    sp.add_argument("--since", help="only records that failed within this duration, e.g. 1h")
    sp.add_argument("--limit", type=int, help="at most N records")
    sp.add_argument("--all", action="store_true", help="include replayed records")
    sp = leaf(dlq, "show", cmd_dlq_show, "one DLQ record: decoded payload, every header, traceback")
    sp.add_argument("offset", type=int)
    sp.add_argument(
        "--redact",
        action="append",
        default=[],
        metavar="FIELD/HEADER",
        help="also hide this header or payload field (a dotted path or its end; * matches anything): it "
        "shows as *** (repeatable; TASKQ_DLQ_REDACT names the ones always hidden, by default authorization, "
        "cookie, *password*, *secret*, *token* and the like)",
    )
    replay_help = "re-enqueue DLQ records with their original task id and key (exit 1 if any is refused)"
    sp = leaf(dlq, "replay", cmd_dlq_replay, replay_help)
    sp.add_argument("offsets", nargs="*", type=int, metavar="OFFSET")
    sp.add_argument("--all", action="store_true", help="every record not yet replayed")
    sp.add_argument("--type", help="with --all: only this task type")
    sp.add_argument("--force", action="store_true", help="replay records that were replayed before")

    for name, verb in (("pause", "stop starting"), ("resume", "start again")):
        sp = leaf(
            sub,
            name,
            cmd_pause,
            f"{name} a tier or a task type: workers {verb} its tasks within seconds (no option: list "
            "what is paused)",
        )
        what = sp.add_mutually_exclusive_group()
        what.add_argument("--tier", choices=PRIORITIES, help="a priority tier (its partitions are paused)")
        what.add_argument(
            "--task-type", metavar="TYPE", help="a task type (its tasks wait in the workers' buffers)"
        )
    sp = leaf(
        sub,
        "console",
        cmd_console,
        "serve the web console: overview, task lookup, DLQ explorer, pause and resume",
        json_flag=False,
    )
    sp.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: loopback; any other needs TASKQ_CONSOLE_TOKEN)",
    )
    sp.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    sp.add_argument(
        "--session-hours",
        type=float,
        default=12.0,
        help="how long a login with TASKQ_CONSOLE_TOKEN lasts (default 12)",
    )

    sp = leaf(sub, "stats", cmd_stats, "tier depths, DLQ depth and idempotency records by state")
    sp.add_argument(
        "--metrics-port",
        type=int,
        help="instead of printing once, serve taskq_tier_depth and taskq_dlq_depth on /metrics until SIGTERM",
    )
    sp.add_argument(
        "--interval", type=float, default=5.0, help="with --metrics-port: seconds between refreshes"
    )
    sp.add_argument(
        "--metrics-host", default="127.0.0.1", help="address /metrics listens on (default: loopback)"
    )
    for name in _LOGGING:
        if name in sub.choices:
            # SUPPRESS: given before the command's name, the value stays unless given again after it.
            sub.choices[name].add_argument("--log-format", default=argparse.SUPPRESS, **log_format)
    return p


class _RefusalEcho(logging.Filter):
    """Drops librdkafka's log lines about a refused connection: the client raises it as one error."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "SASL authentication error" not in message and "SSL handshake failed" not in message


class _JsonLines(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, pid, and the fields the line's `extra` adds
    (a task's lines carry task_id, idempotency_key, task_type, tier and attempt)."""

    #: A LogRecord's own attributes; any other attribute of a record came from `extra`.
    _OWN = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON."""
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        for name, value in record.__dict__.items():
            if name not in self._OWN and name not in line and not name.startswith("_"):
                line[name] = value
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str)


def _configure_logging(verbose: bool, command: str, *, pids: bool = False, log_format: str = "text") -> None:
    """Log to stderr: INFO for the long-running commands or with -v, else WARNING; `pids` puts the process
    id in each line (the supervisor and the worker processes of `--processes N` share one stderr);
    `log_format` json writes each line as a JSON object."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(_JsonLines())
    else:
        process = "[%(process)d]" if pids else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s %(name)s{process}: %(message)s"))
    logging.basicConfig(
        level=logging.INFO if verbose or command in _LONG_RUNNING else logging.WARNING, handlers=[handler]
    )
    for noisy in ("httpx", "httpx2", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Refused credentials end the command with one line (taskq: error: ...), not a line per retry.
    librdkafka = logging.getLogger("taskq.librdkafka")
    if not any(isinstance(f, _RefusalEcho) for f in librdkafka.filters):  # once, however often main runs
        librdkafka.addFilter(_RefusalEcho())
    if not verbose and command not in _LONG_RUNNING:
        # A short-lived command reports what failed in one line; librdkafka's retries and the producer's
        # per-task delivery log would only repeat it.
        for repeats in ("taskq.librdkafka", "taskq.producer"):
            logging.getLogger(repeats).setLevel(logging.CRITICAL)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `taskq` console script."""
    args = build_parser().parse_args(argv)
    # The flag wins over the environment; read here, where the command line is.
    args.log_format = args.log_format or os.environ.get("TASKQ_LOG_FORMAT") or "text"
    if args.log_format not in LOG_FORMATS:
        print(
            f"taskq: error: TASKQ_LOG_FORMAT must be text or json, not {args.log_format!r}",
            file=sys.stderr,
        )
        return 2
    _configure_logging(
        args.verbose, args.command, pids=getattr(args, "processes", 1) > 1, log_format=args.log_format
    )
    try:
        return int(args.fn(args))
    except (TaskqError, SchemaError) as exc:
        # The project's own errors are the user's to fix: one line. Anything else is a bug: its traceback.
        # Some carry a library's multi-line explanation (libpq's "Is the server running ...?"): joined.
        said = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"taskq: error: {said}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
