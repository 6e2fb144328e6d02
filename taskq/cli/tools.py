"""`taskq bench` and `taskq chaos`: the measuring and torture tools of `taskq.tools`, from the command
line."""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from taskq._core.envelope import PRIORITIES
from taskq._core.errors import ConfigurationError
from taskq.cli.common import Commands, add_claim_linger, leaf, print_result, progress_to, settings_of


def cmd_bench_produce(args: argparse.Namespace) -> int:
    from taskq.demo import schema as demo_schema
    from taskq.producer.admin import create_topics
    from taskq.producer.producer import TaskProducer
    from taskq.schemas import Registry

    if args.count < 1:
        raise ConfigurationError(f"count must be >= 1, got {args.count}")  # as the other benches say it
    if args.batch < 1:
        raise ConfigurationError(f"--batch must be >= 1, got {args.batch}")
    if args.body_bytes < 0:
        raise ConfigurationError(f"--body-bytes must be >= 0, got {args.body_bytes}")
    settings = settings_of(args)
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
        "mean_us": math.fsum(latencies) / len(latencies) * 1e6,
    }
    print_result(
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
        settings_of(args),
        count=args.count,
        concurrency=args.concurrency,
        processes=args.processes,
        handler=args.handler,
        partitions=args.partitions,
        timeout=args.timeout,
        profile=args.profile,
        workflow=args.workflow,
        share_group=args.share_group,
        claim_linger=args.claim_linger_ms / 1000,
    )
    print_result(args, data, _worker_text(data))
    return 0


def _worker_text(data: dict[str, Any]) -> str:
    start, e2e, attempt = (
        data["enqueue_to_start_ms"],
        data["enqueue_to_completion_ms"],
        data["attempt_to_recorded_ms"],
    )
    from taskq.tools.bench.worker import FULL_BATCH

    launch = (
        f"launch to first task {data['launch_to_first_task_s']:.2f} s, "
        f"to {min(data['tasks'], FULL_BATCH)} started {data['launch_to_full_batch_s']:.2f} s; "
        if data["launch_to_first_task_s"] is not None
        else ""
    )
    every = (
        f", every process at {data['all_assigned_s']:.2f} s"
        if data["processes"] > 1 and data["all_assigned_s"] is not None
        else ""
    )
    if data["processes"] > 1:
        every += "; by process: " + ", ".join(
            f"{p['tasks']} tasks"
            + (f" from {p['first_start_s']:.2f} to {p['last_completion_s']:.2f} s" if p["tasks"] else "")
            for p in data["by_process"]
        )
    return (
        f"{data['completed']} tasks ({data['handler']}{', one workflow group' if data['workflow'] else ''}, "
        f"{data['processes']} x concurrency "
        f"{data['concurrency']}): {data['tasks_per_s']:.0f} tasks/s from worker start "
        f"({data['tasks_per_s_after_assignment']:.0f}/s after partition assignment at "
        f"{data['startup_s']:.2f} s{every}, {data['tasks_per_s_from_first_enqueue']:.0f}/s from the first "
        "enqueue); "
        f"{launch}worker CPU {data['worker_cpu_ms_per_task']:.2f} ms/task; "
        f"Postgres WAL {data['wal_bytes_per_task']:.0f} B/task; "
        f"enqueue-to-start p50 {start['p50']:.0f} ms, p99 {start['p99']:.0f} ms, "
        f"enqueue-to-completion p50 {e2e['p50']:.0f} ms, p99 {e2e['p99']:.0f} ms (backlog included); "
        f"attempt start to recorded p50 {attempt['p50']:.1f} ms, p99 {attempt['p99']:.1f} ms"
    )


def cmd_bench_ceiling(args: argparse.Namespace) -> int:
    from taskq.tools.bench import bench_ceiling

    data = bench_ceiling(
        settings_of(args),
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
        f"{data['partitions']} partitions per tier, offsets committed asynchronously every "
        f"{data['commit_interval_s']:g} s:",
        row("consume + commit", data["consume_commit_per_s"]),
        row(
            "consume + claim + complete + commit",
            data["consume_claim_complete_commit_per_s"],
            f"(the design's statements, the ceiling of a worker; {data['completed']} completions recorded; "
            f"{data['claim_complete_fraction_of_lean']:.0%} of the lean reference; "
            f"{data['claim_complete_wal_bytes_per_task']:.0f} B of WAL a task)",
        ),
        row(
            "lean reference: upsert + update",
            data["lean_per_s"],
            f"(one of each a batch, on a narrow table of its own; {data['lean_completed']} completed; "
            f"{data['lean_wal_bytes_per_task']:.0f} B of WAL a task)",
        ),
        row(
            "+ an INSERT per task, in groups",
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
                f"({data['worker_fraction']:.0%} of the design's statements, "
                f"{data['worker_fraction_of_lean']:.0%} of the lean reference; "
                f"{data['worker_wal_bytes_per_task']:.0f} B of WAL a task)",
            )
        )
    print_result(args, data, "\n".join(lines))
    return 0


def cmd_bench_latency(args: argparse.Namespace) -> int:
    from taskq.tools.bench import bench_latency

    data = bench_latency(
        settings_of(args),
        rate=args.rate,
        duration=args.duration,
        concurrency=args.concurrency,
        processes=args.processes,
        partitions=args.partitions,
        timeout=args.timeout,
        bare=args.bare,
        seed_history=args.seed_history,
        window=args.window,
        default_autovacuum=args.default_autovacuum,
        claim_linger=args.claim_linger_ms / 1000,
    )
    print_result(args, data, _latency_text(data))
    return 0


def _latency_text(data: dict[str, Any]) -> str:
    def ms(d: dict[str, float]) -> str:
        return f"p50 {d['p50']:.1f}, p90 {d['p90']:.1f}, p99 {d['p99']:.1f}, max {d['max']:.1f} ms"

    def p99(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    lines = [
        ("framework-free loop (--bare): " if data["bare"] else "")
        + f"{data['completed']} of {data['tasks']} tasks at {data['achieved_rate_per_s']:.0f}/s "
        f"(asked {data['rate']:g}/s; {data['late_sends']} sends late, at most "
        f"{data['max_behind_schedule_ms']:.1f} ms; "
        f"worker CPU {data['worker_cpu_ms_per_task']:.2f} ms/task):",
        f"  enqueue to start       {ms(data['enqueue_to_start_ms'])}",
        f"  enqueue to completion  {ms(data['enqueue_to_completion_ms'])}",
        "  window (s)   enqueued  completed/s  enqueue to start p99 (ms), of all and by tier:",
        f"  {'':36}{'all':>10}" + "".join(f"{tier:>10}" for tier in PRIORITIES),
    ]
    lines += [
        f"  {w['from_s']:>5.0f}-{w['to_s']:<5.0f} {w['enqueued']:>9} {w['completed_per_s']:>12.0f}  "
        f"{p99(w['enqueue_to_start_ms']['p99']):>10}"
        + "".join(f"{p99(w['enqueue_to_start_p99_ms_by_tier'][tier]):>10}" for tier in PRIORITIES)
        for w in data["windows"]
    ]
    ratio = data["last_to_first"]
    if len(data["windows"]) > 1 and None not in ratio.values():
        lines.append(
            f"  last window / first: completed/s x{ratio['completed_per_s']:.3f}, "
            f"enqueue to start p99 x{ratio['enqueue_to_start_p99']:.3f}"
        )
    if data["seed_history"]:
        purge = data["purge"]
        lines.append(
            f"  seeded {data['seed_history']} finished keys in {data['seed_s']:.0f} s; the 7-day purge at "
            f"{purge['started_s']:.0f} s deleted {purge['rows']} in {purge['seconds']:.1f} s"
            + (f" ({purge['error']})" if purge["error"] else "")
        )
    before, after = data["table_before"], data["table_after"]

    def mb(n: int) -> str:
        return f"{n / 2**20:.1f} MB"

    autovacuum = "server defaults" if data["default_autovacuum"] else "migration 0013"
    lines += [
        f"  taskq_tasks ({autovacuum})  before -> after",
        f"    table                 {mb(before['table_bytes'])} -> {mb(after['table_bytes'])}",
        *(
            f"    {name:<21} {mb(size)} -> {mb(after['index_bytes'].get(name, 0))}"
            for name, size in before["index_bytes"].items()
        ),
        f"    live tuples           {before['n_live_tup']} -> {after['n_live_tup']}",
        f"    dead tuples           {before['n_dead_tup']} -> {after['n_dead_tup']} "
        f"(at most {data['max_dead_tuples']} in the samples)",
        f"    autovacuums           {before['autovacuum_count']} -> {after['autovacuum_count']}, "
        f"autoanalyzes {before['autoanalyze_count']} -> {after['autoanalyze_count']}",
    ]
    return "\n".join(lines)


def cmd_chaos(args: argparse.Namespace) -> int:
    from taskq.tools.chaos import run_chaos

    report = run_chaos(
        settings_of(args),
        workers=args.workers,
        duration=args.duration,
        rate=args.rate,
        concurrency=args.concurrency,
        seed=args.seed,
        kill_every=args.kill_every,
        pills=args.pills,
        restart_kafka_cmd=args.restart_kafka_cmd,
        restart_postgres_cmd=args.restart_postgres_cmd,
        service_restarts=args.service_restarts,
        partitions=args.partitions,
        drain_timeout=args.drain_timeout,
        keep=args.keep,
        share_group=args.share_group,
        progress=progress_to(args, "chaos", "taskq.chaos"),
    )
    print_result(args, report.to_dict(), report.text())
    return 0 if report.passed else 1


def add_bench(sub: Commands) -> None:
    """`taskq bench produce|worker|ceiling|latency`."""
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
    add_claim_linger(sp)
    sp.add_argument(
        "--share-group", action="store_true", help="the workers read share groups (experimental, Kafka 4.2+)"
    )
    sp.add_argument(
        "--handler",
        choices=("noop", "plain", "transactional"),
        default="noop",
        help="noop: do nothing; plain: write one row in an autocommitted INSERT of its own (at least once); "
        "transactional: write one row in the completion's transaction (exactly once)",
    )
    sp.add_argument("--partitions", type=int, default=6, help="partitions per topic")
    sp.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for every completion")
    sp.add_argument("--profile", metavar="PATH", help="write a cProfile of the worker loop's thread to PATH")
    sp.add_argument(
        "--workflow",
        choices=("group",),
        help="group: the tasks are one workflow group of members and a callback (its bookkeeping's cost)",
    )
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
        "--with-worker",
        action="store_true",
        help="also run `bench worker` on N tasks, as a fraction of the design's statements and of the lean "
        "reference",
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
    add_claim_linger(sp)
    sp.add_argument("--partitions", type=int, default=6, help="partitions per topic")
    sp.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for assignment, then tasks")
    sp.add_argument(
        "--bare",
        action="store_true",
        help="run the framework-free loop of `bench ceiling` (consume, claim, complete, commit) instead of "
        "workers: the floor of these latencies on this machine (its batches linger as the workers' claims)",
    )
    sp.add_argument(
        "--seed-history",
        type=int,
        default=0,
        metavar="N",
        help="first fill the run's idempotency table with N finished keys over 8 days; the 7-day purge runs "
        "half-way through (a table kept 7 days, just before its daily purge)",
    )
    sp.add_argument(
        "--window", type=float, default=120.0, help="seconds per window of the report (default 120)"
    )
    sp.add_argument(
        "--default-autovacuum",
        action="store_true",
        help="the server's autovacuum settings on the run's table instead of migration 0013's (to compare)",
    )


def add_chaos(sub: Commands) -> None:
    """`taskq chaos`."""
    sp = leaf(
        sub,
        "chaos",
        cmd_chaos,
        "run a ledger workload in a namespace of its own while killing workers (and, if told how, "
        "restarting Kafka and Postgres); check every effect happened once (exit 1 if not)",
    )
    sp.add_argument("--duration", type=float, default=60.0, help="seconds of enqueueing (default 60)")
    sp.add_argument(
        "--share-group", action="store_true", help="run the workers in share mode (experimental, Kafka 4.2+)"
    )
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
        "--pills",
        type=float,
        default=3.0,
        metavar="PER_THOUSAND",
        help="poison pills per thousand tasks, each killing the worker running it (default 3); only they "
        "may be dead-lettered for workers' deaths",
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
