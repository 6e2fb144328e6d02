"""Handlers that child processes of the executor tests load, as `executor_handlers:handlers`."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from pathlib import Path
from typing import Any

from taskq.consumer.handlers import Handlers, TaskContext

handlers = Handlers()


def _write_pid(payload: Any) -> None:
    if isinstance(payload, dict) and payload.get("pid_file"):
        # Written whole, then renamed: the test never reads half a pid.
        tmp = Path(payload["pid_file"] + ".tmp")
        tmp.write_text(str(os.getpid()))
        tmp.rename(payload["pid_file"])


@handlers.task("x.Ok", isolation="process")
def ok(payload: Any, ctx: TaskContext) -> dict[str, Any]:
    _write_pid(payload)
    return {
        "pid": os.getpid(),
        "echo": payload,
        "task_id": ctx.task_id,
        "has_deadline": ctx.deadline is not None,
        "parent_result": ctx.parent_result,
        "group_results": ctx.group_results,
    }


@handlers.task("x.Raises", isolation="process")
def raises(payload: Any, ctx: TaskContext) -> None:
    raise ValueError(f"bad payload {payload!r}")


@handlers.task("x.SystemExit", isolation="process")
def system_exit(payload: Any, ctx: TaskContext) -> None:
    raise SystemExit(2)


@handlers.task("x.Sleeps", isolation="process")
def sleeps(payload: Any, ctx: TaskContext) -> None:
    _write_pid(payload)
    time.sleep(600)


@handlers.task("x.Exit", isolation="process")
def exits(payload: Any, ctx: TaskContext) -> None:
    os._exit(3)


@handlers.task("x.Segfault", isolation="process")
def segfault(payload: Any, ctx: TaskContext) -> None:
    ctypes.string_at(0)


@handlers.task("x.Unpicklable", isolation="process")
def unpicklable(payload: Any, ctx: TaskContext) -> Any:
    return threading.Lock()


@handlers.task("x.Modules", isolation="process")
def loaded_modules(payload: Any, ctx: TaskContext) -> list[str]:
    import sys

    heavy = ("taskq", "psycopg", "confluent_kafka", "prometheus_client")
    return sorted(m for m in sys.modules if m.split(".")[0] in heavy)
