"""`taskq worker --log-format json`: one JSON object per line, and a task's lines carry the task's fields."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest

from tests.acceptance.conftest import App
from tests.acceptance.helpers import WorkerProcess, wait_until

TASK_FIELDS = ("task_id", "idempotency_key", "task_type", "tier", "attempt")


def lines(output: str) -> list[dict[str, Any]]:
    """Every line of a worker's output, each of which must be one JSON object."""
    parsed = []
    for line in output.splitlines():
        if line.strip():
            entry = json.loads(line)  # raises on a line that is not JSON
            assert isinstance(entry, dict) and {"ts", "level", "logger", "message"} <= entry.keys(), line
            parsed.append(entry)
    return parsed


def test_a_json_worker_logs_task_fields_on_its_lines_and_the_handlers(app: App) -> None:
    task_type = app.type("Noted")
    receipt = app.producer.enqueue(
        task_type, {"key": "n1", "fail_times": 1}, idempotency_key="noted:n1", wait=True
    )
    # A password in the database URL (the local cluster trusts loopback and ignores it) must never be logged.
    url = app.settings.database_url.replace("postgres@", "postgres:s3cret-pw@", 1)
    assert "s3cret-pw" in url
    in_process = app.producer.enqueue(
        app.type("NotedProc"), {"key": "p1"}, idempotency_key="noted:p1", wait=True
    )
    worker = app.spawn("--log-format", "json", TASKQ_DATABASE_URL=url)
    handler_lines = lambda: [e for e in lines(worker.output()) if e["logger"] == f"taskq.task.{task_type}"]  # noqa: E731
    process_lines = lambda: [e for e in lines(worker.output()) if e.get("task_id") == in_process.task_id]  # noqa: E731
    wait_until(lambda: len(handler_lines()) >= 2, timeout=60, what="two attempts' handler lines")
    wait_until(process_lines, timeout=60, what="the line of a handler in a child process")
    worker.terminate()
    assert worker.wait(60) == 0, worker.output()[-3000:]
    output = worker.output()
    assert "s3cret-pw" not in output
    entries = lines(output)

    expected = {
        "task_id": receipt.task_id,
        "idempotency_key": "noted:n1",
        "task_type": task_type,
        "tier": "normal",
    }
    # The handler's ctx.log lines: the task's fields, the attempt, and the line's own extra.
    assert [e["attempt"] for e in handler_lines()] == [1, 2]
    for entry in handler_lines():
        assert {k: entry[k] for k in expected} == expected
        assert entry["message"] == "noted n1" and entry["step"] == "note" and entry["level"] == "INFO"
    # The worker's own line about the task's retry carries them too.
    [retry] = [e for e in entries if e["logger"] == "taskq.worker" and "retrying" in e["message"]]
    assert {k: retry[k] for k in expected} == expected and retry["attempt"] == 1
    assert all(set(TASK_FIELDS) <= e.keys() for e in entries if e.get("task_id") == receipt.task_id)
    # A handler with isolation="process" logs from its child process, in the worker's format and fields.
    [child] = process_lines()
    assert (
        child["message"] == "noted p1 in a process"
        and child["logger"] == f"taskq.task.{app.type('NotedProc')}"
    )
    assert (child["idempotency_key"], child["attempt"], child["tier"]) == ("noted:p1", 1, "normal")
    assert child["pid"] != worker.proc.pid


@pytest.mark.parametrize(
    ("command", "started", "logger"),
    [
        (("stats", "--metrics-port"), "serving /metrics", "taskq.stats"),
        (("console", "--port"), "http://127.0.0.1:", "taskq.console"),  # its start line and uvicorn's too
    ],
)
def test_a_long_running_command_logs_only_json_lines(
    app: App, command: tuple[str, str], started: str, logger: str
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = WorkerProcess.command(
        app.env_of(TASKQ_LOG_FORMAT="json"), app.tmp_path / f"{command[0]}.log", *command, str(port)
    )
    try:
        wait_until(lambda: started in proc.output(), timeout=60, what=f"{command[0]} to start")
        proc.terminate()
        assert proc.wait(60) == 0, proc.output()[-3000:]  # lines() fails on any line that is not JSON
        [line] = [e for e in lines(proc.output()) if started in e["message"]]
        assert line["logger"] == logger and line["level"] == "INFO"
    finally:
        proc.close()
