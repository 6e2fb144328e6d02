"""The `taskq` command line: `main` runs it, `build_parser` is its argument parser (every command, option and
help text). Each command group's code and options live in a module of their own."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from taskq._core.errors import TaskqError
from taskq.cli import db, dlq, enqueue, operate, periodic, processes, provision, tools
from taskq.cli.common import LONG_RUNNING
from taskq.cli.logs import LOG_FORMATS, configure_logging
from taskq.schemas.errors import SchemaError

__all__ = ["build_parser", "main"]

#: Commands that log as they run, and take --log-format after their name (any command takes it before).
_LOGGING = (*LONG_RUNNING, "chaos", "stats", "console")
#: The command `main` ran last (for `run`).
_ran: str | None = None


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
    # In the order `taskq --help` lists them.
    provision.add_topics(sub)
    provision.add_schemas(sub)
    enqueue.add_enqueue(sub)
    tools.add_bench(sub)
    tools.add_chaos(sub)
    db.add_db(sub)
    processes.add_worker(sub)
    periodic.add_periodic(sub)
    processes.add_relay(sub)
    processes.add_forwarder(sub)
    dlq.add_dlq(sub)
    operate.add_pause(sub)
    operate.add_status(sub)
    operate.add_console(sub)
    operate.add_stats(sub)
    for name in _LOGGING:
        if name in sub.choices:
            # SUPPRESS: given before the command's name, the value stays unless given again after it.
            sub.choices[name].add_argument("--log-format", default=argparse.SUPPRESS, **log_format)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `taskq` console script."""
    global _ran
    args = build_parser().parse_args(argv)
    _ran = args.command
    # The flag wins over the environment; read here, where the command line is.
    args.log_format = args.log_format or os.environ.get("TASKQ_LOG_FORMAT") or "text"
    if args.log_format not in LOG_FORMATS:
        print(
            f"taskq: error: TASKQ_LOG_FORMAT must be text or json, not {args.log_format!r}",
            file=sys.stderr,
        )
        return 2
    configure_logging(
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


def run() -> None:
    """The `taskq` console script (and `python -m taskq.cli`): `main`, then the process ends with its code.

    A long-running command (worker, forwarder, relay) ends its process at once, without the interpreter's
    finalization: by then it has recorded and committed what it did and closed its clients, or it failed
    and said why. Objects of the Kafka client left to finalization (a producer whose own threads still
    call back into Python, say) crashed a worker refused by the broker with SIGSEGV on its way out.
    """
    code = main(sys.argv[1:])
    if _ran in LONG_RUNNING:
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

