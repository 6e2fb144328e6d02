"""One-off `taskq` commands with the broker away fail fast, as real processes: one line, no traceback."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from taskq._core.settings import Settings
from taskq.schemas import Registry

#: Every one-off command that talks to Kafka (the worker and the forwarder wait for it instead).
COMMANDS = [
    ["topics", "create"],
    ["dlq", "list"],
    ["dlq", "show", "0"],
    ["dlq", "replay", "--all"],
    ["stats"],
    ["stats", "--metrics-port", "0"],
    ["db", "purge"],
    ["bench", "produce", "-n", "1"],
    ["bench", "worker", "-n", "1"],
    ["bench", "ceiling", "-n", "1"],
    ["bench", "latency", "--rate", "1", "--duration", "1"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_a_command_with_the_broker_away_fails_in_about_10_s_in_one_line(
    command: list[str], settings: Settings, env_of: Callable[..., dict[str, str]]
) -> None:
    # Nothing listens on port 1: Postgres and the registry answer, the broker never does. The bound is a
    # deadline (librdkafka's defaults took 30 s to two minutes, or never ended), not a measurement.
    out = subprocess.run(
        [sys.executable, "-m", "taskq.cli", *command],
        env=env_of(TASKQ_BOOTSTRAP_SERVERS="127.0.0.1:1"),
        capture_output=True,
        text=True,
        timeout=25,
    )
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith("taskq: error:"), lines[0]
    assert "no answer from the Kafka broker at 127.0.0.1:1" in lines[0], lines[0]


def test_enqueue_with_the_broker_away_names_it_in_one_line(
    settings: Settings, env_of: Callable[..., dict[str, str]], task_schema: Callable[..., dict[str, Any]]
) -> None:
    with Registry(settings.schema_registry_url) as registry:  # the registry answers, the broker never does
        task_type = registry.register(task_schema("Job", [{"name": "n", "type": "int"}])).subject
    out = subprocess.run(
        [sys.executable, "-m", "taskq.cli", "enqueue", task_type, "--json", '{"n": 1}'],
        env=env_of(TASKQ_BOOTSTRAP_SERVERS="127.0.0.1:1"),
        capture_output=True,
        text=True,
        timeout=25,
    )
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr[-3000:]
    assert "not acknowledged: no answer from the Kafka broker at 127.0.0.1:1 within 10 s" in lines[0], out
