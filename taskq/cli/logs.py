"""How the `taskq` command logs: to stderr, as text or as one JSON object a line."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

from taskq._core.logs import OUTAGE_WINDOW, RepeatFilter, outage_kind
from taskq.cli.common import LONG_RUNNING

LOG_FORMATS = ("text", "json")


class RefusalEcho(logging.Filter):
    """Drops librdkafka's log lines about a refused connection: the client raises it as one error."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "SASL authentication error" not in message and "SSL handshake failed" not in message


class JsonLines(logging.Formatter):
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


def configure_logging(verbose: bool, command: str, *, pids: bool = False, log_format: str = "text") -> None:
    """Log to stderr: INFO for the long-running commands or with -v, else WARNING; `pids` puts the process
    id in each line (the supervisor and the worker processes of `--processes N` share one stderr);
    `log_format` json writes each line as a JSON object."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonLines())
        # Python's warnings too: every line a JSON-logging command writes to stderr is JSON.
        logging.captureWarnings(True)
    else:
        process = "[%(process)d]" if pids else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s %(name)s{process}: %(message)s"))
    # A worker finding Postgres away says so on every retry, every 50 ms or so: the first line of each kind
    # is shown, then one every OUTAGE_WINDOW seconds with a count, not screens of the same line.
    handler.addFilter(RepeatFilter(OUTAGE_WINDOW, kind=outage_kind))
    logging.basicConfig(
        level=logging.INFO if verbose or command in LONG_RUNNING else logging.WARNING, handlers=[handler]
    )
    for noisy in ("httpx", "httpx2", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Refused credentials end the command with one line (taskq: error: ...), not a line per retry.
    librdkafka = logging.getLogger("taskq.librdkafka")
    if not any(isinstance(f, RefusalEcho) for f in librdkafka.filters):  # once, however often main runs
        librdkafka.addFilter(RefusalEcho())
    if not verbose and command not in LONG_RUNNING:
        # A short-lived command reports what failed in one line; librdkafka's retries and the producer's
        # per-task delivery log would only repeat it.
        for repeats in ("taskq.librdkafka", "taskq.producer"):
            logging.getLogger(repeats).setLevel(logging.CRITICAL)
