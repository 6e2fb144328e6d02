"""What the command modules share: the settings a command runs with, how it prints, and `leaf`, which adds
a command to the parser."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from typing import Any, TypeAlias

from taskq._core.settings import Settings

#: The sub-commands of a parser, which `leaf` adds to (a string: argparse's class is generic only to mypy).
Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

#: Commands that run until stopped: they wait out a broker that is away, the others report it.
LONG_RUNNING = ("worker", "forwarder", "relay")
#: WorkerConfig.claim_linger's default, in milliseconds (building the parser does not import the worker).
CLAIM_LINGER_MS = 0.0


def _linger_ms(text: str) -> float:
    """An argparse type: milliseconds from 0 to 1000."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"must be milliseconds from 0 to 1000, got {text!r}")
    return value


def add_claim_linger(parser: argparse.ArgumentParser) -> None:
    """`--claim-linger-ms`, a worker's WorkerConfig.claim_linger."""
    parser.add_argument(
        "--claim-linger-ms",
        type=_linger_ms,
        default=CLAIM_LINGER_MS,
        metavar="MS",
        help="a fetched task's claim waits up to this long for the next ones to go to Postgres in the same "
        f"round trip (default {CLAIM_LINGER_MS:g}: none; fetches already wait up to 5 ms to share theirs)",
    )


def port(text: str) -> int:
    """An argparse type: a TCP port, 0 to 65535 (0: one the system picks)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 0 to 65535, got {text!r}")
    return value


def print_result(args: argparse.Namespace, data: Any, text: str) -> None:
    """Print a command's result: `data` as JSON with --json, else `text`."""
    print(json.dumps(data, default=str) if args.json else text, flush=True)


def progress_to(args: argparse.Namespace, prefix: str, logger: str) -> Callable[[str], None]:
    """Where a command reports its progress: stderr lines `PREFIX: ...`, or with --log-format json INFO lines
    of `logger`, so that every line on stderr is JSON."""
    if args.log_format == "json":
        log = logging.getLogger(logger)
        log.setLevel(logging.INFO)
        return log.info
    return lambda line: print(f"{prefix}: {line}", file=sys.stderr, flush=True)


def settings_of(args: argparse.Namespace) -> Settings:
    """The settings a command runs with: the environment's, with --namespace over it."""
    overrides: dict[str, Any] = {}
    if getattr(args, "namespace", None):
        overrides["namespace"] = args.namespace
    if args.command not in LONG_RUNNING:
        # Fail fast: a one-off command that cannot reach the broker says so in about 10 s.
        overrides["kafka_timeout"] = 10.0
    return Settings.from_env(**overrides)


def leaf(
    parent: Commands,
    name: str,
    fn: Callable[[argparse.Namespace], int],
    help: str,
    *,
    json_flag: bool = True,
) -> argparse.ArgumentParser:
    """Add command `name`, run by `fn`, to `parent`: its help is also its description; most print JSON with
    --json."""
    sp = parent.add_parser(name, help=help, description=help)
    if json_flag:
        sp.add_argument("--json", action="store_true", help="print JSON")
    sp.set_defaults(fn=fn)
    return sp
