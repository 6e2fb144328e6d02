"""`taskq bench worker|ceiling|latency` and `taskq stats --metrics-port` as real processes."""

from __future__ import annotations

import json
import pstats
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from taskq._core.db import Database
from taskq._core.envelope import PRIORITIES, Topics
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


def test_bench_worker_profile_writes_the_loops_profile_and_reports_no_launch(
    env_of: Callable[..., dict[str, str]], tmp_path: Path
) -> None:
    # --profile runs the worker in a thread of the bench's own process (the profiler is imported for it
    # alone): its launch is not a process's, so none is reported.
    path = tmp_path / "worker.prof"
    data = _bench(env_of(), "worker", "-n", "100", "--concurrency", "2", "--profile", str(path))
    assert data["completed"] == 100 and data["launch_to_first_task_s"] is None
    profiled = {name for (_, _, name) in pstats.Stats(str(path)).stats}  # type: ignore[attr-defined]
    assert "run" in profiled and "_tick" in profiled


def test_bench_worker_runs_every_task_and_removes_its_namespace(
    settings: Settings, env_of: Callable[..., dict[str, str]]
) -> None:
    data = _bench(env_of(), "worker", "-n", "300", "--concurrency", "4")
    assert data["completed"] == 300 and data["processes"] == 1
    assert data["all_assigned_s"] == data["startup_s"]  # one process: its assignment is every process's
    assert data["tasks_per_s"] > 0 and data["tasks_per_s_from_first_enqueue"] > 0
    assert data["worker_cpu_ms_per_task"] > 0 and data["wal_bytes_per_task"] > 0
    assert 0 < data["machine_busy"] <= 1  # the workers at least ran on it
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


@pytest.mark.parametrize("processes", ["1", "2"])
def test_bench_worker_plain_writes_its_own_row_per_task(
    env_of: Callable[..., dict[str, str]], processes: str
) -> None:
    # The effect outside the completion's transaction, as most queues' users write it: one commit of its own
    # a task, besides the claims' and completions' batches.
    data = _bench(env_of(), "worker", "-n", "100", "--handler", "plain", "--processes", processes)
    assert data["completed"] == 100 and data["effects"] == 100 and data["handler"] == "plain"
    assert data["pg_transactions_per_task"] >= 1


def test_bench_worker_processes_share_the_tasks(
    settings: Settings, env_of: Callable[..., dict[str, str]]
) -> None:
    data = _bench(env_of(), "worker", "-n", "200", "--processes", "2", "--concurrency", "2")
    assert data["completed"] == 200 and data["processes"] == 2
    # When the last process got its first partitions, no sooner than the first did; none if one got none
    # before these few tasks were done (a member joining gets partitions only once another gave them up).
    assert data["all_assigned_s"] is None or data["all_assigned_s"] >= data["startup_s"] > 0
    # Each process's share adds up to the run, each from its first start to its last completion.
    shares = data["by_process"]
    assert 1 <= len(shares) <= 2 and sum(p["tasks"] for p in shares) == 200
    for p in shares:
        assert p["tasks"] == 0 or 0 <= p["first_start_s"] <= p["last_completion_s"]
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
    # Its claims linger as the workers' do (--claim-linger-ms), and a trickle's are not lost for it.
    args = ["--rate", "100", "--duration", "1", "--claim-linger-ms", "3", *(["--bare"] if bare else [])]
    data = _bench(env_of(), "latency", *args)
    assert data["tasks"] == 100 and data["completed"] == 100 and data["bare"] is bare
    assert data["claim_linger_ms"] == 3.0
    assert data["worker_cpu_ms_per_task"] > 0
    assert data["achieved_rate_per_s"] > 0
    assert _percentiles(data["enqueue_to_start_ms"]) and _percentiles(data["enqueue_to_completion_ms"])
    _assert_namespace_gone(settings, data["namespace"])


@pytest.mark.parametrize("default_autovacuum", [False, True])
def test_bench_latency_on_a_seeded_history_reports_its_windows_and_the_tables_growth(
    settings: Settings, env_of: Callable[..., dict[str, str]], default_autovacuum: bool
) -> None:
    # 20,000 finished keys over 8 days, one every 34.56 s, then 100 tasks/s for 4 s in windows of 2 s.
    args = ["--rate", "100", "--duration", "4", "--window", "2", "--seed-history", "20000"]
    data = _bench(env_of(), "latency", *args, *(["--default-autovacuum"] if default_autovacuum else []))
    assert data["seeded"] == 20_000 and data["tasks"] == 400 and data["completed"] == 400
    assert [(w["from_s"], w["to_s"], w["enqueued"]) for w in data["windows"]] == [(0, 2, 200), (2, 4, 200)]
    for w in data["windows"]:
        assert w["completed"] > 0 and w["completed_per_s"] == w["completed"] / 2
        assert _percentiles(w["enqueue_to_start_ms"])
        # 50 tasks of each tier in a window of 200: each tier's p99 is one of its tasks' waits.
        by_tier = w["enqueue_to_start_p99_ms_by_tier"]
        assert set(by_tier) == set(PRIORITIES) and all(p99 > 0 for p99 in by_tier.values())
        assert max(by_tier.values()) <= w["enqueue_to_start_ms"]["max"]
    assert data["last_to_first"]["completed_per_s"] > 0 and data["last_to_first"]["enqueue_to_start_p99"] > 0
    # The purge half-way deleted the oldest day: 2,500 keys, and those that aged past 7 days while the run
    # started (one every 34.56 s).
    purged = data["purge"]["rows"]
    assert data["purge"]["error"] is None and 2_500 <= purged <= 2_510, data["purge"]
    before, after = data["table_before"], data["table_after"]
    # Seeded, then vacuumed and analyzed: every row live, none dead; the run's tables are counted apart.
    assert before["n_live_tup"] == 20_000 and before["n_dead_tup"] == 0 and before["vacuum_count"] == 1
    assert before["n_tup_ins"] == 20_000 and before["n_tup_upd"] == before["n_tup_del"] == 0
    # Each task inserted its key (the claim) and updated it (the completion); the purge deleted.
    assert after["n_tup_ins"] == 20_400 and after["n_tup_upd"] >= 400 and after["n_tup_del"] == purged
    assert after["n_dead_tup"] > 0 and data["max_dead_tuples"] >= after["n_dead_tup"]
    assert {s["at_s"] for s in data["samples"]} and all("n_dead_tup" in s for s in data["samples"])
    for stats in (before, after):
        assert set(stats["index_bytes"]) == {"taskq_tasks_pkey", "taskq_tasks_created_at"}
        assert stats["table_bytes"] > 0 and stats["indexes_bytes"] == sum(stats["index_bytes"].values())
    assert after["table_bytes"] >= before["table_bytes"]
    # Migration 0013's autovacuum settings, or the server's.
    autovacuum = {o for o in before["options"] if o.startswith("autovacuum_")}
    assert (autovacuum == set()) is default_autovacuum and "fillfactor=50" in before["options"]
    assert data["default_autovacuum"] is default_autovacuum
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
