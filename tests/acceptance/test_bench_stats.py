"""`taskq bench worker|ceiling|latency` and `taskq stats --metrics-port` as real processes."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from taskq._core.db import Database
from taskq._core.envelope import Topics
from taskq._core.kafka import Admin, Sink
from taskq._core.settings import Settings
from taskq.producer.producer import TaskProducer
from taskq.schemas import Registry
from tests.acceptance.helpers import wait_until


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _metrics(port: int) -> str:
    """The /metrics text, or '' while nothing answers yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return str(r.read().decode())
    except (urllib.error.URLError, OSError):
        return ""


def _sample(metrics: str, name: str, labels: str = "") -> float | None:
    """One sample of the Prometheus text format, or None if absent."""
    braces = rf"\{{{re.escape(labels)}\}}" if labels else ""
    m = re.search(rf"^{re.escape(name)}{braces} (\S+)$", metrics, re.M)
    return float(m.group(1)) if m else None


def _bench(env: dict[str, str], command: str, *args: str) -> dict[str, Any]:
    """`taskq bench COMMAND ARGS --json` as a process; its JSON report."""
    out = subprocess.run(
        [sys.executable, "-m", "taskq.cli", "bench", command, *args, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    report: dict[str, Any] = json.loads(out.stdout)
    return report


def _assert_namespace_gone(settings: Settings, ns: str) -> None:
    """A bench run's namespace was its own, and is gone afterwards: no topics, no Postgres schema."""
    assert ns.startswith("bench-") and ns != settings.namespace
    topics = Topics(ns, settings.delay_tiers)
    names = [*topics.priority_topics, *topics.delay_topics, topics.dlq]
    # A deletion the controller accepted reaches the broker's metadata a moment later (longer on a busy
    # machine): wait for the metadata to drop the topics, as it must.
    wait_until(lambda: Admin(settings).partitions(names) == {}, timeout=30, what=f"the topics of {ns} gone")
    with Database(settings.database_url).connection() as conn:
        left = conn.execute(
            "SELECT count(*) AS n FROM pg_namespace WHERE nspname = %s", (ns.replace("-", "_"),)
        ).fetchone()
    assert left is not None and left["n"] == 0


def _percentiles(ms: dict[str, Any]) -> bool:
    return set(ms) == {"p50", "p90", "p99", "max"} and all(v >= 0 for v in ms.values())


def test_bench_worker_runs_every_task_and_removes_its_namespace(
    settings: Settings, env_of: Callable[..., dict[str, str]]
) -> None:
    data = _bench(env_of(), "worker", "-n", "300", "--concurrency", "4")
    assert data["completed"] == 300 and data["processes"] == 1
    assert data["tasks_per_s"] > 0 and data["tasks_per_s_from_first_enqueue"] > 0
    assert data["worker_cpu_ms_per_task"] > 0 and data["wal_bytes_per_task"] > 0
    assert data["enqueue_to_completion_ms"]["p50"] > 0
    assert _percentiles(data["enqueue_to_start_ms"])
    # Each task's claim inserted its key's row and its completion updated it, in batches: at least two rows
    # a task, in some transactions (the database is shared with other tests, so more of both may be counted).
    assert data["pg_rows_written_per_task"] >= 2 and data["pg_transactions_per_task"] > 0
    # Each task's record stays on disk: its row and its index entries, in the run's own schema.
    assert data["pg_table_bytes_per_task"] > 50
    # Statements are counted where the server has pg_stat_statements, and said to be unknown where not.
    with Database(settings.database_url).connection() as conn:
        installed = conn.execute("SELECT 1 FROM pg_extension WHERE extname = 'pg_stat_statements'").fetchone()
    if installed:
        assert data["pg_statements_per_task"] > 0
        assert any(q.startswith("WITH done AS") for q in data["pg_statements"])  # the completions
    else:
        assert data["pg_statements_per_task"] is None and data["pg_statements"] is None
    _assert_namespace_gone(settings, data["namespace"])


def test_bench_worker_transactional_writes_one_row_per_task(env_of: Callable[..., dict[str, str]]) -> None:
    data = _bench(env_of(), "worker", "-n", "100", "--handler", "transactional")
    assert data["completed"] == 100 and data["effects"] == 100
    # Its effect's row besides the claim's insert and the completion's update.
    assert data["pg_rows_written_per_task"] >= 3


def test_bench_worker_processes_share_the_tasks(
    settings: Settings, env_of: Callable[..., dict[str, str]]
) -> None:
    data = _bench(env_of(), "worker", "-n", "200", "--processes", "2", "--concurrency", "2")
    assert data["completed"] == 200 and data["processes"] == 2
    # The CPU of both processes is counted (each reports its own), and every key's start came back too.
    assert data["worker_cpu_ms_per_task"] > 0
    assert _percentiles(data["enqueue_to_start_ms"]) and _percentiles(data["attempt_to_recorded_ms"])
    _assert_namespace_gone(settings, data["namespace"])


def test_bench_ceiling_claims_and_completes_every_task(
    settings: Settings, env_of: Callable[..., dict[str, str]]
) -> None:
    data = _bench(env_of(), "ceiling", "-n", "200", "--with-worker", "--concurrency", "2")
    assert data["tasks"] == 200 and data["commit_interval_s"] > 0
    # The claim pass ran the worker's own claim and complete queries: one claim and one completion per task.
    assert data["claimed"] == 200 and data["completed"] == 200
    # So did the lean reference's statements, on its own table.
    assert data["lean_claimed"] == 200 and data["lean_completed"] == 200
    assert data["lean_per_s"] > 0 and data["claim_complete_fraction_of_lean"] > 0
    # Each claim inserted a row and each completion changed it: WAL was written for both passes.
    assert data["claim_complete_wal_bytes_per_task"] > 0 and data["lean_wal_bytes_per_task"] > 0
    # The transactional passes (one process, then two) wrote each task's row and its completion together.
    for prefix in ("transactional", "transactional_2_processes"):
        assert data[f"{prefix}_effects"] == 200 and data[f"{prefix}_completed"] == 200
        assert data[f"{prefix}_per_s"] > 0
    assert data["produced"] == 200 and data["record_bytes"] > 0
    for name in ("consume_commit_per_s", "consume_claim_complete_commit_per_s", "raw_produce_per_s"):
        assert data[name] > 0, name
    assert data["task_producer_fraction"] > 0
    # enqueue_many sent the same tasks again, every one acknowledged.
    assert data["produced_bulk"] == 200 and data["task_producer_bulk_fraction"] > 0
    assert data["task_producer_cpu_us"] > 0 and data["task_producer_bulk_cpu_us"] > 0
    assert data["worker"]["completed"] == 200 and data["worker_fraction"] > 0
    assert data["worker_fraction_of_lean"] > 0 and data["worker_wal_bytes_per_task"] > 0
    _assert_namespace_gone(settings, data["namespace"])
    _assert_namespace_gone(settings, data["worker"]["namespace"])


@pytest.mark.parametrize("bare", [False, True])
def test_bench_latency_runs_every_scheduled_task(
    settings: Settings, env_of: Callable[..., dict[str, str]], bare: bool
) -> None:
    # --bare: the framework-free loop (claims and completions in Postgres, commits) in place of the worker.
    data = _bench(env_of(), "latency", "--rate", "100", "--duration", "1", *(["--bare"] if bare else []))
    assert data["tasks"] == 100 and data["completed"] == 100 and data["bare"] is bare
    assert data["worker_cpu_ms_per_task"] > 0
    assert data["achieved_rate_per_s"] > 0
    assert _percentiles(data["enqueue_to_start_ms"]) and _percentiles(data["enqueue_to_completion_ms"])
    _assert_namespace_gone(settings, data["namespace"])


def test_stats_serves_tier_and_dlq_depths_until_sigterm(
    settings: Settings, env_of: Callable[..., dict[str, str]], task_schema: Callable[..., dict[str, Any]]
) -> None:
    schema = task_schema("Depth", [{"name": "i", "type": "int"}])
    task_type = f"{settings.namespace}.Depth"
    with Registry(settings.schema_registry_url) as registry:
        registry.register(schema)
    producer = TaskProducer(settings)
    for i in range(7):
        producer.enqueue(task_type, {"i": i}, priority="normal", idempotency_key=f"n{i}")
    for i in range(2):
        producer.enqueue(task_type, {"i": i}, priority="high", idempotency_key=f"h{i}")
    producer.flush(30)
    sink = Sink(settings)  # one DLQ record: garbage is enough, the depth counts records not replayed
    sink.send(Topics(settings.namespace).dlq, b"not a task", key=b"x", headers=[])
    assert sink.flush(30) == 0

    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "taskq.cli",
            "--namespace",
            settings.namespace,
            "stats",
            "--metrics-port",
            str(port),
            "--interval",
            "0.5",
        ],
        env=env_of(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        normal = 'priority="normal"'
        body = wait_until(
            lambda: (m := _metrics(port)) and _sample(m, "taskq_tier_depth", normal) == 7 and m,
            timeout=60,
            what="taskq_tier_depth{priority=normal} == 7",
        )
        assert _sample(body, "taskq_tier_depth", 'priority="high"') == 2
        assert _sample(body, "taskq_tier_depth", 'priority="critical"') == 0
        assert _sample(body, "taskq_dlq_depth") == 1
        # The gauges follow the queue: three more tasks show up at the next refresh.
        for i in range(7, 10):
            producer.enqueue(task_type, {"i": i}, priority="normal", idempotency_key=f"n{i}")
        producer.flush(30)
        wait_until(
            lambda: _sample(_metrics(port), "taskq_tier_depth", normal) == 10,
            timeout=30,
            what="taskq_tier_depth{priority=normal} == 10 after a refresh",
        )
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
    finally:
        producer.close()
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)  # reaps it and closes the pipes
