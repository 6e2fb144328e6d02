"""`taskq dlq`: list, show and replay the records of the DLQ."""

from __future__ import annotations

import argparse
import json

from taskq._core.durations import parse_duration
from taskq._core.errors import ConfigurationError
from taskq.cli.common import Commands, leaf, print_result, settings_of


def cmd_dlq_list(args: argparse.Namespace) -> int:
    from taskq.consumer.dlq import DeadLetters

    since = parse_duration(args.since) if args.since else None
    with DeadLetters(settings_of(args)) as dlq:
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

    settings = settings_of(args)
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
    print_result(args, data, "\n".join(lines))
    return 0


def cmd_dlq_replay(args: argparse.Namespace) -> int:
    from taskq.consumer.dlq import DeadLetters

    if args.all == bool(args.offsets):
        raise ConfigurationError("taskq dlq replay: give DLQ offsets or --all, not both")
    with DeadLetters(settings_of(args)) as dlq:
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


def add_dlq(sub: Commands) -> None:
    """`taskq dlq list|show|replay`."""
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
