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
