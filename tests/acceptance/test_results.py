"""Results, status and cancellation, with workers as processes on the real stack (issue 23)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from taskq import AsyncTaskProducer, NotCancellableError, TaskCancelled, TaskFailed
from taskq.consumer.dlq import DeadLetters
from tests.acceptance.conftest import App
from tests.acceptance.helpers import all_committed, tier_records, wait_until


def taskq(app: App, *args: str) -> subprocess.CompletedProcess[str]:
    """Run `taskq ARGS...` to completion in the test's namespace."""
    return subprocess.run(
        [sys.executable, "-m", "taskq.cli", *args],
        env=app.env_of(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_asyncio_producer_awaits_a_result_and_times_out_on_a_task_not_due_yet(app: App) -> None:
    # Its waits between reads suspend only the coroutine: another one keeps ticking meanwhile.
    app.spawn("--concurrency", "2")

    async def scenario() -> tuple[object, float, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        async with AsyncTaskProducer(app.settings) as producer:
            answered = await producer.enqueue(app.type("Answer"), {"key": "async"}, wait=True)
            later = await producer.enqueue(app.type("Answer"), {"key": "later"}, delay=3600, wait=True)
            result = await producer.result(answered.task_id, timeout=30)
            started = time.monotonic()
            with pytest.raises(TimeoutError, match=r"after 0\.5s"):
                await producer.result(idempotency_key=later.idempotency_key, timeout=0.5)
            waited = time.monotonic() - started
        ticker.cancel()
        return result, waited, ticks

    result, waited, ticks = asyncio.run(scenario())
    assert result == {"echo": "async", "attempt": 1, "pad": ""}
    assert waited >= 0.5 and ticks > 0


def test_result_returns_the_handlers_value_and_a_dead_lettered_task_names_its_dlq_record(app: App) -> None:
    app.spawn("--concurrency", "4")
    answered = app.producer.enqueue(app.type("Answer"), {"key": "a"})
    rejected = app.producer.enqueue(app.type("Answer"), {"key": "b", "reject": True})
    too_large = app.producer.enqueue(app.type("Answer"), {"key": "c", "pad": 70_000})
    assert answered.result(timeout=30) == {"echo": "a", "attempt": 1, "pad": ""}
    # By task id too: the record is found by a scan of the namespace's records.
    assert app.producer.result(answered.task_id, timeout=5) == {"echo": "a", "attempt": 1, "pad": ""}

    with pytest.raises(TaskFailed) as failed:
        rejected.result(timeout=30)
    with pytest.raises(TaskFailed) as refused:
        too_large.result(timeout=30)
    with DeadLetters(app.settings) as dead_letters:
        records = {r.task_id: r for r in dead_letters.list()}
    dlq = records[rejected.task_id]
    # The DLQ topic has one partition: a DLQ record is named by its offset.
    assert (failed.value.dlq_partition, failed.value.dlq_offset) == (0, dlq.offset)
    assert f"{app.ns}.dlq[0]@{dlq.offset}" in str(failed.value)
    assert "can never be answered" in failed.value.reason
    # A result too large to store fails the attempt with the limit named, never stored cut short.
    assert refused.value.dlq_offset == records[too_large.task_id].offset
    assert "over the limit of 65536" in refused.value.reason
    assert too_large.status().result is None

    out = taskq(app, "status", answered.task_id, "--json")
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert (shown["state"], shown["result"], shown["attempts"]) == ("completed", answered.result(), 1)
    out = taskq(app, "status", "--idempotency-key", rejected.idempotency_key)
    assert out.returncode == 0, out.stderr
    assert "state     dead" in out.stdout and f"@{dlq.offset}" in out.stdout
    # Cancelling a finished task is refused with its state, in one line.
    with pytest.raises(NotCancellableError, match="is completed already"):
        answered.cancel()
    out = taskq(app, "cancel", answered.task_id)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr
    assert "is completed already" in out.stderr


def test_cancelled_delayed_tasks_never_run_and_never_reach_the_dlq(app: App) -> None:
    app.spawn("--concurrency", "8")
    receipts = app.producer.enqueue_many(
        app.type("Plain"), [{"key": f"k{i}"} for i in range(100)], delay=5
    )
    app.producer.flush(30)
    cancelled = receipts[::2]
    assert [r.cancel() for r in cancelled] == [False] * 50  # waiting in a delay tier: not started
    assert {r.status().state for r in cancelled} == {"cancelled"}

    wait_until(lambda: len(tier_records(app.settings)) >= 100, timeout=30, what="the forwarder's releases")
    wait_until(lambda: all_committed(app.settings), timeout=30, what="the worker to commit every record")
    ran = {r["key"] for r in app.query("SELECT key FROM ledger")}
    assert ran == {f"k{i}" for i in range(1, 100, 2)} and app.scalar("SELECT count(*) FROM ledger") == 50
    with DeadLetters(app.settings) as dead_letters:
        assert dead_letters.list() == []
    assert [r.status().state for r in cancelled] == ["cancelled"] * 50
    assert {r.status().state for r in receipts[1::2]} == {"completed"}
    with pytest.raises(TaskCancelled):
        cancelled[0].result(timeout=5)


def test_a_running_task_sees_ctx_cancelled_and_its_outcome_is_recorded_as_usual(app: App) -> None:
    app.spawn("--concurrency", "2")
    receipt = app.producer.enqueue(app.type("Patient"), {"key": "p"})
    wait_until(lambda: receipt.status().state == "running", timeout=30, what="the task to start")
    assert receipt.cancel() is True  # it had started: cooperative from here
    assert receipt.result(timeout=30) == {"cancelled": True}
    assert receipt.status().state == "completed"
