"""`taskq worker`, `taskq relay` and `taskq forwarder`: the commands that run until stopped."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys

from taskq._core.envelope import PRIORITIES
from taskq._core.errors import ConfigurationError
from taskq.cli.common import Commands, add_claim_linger, leaf, port, settings_of
from taskq.cli.logs import configure_logging


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
        share_group=args.share_group,
        claim_linger=args.claim_linger_ms / 1000,
    )
    if args.processes > 1:
        from taskq.consumer.supervisor import Supervisor

        supervisor = Supervisor(
            args.handlers,
            settings_of(args),
            config,
            processes=args.processes,
            setup=functools.partial(
                configure_logging, args.verbose, args.command, pids=True, log_format=args.log_format
            ),
        )
        return supervisor.run()
    worker = Worker(handlers, settings_of(args), config)
    worker.install_signal_handlers()
    log = logging.getLogger("taskq.worker")
    log.info("worker %s: %d handler(s), group %s", worker.worker_id, len(handlers), worker.group)
    worker.run()
    log.info("worker %s: stopped", worker.worker_id)
    return 0  # and the process ends at once (cli.run): no client thread or finalizer holds up its exit


def cmd_relay(args: argparse.Namespace) -> int:
    """Publish the outbox (tasks staged with enqueue(..., conn=)) until SIGTERM/SIGINT."""
    import signal

    from taskq._core.db import Database
    from taskq.producer.outbox import OutboxRelay

    relay = OutboxRelay(settings_of(args), batch=args.batch)
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

    forwarder = Forwarder(settings_of(args))
    signal.signal(signal.SIGTERM, lambda signum, frame: forwarder.stop())
    signal.signal(signal.SIGINT, lambda signum, frame: forwarder.stop())
    logging.getLogger("taskq.forwarder").info(
        "forwarder %s: delay tiers of %s", forwarder.instance_id, forwarder.topics.namespace
    )
    forwarder.run()
    return 0


def add_worker(sub: Commands) -> None:
    """`taskq worker`."""
    sp = leaf(sub, "worker", cmd_worker, "run tasks with the handlers at MODULE:ATTR", json_flag=False)
    sp.add_argument("handlers", metavar="MODULE:ATTR")
    sp.add_argument("--concurrency", type=int, default=4)
    sp.add_argument("--group", help="consumer group (default: <namespace>.workers)")
    sp.add_argument("--weights", help="critical,high,normal,low weights (default 8,4,2,1)")
    sp.add_argument("--metrics-port", type=port, help="serve /metrics and /healthz on this port")
    sp.add_argument(
        "--metrics-host", default="127.0.0.1", help="address /metrics listens on (default: loopback)"
    )
    sp.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to finish in-flight tasks")
    sp.add_argument("--buffer", type=int, default=2000, help="max fetched tasks waiting for a slot")
    sp.add_argument("--buffer-mb", type=int, default=64, help="max megabytes of them (values and headers)")
    add_claim_linger(sp)
    sp.add_argument(
        "--stale-after",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a worker whose heartbeat (every 3 s) is older than this is presumed dead, and the keys it "
        "leased are taken over at once (default 10)",
    )
    sp.add_argument(
        "--share-group",
        action="store_true",
        help="experimental: read the tiers through share groups (KIP-932, Kafka 4.2+), one per tier, so "
        "any number of workers share any number of partitions and a slow task holds back no other; "
        "ordered task types are refused",
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


def add_relay(sub: Commands) -> None:
    """`taskq relay`."""
    sp = leaf(
        sub,
        "relay",
        cmd_relay,
        "publish tasks staged in the outbox by enqueue(..., conn=) (also runs inside workers)",
        json_flag=False,
    )
    sp.add_argument("--batch", type=int, default=500, help="rows published per transaction (default 500)")


def add_forwarder(sub: Commands) -> None:
    """`taskq forwarder`."""
    leaf(
        sub,
        "forwarder",
        cmd_forwarder,
        "release due tasks from the delay tiers (also runs inside workers)",
        json_flag=False,
    )
