"""The first consumer-group offsets query against a freshly started broker, as `taskq stats` makes it.

With confluent-kafka 2.13 to 2.16 (librdkafka alike), AdminClient.list_consumer_group_offsets killed the
process with SIGSEGV when the group coordinator answered that it was still loading, which is what a broker
answers for its first seconds: librdkafka's OffsetFetch error path calls into a consumer group that an
admin client does not have. Only a broker started for the test is fresh enough.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.acceptance.test_stack import STACK, _free_port


@pytest.fixture
def fresh_broker(tmp_path: Path) -> Iterator[str]:
    """A Kafka broker of its own, just started (state in tmp_path), stopped after the test."""
    env = {
        **os.environ,
        "TASKQ_STACK_DIR": str(tmp_path / "state"),
        **{
            name: str(_free_port())
            for name in (
                "TASKQ_STACK_KAFKA_PORT",
                "TASKQ_STACK_KAFKA_CONTROLLER_PORT",
                "TASKQ_STACK_REGISTRY_PORT",
                "TASKQ_STACK_REGISTRY_MANAGEMENT_PORT",
                "TASKQ_STACK_POSTGRES_PORT",
            )
        },
    }
    started = subprocess.run(
        [str(STACK), "start", "kafka"], env=env, capture_output=True, text=True, timeout=300
    )
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        yield f"127.0.0.1:{env['TASKQ_STACK_KAFKA_PORT']}"
    finally:
        subprocess.run([str(STACK), "stop", "kafka"], env=env, capture_output=True, timeout=120)


def test_stats_against_a_freshly_started_broker_does_not_crash(
    fresh_broker: str, env_of: Callable[..., dict[str, str]]
) -> None:
    env = env_of(TASKQ_BOOTSTRAP_SERVERS=fresh_broker)

    def taskq(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "taskq.cli", *args], env=env, capture_output=True, text=True, timeout=60
        )

    created = taskq("topics", "create", "--partitions", "1")
    assert created.returncode == 0, created.stderr
    # A fresh topic and a group the broker never saw, in a new process each time, right after the start.
    for _ in range(3):
        stats = taskq("stats", "--json")
        assert stats.returncode == 0, (stats.returncode, stats.stderr[-3000:])  # -11: SIGSEGV
        assert '"tiers": {"critical": 0, "high": 0, "normal": 0, "low": 0}' in stats.stdout, stats.stdout
