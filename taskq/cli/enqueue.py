"""`taskq enqueue`: one task from the command line."""

from __future__ import annotations

import argparse
import json

from taskq._core.durations import parse_duration
from taskq._core.envelope import PRIORITIES
from taskq._core.errors import ConfigurationError
from taskq.cli.common import Commands, leaf, print_result, settings_of


def cmd_enqueue(args: argparse.Namespace) -> int:
    from taskq.producer.producer import TaskProducer

    try:
        payload = json.loads(args.json_payload)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"--json is not valid JSON: {exc}") from None
    # Fail fast: a command that cannot reach the broker says so in about 10 s, not after librdkafka's
    # two-minute delivery timeout.
    quick = {"message.timeout.ms": 10_000, "socket.connection.setup.timeout.ms": 5_000}
    with TaskProducer(settings_of(args), kafka_config=quick) as producer:
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
    print_result(args, data, f"{receipt.task_id}  {receipt.topic}")
    return 0



def add_enqueue(sub: Commands) -> None:
    """`taskq enqueue`."""
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
