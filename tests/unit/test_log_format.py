"""--log-format / TASKQ_LOG_FORMAT: JSON lines with each line's extra fields; a wrong value is one line."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

from taskq.cli.logs import JsonLines


def test_a_json_line_carries_the_standard_fields_the_extra_and_the_traceback() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.getLogger("taskq.worker").makeRecord(
            "taskq.worker",
            logging.WARNING,
            __file__,
            1,
            "task %s failed",
            ("t1",),
            sys.exc_info(),
            extra={"task_id": "t1", "attempt": 2, "tier": "high"},
        )
    line = json.loads(JsonLines().format(record))
    assert line["level"] == "WARNING" and line["logger"] == "taskq.worker"
    assert line["message"] == "task t1 failed" and line["ts"].endswith("+00:00")
    assert (line["task_id"], line["attempt"], line["tier"]) == ("t1", 2, "high")
    assert "ValueError: boom" in line["exc_info"]
    assert not {"args", "msg", "levelno", "exc_text"} & line.keys()


def test_an_unknown_log_format_in_the_environment_is_one_line() -> None:
    env = {**os.environ, "TASKQ_LOG_FORMAT": "xml"}
    out = subprocess.run(
        [sys.executable, "-m", "taskq.cli", "stats"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert out.stderr.strip() == "taskq: error: TASKQ_LOG_FORMAT must be text or json, not 'xml'"


def test_a_python_warning_of_a_json_logging_command_is_a_json_line() -> None:
    # The console stopped before uvicorn ran printed "coroutine 'Server.serve' was never awaited" as a bare
    # line on stderr: every line of a JSON-logging command must be JSON, warnings included.
    code = (
        "import warnings; from taskq.cli.logs import configure_logging; "
        "configure_logging(False, 'console', log_format='json'); "
        "warnings.warn('coroutine was never awaited', RuntimeWarning)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    [line] = [json.loads(line) for line in out.stderr.splitlines()]
    assert line["level"] == "WARNING" and "coroutine was never awaited" in line["message"]


def test_a_worker_finding_postgres_away_logs_each_kind_of_line_once_a_window_not_once_a_retry() -> None:
    # A Postgres restart in CI: 450 lines of "store unavailable, will record 25 outcome(s) again" in 20 s
    # per worker, and the tail of its log showed nothing else. Each retry names the error it met (refused,
    # then "starting up"): they are one kind. Lines without the outage mark are never held back.
    code = (
        "import logging; from taskq.cli.logs import configure_logging; from taskq._core.logs import OUTAGE; "
        "configure_logging(False, 'worker'); log = logging.getLogger('taskq.worker')\n"
        "for i in range(100):\n"
        "    error = 'Connection refused' if i < 50 else 'the database system is starting up'\n"
        "    log.warning('store unavailable, will record %d outcome(s) again: %s', i, error, extra=OUTAGE)\n"
        "    log.warning('heartbeat not written: %s', error, extra=OUTAGE)\n"
        "    log.warning('lease of key%d was taken over; its outcome was not recorded', i)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert sum("store unavailable" in line for line in lines) == 1, lines
    assert sum("heartbeat not written" in line for line in lines) == 1, lines
    assert sum("was taken over" in line for line in lines) == 100, lines
