"""`taskq chaos` says why a service restart command failed, in the command's own last words."""

from __future__ import annotations

import random
from typing import Any

from taskq.tools.chaos import _Monkey


def test_a_failed_restart_command_is_reported_with_its_last_line() -> None:
    lines: list[str] = []
    command = "echo 'stopping kafka'; echo 'stack: kafka did not answer within 180s; stopping it' >&2; exit 1"
    workers: Any = None  # the monkey kills no worker here: no kills, no scheduled restarts
    monkey = _Monkey(
        workers,
        random.Random(1),
        duration=1.0,
        kill_every=0,
        services={"kafka": command},
        service_restarts=0,
        progress=lines.append,
    )
    monkey._service("kafka")
    assert monkey.service_runs["kafka"] == 1
    assert lines[-1] == "kafka restart failed: exit code 1: stack: kafka did not answer within 180s; stopping it"
    assert monkey.service_failures == [f"kafka restart ({command!r}): {lines[-1].partition(': ')[2]}"]
