"""`taskq stats`, `taskq pause`, `taskq resume`, `taskq status`, `taskq cancel` and `taskq console`:
watching and steering a running namespace."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from taskq._core.envelope import PRIORITIES
from taskq._core.errors import ConfigurationError, TaskqError
from taskq._core.settings import Settings
from taskq.cli.common import Commands, leaf, port, print_result, progress_to, settings_of

if TYPE_CHECKING:
    from taskq.producer.status import TaskStatus


def cmd_stats(args: argparse.Namespace) -> int:
    from taskq._core.db import Database
    from taskq._core.envelope import Topics
    from taskq._core.kafka_admin import Admin
    from taskq._core.store import Store
    from taskq.consumer.dlq import DeadLetters
    from taskq.consumer.store import IdempotencyStore
    from taskq.producer.backpressure import tier_depths

    s = settings_of(args)
    if args.metrics_port is not None:
        progress = progress_to(args, "taskq stats", "taskq.stats")
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
    print_result(args, data, "\n".join(lines))
    return 0



@functools.cache
def tier_depth_gauge() -> Any:
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
    from taskq._core.kafka_admin import Admin
    from taskq.consumer.dlq import DeadLetters
    from taskq.consumer.metrics import serve
    from taskq.producer.backpressure import tier_depths

    if interval <= 0:
        raise ConfigurationError(f"--interval must be > 0 seconds, got {interval}")
    log = logging.getLogger("taskq.stats")
    gauge = tier_depth_gauge()
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


def cmd_pause(args: argparse.Namespace) -> int:
    """Pause or resume a tier or a task type (workers honour it within seconds); with neither, list."""
    from taskq._core.db import Database
    from taskq._core.store import Store, pause_target

    s = settings_of(args)
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
            print_result(args, {"kind": kind, "name": name, "changed": changed}, text)
            return 0
        rows = [
            {"kind": kind, "name": name, "paused_at": at.isoformat()}
            for kind, name, at in store.pauses(s.namespace)
        ]
    finally:
        database.close()
    text = "\n".join(f"{r['kind']:<10} {r['name']:<40} since {r['paused_at']}" for r in rows)
    print_result(args, rows, text or "nothing paused")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Print what became of a task: its state, attempts, last error, result and times."""
    from taskq._core.db import Database
    from taskq._core.envelope import Topics
    from taskq.producer.status import PostgresTaskRecords, lookup, status_of

    s = settings_of(args)
    records = PostgresTaskRecords(Database(s.database_url, schema=s.database_schema), s.namespace)
    try:
        records.database.migrate(namespace=s.namespace)
        name, row = lookup(records, args.task_id, args.idempotency_key)
    finally:
        records.close()
    status = status_of(row, task_id=name, dlq_topic=Topics(s.namespace, s.delay_tiers).dlq)
    print_result(args, status.as_dict(), status_text(status))
    return 0


def status_text(status: TaskStatus) -> str:
    """A TaskStatus as `taskq status` prints it: one field a line, the empty ones left out."""
    where = f"{status.dlq_topic}[{status.dlq_partition}]@{status.dlq_offset}"
    dlq = None if status.dlq_offset is None else where
    takeovers = f", {status.takeovers} takeover(s)" if status.takeovers else ""
    lines = [
        ("task", status.task_id),
        ("state", status.state + (" (cancel requested)" if status.cancel_requested else "")),
        ("key", status.idempotency_key),
        ("type", status.task_type),
        ("attempts", f"{status.attempts}{takeovers}"),
        ("error", status.last_error),
        ("result", None if status.state != "completed" else json.dumps(status.result)),
        ("dlq", dlq),
        ("created", status.created_at and status.created_at.isoformat()),
        ("updated", status.updated_at and status.updated_at.isoformat()),
        ("finished", status.completed_at and status.completed_at.isoformat()),
    ]
    if status.state == "unknown":
        lines.append(("", "no record: not claimed by a worker yet, or purged"))
    return "\n".join(f"{k:<9} {v}" for k, v in lines if v not in (None, ""))


def cmd_cancel(args: argparse.Namespace) -> int:
    """Cancel a task: one not started never starts; a running one sees ctx.cancelled."""
    from taskq._core.db import Database
    from taskq.producer.status import PostgresTaskRecords, cancel

    s = settings_of(args)
    if args.task_id is None and args.idempotency_key is None:
        raise ConfigurationError("give a task id or --idempotency-key")
    records = PostgresTaskRecords(Database(s.database_url, schema=s.database_schema), s.namespace)
    try:
        records.database.migrate(namespace=s.namespace)
        started = cancel(records, args.task_id, args.idempotency_key)
    finally:
        records.close()
    name = args.task_id or args.idempotency_key
    text = (
        f"asked {name} to stop: it had started (a running handler sees ctx.cancelled)"
        if started
        else f"cancelled {name}: it will not start"
    )
    print_result(args, {"task": name, "cancelled": True, "started": started}, text)
    return 0


def cmd_console(args: argparse.Namespace) -> int:
    """Serve the web console until SIGINT/SIGTERM."""
    from taskq.console import serve

    hours = args.session_hours
    if not 0 < hours <= 24 * 365:  # also refuses nan
        raise ConfigurationError(f"--session-hours must be in (0, 8760], got {hours:g}")
    token = os.environ.get("TASKQ_CONSOLE_TOKEN", "")
    serve(settings_of(args), host=args.host, port=args.port, token=token, session_hours=hours)
    return 0


def add_pause(sub: Commands) -> None:
    """`taskq pause` and `taskq resume`."""
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


def add_status(sub: Commands) -> None:
    """`taskq status` and `taskq cancel`."""
    sp = leaf(sub, "status", cmd_status, "what became of a task: state, attempts, last error, result")
    sp.add_argument("task_id", metavar="TASK_ID", nargs="?", help="the task's id (a scan of the records)")
    sp.add_argument(
        "--idempotency-key", metavar="K", help="find it by its idempotency key instead (one lookup)"
    )
    sp = leaf(
        sub,
        "cancel",
        cmd_cancel,
        "cancel a task: not started, it never starts; running, its handler sees ctx.cancelled",
    )
    sp.add_argument("task_id", metavar="TASK_ID", nargs="?", help="the task's id (once a worker claimed it)")
    sp.add_argument(
        "--idempotency-key", metavar="K", help="the task's idempotency key (works before any claim)"
    )


def add_console(sub: Commands) -> None:
    """`taskq console`."""
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
    sp.add_argument("--port", type=port, default=8080, help="port to listen on (default 8080)")
    sp.add_argument(
        "--session-hours",
        type=float,
        default=12.0,
        help="how long a login with TASKQ_CONSOLE_TOKEN lasts (default 12)",
    )


def add_stats(sub: Commands) -> None:
    """`taskq stats`."""
    sp = leaf(sub, "stats", cmd_stats, "tier depths, DLQ depth and idempotency records by state")
    sp.add_argument(
        "--metrics-port",
        type=port,
        help="instead of printing once, serve taskq_tier_depth and taskq_dlq_depth on /metrics until SIGTERM",
    )
    sp.add_argument(
        "--interval", type=float, default=5.0, help="with --metrics-port: seconds between refreshes"
    )
    sp.add_argument(
        "--metrics-host", default="127.0.0.1", help="address /metrics listens on (default: loopback)"
    )
