"""Results, status and cancellation on the in-memory fakes (the same rules as on the real stack)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from taskq import Handlers, TaskCancelled, TaskContext, TaskFailed
from taskq.consumer.events import CancelledSkipped
from taskq.producer.status import Polls, TaskStatus
from taskq.testing import InMemoryQueue

JOB = {"type": "record", "name": "Job", "namespace": "unit", "fields": [{"name": "n", "type": "long"}]}


def test_a_handlers_return_value_is_the_result_and_one_that_cannot_be_stored_fails_the_task() -> None:
    handlers = Handlers()

    @handlers.task("unit.Job", schema=JOB, max_attempts=3)
    def job(payload: dict[str, Any], ctx: TaskContext) -> Any:
        n = payload["n"]
        return {1: {"double": 2 * n}, 2: "x" * 70_000, 3: {1, 2}, 4: None}[n]

    with InMemoryQueue(handlers, namespace="unit") as q:
        receipts = [q.producer.enqueue("unit.Job", {"n": n}) for n in (1, 2, 3, 4)]
        q.run_until_idle()
        ok, large, unserialisable, nothing = receipts
        assert ok.result(timeout=0) == {"double": 2}
        assert q.producer.status(ok.task_id).state == "completed"
        assert nothing.result(timeout=0) is None
        with pytest.raises(TaskFailed, match=r"result refused: .*over the limit of 65536"):
            large.result(timeout=0)
        with pytest.raises(TaskFailed, match="not JSON-serialisable") as failed:
            unserialisable.result(timeout=0)
        # Straight to the DLQ: the next attempt's result could not be stored either.
        assert large.status().attempts == 1 and unserialisable.status().attempts == 1
        dead = {r.task_id: r.offset for r in q.dead_letters}
        assert failed.value.dlq_offset == dead[unserialisable.task_id]


def test_a_task_cancelled_before_it_starts_never_runs_and_never_reaches_the_dlq() -> None:
    handlers = Handlers()
    ran: list[int] = []

    @handlers.task("unit.Job", schema=JOB)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        ran.append(payload["n"])

    with InMemoryQueue(handlers, namespace="unit") as q:
        receipts = [q.producer.enqueue("unit.Job", {"n": n}, delay=30) for n in range(6)]
        assert [r.cancel() for r in receipts[:3]] == [False] * 3
        q.run_until_idle()
        assert sorted(ran) == [3, 4, 5] and q.dead_letters == []
        assert [r.status().state for r in receipts] == ["cancelled"] * 3 + ["completed"] * 3
        skipped = sorted(e.key for e in q.events.of(CancelledSkipped))
        assert skipped == sorted(r.idempotency_key for r in receipts[:3])
        with pytest.raises(TaskCancelled):
            receipts[0].result(timeout=0)
        with pytest.raises(TimeoutError):
            q.producer.result(idempotency_key="never-enqueued", timeout=0.01)


def test_result_polls_back_off_from_50_ms_to_a_second_and_stop_at_the_timeout() -> None:


    waiting = TaskStatus(task_id="t", idempotency_key="k", state="queued")
    polls = Polls(None)
    pauses = [polls.next(waiting) for _ in range(12)]
    assert pauses[:3] == pytest.approx([0.05, 0.075, 0.1125]) and pauses[-1] == 1.0
    assert all(a <= b for a, b in itertools.pairwise(pauses))
    assert Polls(3600).next(waiting) == 0.05
    with pytest.raises(TimeoutError, match="task t is queued after 0s"):
        Polls(0).next(waiting)
