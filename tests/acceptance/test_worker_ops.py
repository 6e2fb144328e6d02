"""Operating workers as real processes: the metrics endpoint and `taskq db purge`."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request

from taskq._core.envelope import Envelope, Topics
from taskq._core.kafka import Record, Sink, Source
from taskq.consumer.dlq import DeadLetters
from taskq.consumer.routing import dead_letter_record
from tests.acceptance.conftest import App
from tests.acceptance.helpers import all_committed, wait_until


def _record_of(app: App, key: str) -> Record:
    """The Ledger task record of an idempotency key, read from the namespace's normal tier."""
    source = Source(app.settings, group=f"{app.ns}.reader")
    source.assign([(f"{app.ns}.normal", p, 0) for p in range(3)])
    found: list[Record] = []

    def seen() -> bool:
        found.extend(
            r for r in source.poll(100, 0.5) if Envelope.from_headers(r.headers).idempotency_key == key
        )
        return bool(found)

    try:
        wait_until(seen, timeout=30, what=f"the record of {key}")
    finally:
        source.close()
    return found[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> tuple[int, str]:
    """Status and body of a GET; (0, error) while nothing answers yet."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except OSError as exc:
        return 0, str(exc)


def _sample(metrics: str, name: str, labels: str) -> float | None:
    """The value of one sample of the Prometheus text format, or None if absent."""
    m = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", metrics, re.M)
    return float(m.group(1)) if m else None


def test_metrics_endpoint_counts_tasks_and_healthz_answers(app: App) -> None:
    n = 5
    for i in range(n):
        app.producer.enqueue(app.type("Ledger"), {"key": f"m{i}", "amount": i}, idempotency_key=f"m{i}")
    app.producer.flush(30)
    port = _free_port()
    worker = app.spawn("--concurrency", "2", "--metrics-port", str(port))
    base = f"http://127.0.0.1:{port}"
    labels = f'task_type="{app.type("Ledger")}"'

    def succeeded() -> float | None:
        status, body = _get(base + "/metrics")
        value = _sample(body, "taskq_tasks_succeeded_total", labels) if status == 200 else None
        return value if value is not None and value >= n else None

    wait_until(succeeded, timeout=90, what=f"taskq_tasks_succeeded_total >= {n} on /metrics")
    status, body = _get(base + "/metrics")
    assert status == 200
    started = _sample(body, "taskq_tasks_started_total", labels)
    assert started is not None and started >= n, body
    assert app.scalar("SELECT count(*) FROM ledger") == n
    # Lag per tier is measured every few seconds; once everything ran it is 0 on every tier.
    wait_until(
        lambda: all(
            _sample(_get(base + "/metrics")[1], "taskq_consumer_lag", f'priority="{p}"') == 0.0
            for p in ("critical", "high", "normal", "low")
        ),
        timeout=30,
        what="taskq_consumer_lag for every tier",
    )
    assert _get(base + "/healthz")[0] == 200
    assert worker.proc.poll() is None, worker.output()[-3000:]


def test_db_purge_deletes_finished_records_older_than_the_ttl_but_keeps_keys_in_the_dlq(app: App) -> None:
    keys = [f"p{i}" for i in range(6)]
    for i, k in enumerate(keys):
        app.producer.enqueue(app.type("Ledger"), {"key": k, "amount": i}, idempotency_key=k)
    app.producer.flush(30)
    worker = app.spawn("--concurrency", "2")
    completed = "SELECT count(*) FROM taskq_tasks WHERE state = 'completed'"
    wait_until(lambda: app.scalar(completed) == len(keys), timeout=90, what=f"{len(keys)} completions")
    worker.terminate()
    assert worker.wait(60) == 0, worker.output()[-3000:]
    # A retryable key is not finished: purge must keep it whatever its age.
    app.query(
        "INSERT INTO taskq_tasks (namespace, idempotency_key, task_id, task_type, state, attempts, updated_at)"
        " VALUES (%s, 'retrying', 't', %s, 'failed', 1, now() - interval '1 day') RETURNING idempotency_key",
        app.ns,
        app.type("Ledger"),
    )

    def purge(older_than: str) -> int:
        out = subprocess.run(
            [sys.executable, "-m", "taskq.cli", "db", "purge", "--older-than", older_than, "--json"],
            env=app.env_of(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        return int(json.loads(out.stdout)["purged"])

    # A copy of p0 sits in the DLQ (dead-lettered earlier, say): its key must outlive any TTL, or a replay
    # would run p0's effect a second time.
    dl = dead_letter_record(
        _record_of(app, "p0"), reason="failed", error_type="x.Y", traceback="", attempts=5, worker_id="w",
        topics=Topics(app.ns),
    )  # fmt: skip
    sink = Sink(app.settings)
    sink.send(dl.topic, dl.value, key=dl.key, headers=dl.headers)
    assert sink.flush(30) == 0

    assert purge("1h") == 0  # younger than the TTL: kept
    assert app.scalar(completed) == len(keys)
    assert purge("0s") == len(keys) - 1
    rows = app.query("SELECT idempotency_key, state FROM taskq_tasks ORDER BY idempotency_key")
    assert rows == [
        {"idempotency_key": "p0", "state": "completed"},
        {"idempotency_key": "retrying", "state": "failed"},
    ]
    # Replaying the DLQ copy after the purge finds p0 completed: no second effect.
    with DeadLetters(app.settings) as dlq:
        (result,) = dlq.replay([dlq.list()[0].offset])
    assert result.already_completed
    app.spawn("--concurrency", "2")
    wait_until(lambda: all_committed(app.settings), timeout=90, what="the replayed copy to be consumed")
    assert app.scalar("SELECT count(*) FROM ledger WHERE key = 'p0'") == 1
