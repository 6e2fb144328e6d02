"""Workflows on the in-memory fakes: chains, groups with callbacks, nesting, failure policies, cancel."""

from __future__ import annotations

from typing import Any

import pytest

import taskq
from taskq import Handlers, InvalidTaskError, NotCancellableError, Reject, TaskContext, TaskSpec, chain, group
from taskq.testing import InMemoryQueue

JOB = {
    "type": "record",
    "name": "Job",
    "namespace": "unit",
    "fields": [{"name": "n", "type": "long"}, {"name": "fail", "type": "boolean", "default": False}],
}


def t(n: int, *, fail: bool = False) -> TaskSpec:
    return TaskSpec(task_type="unit.Job", payload={"n": n, "fail": fail})


def queue() -> tuple[InMemoryQueue, list[tuple[int, Any, Any]]]:
    handlers = Handlers()
    seen: list[tuple[int, Any, Any]] = []

    @handlers.task("unit.Job", schema=JOB, max_attempts=1)
    def job(payload: dict[str, Any], ctx: TaskContext) -> int:
        seen.append((payload["n"], ctx.parent_result, ctx.group_results))
        if payload["fail"]:
            raise Reject(f"{payload['n']} fails")
        return int(payload["n"]) * 10

    return InMemoryQueue(handlers, namespace="unit"), seen


def test_steps_get_what_the_steps_before_them_gave_through_nested_chains_and_groups() -> None:
    q, seen = queue()
    with q:
        receipt = q.producer.enqueue_workflow(
            chain(t(1), group(t(2), chain(t(3), t(4)), then=t(5)), group(t(6), t(7)), t(8))
        )
        assert receipt.status().counts == {"running": 1, "waiting": 7}
        q.run_until_idle()
        status = receipt.status()
        assert (status.state, status.done, status.counts) == ("completed", True, {"completed": 8})
    by_step = {n: (parent, members) for n, parent, members in seen}
    assert by_step[2] == (10, None) and by_step[3] == (10, None) and by_step[4] == (30, None)
    _, members = by_step[5]
    assert [(m["state"], m["result"]) for m in members] == [("completed", 20), ("completed", 40)]
    assert by_step[6] == (50, None) and by_step[7] == (50, None)  # a group's members: the step before it
    parent, members = by_step[8]  # after a group without a callback: its members' results
    assert parent is None and [m["result"] for m in members] == [60, 70]


def test_a_member_that_dies_reaches_the_callback_as_dead_unless_the_group_skips_it() -> None:
    q, seen = queue()
    with q:
        ran = q.producer.enqueue_workflow(group(t(1), t(2, fail=True), then=t(3)))
        skipped = q.producer.enqueue_workflow(
            chain(group(t(4, fail=True), then=t(5), on_failure="skip"), t(6))
        )
        q.run_until_idle()
        assert ran.status().state == "completed"
        assert (skipped.status().state, skipped.status().counts) == ("failed", {"dead": 1, "skipped": 2})
    members = next(m for n, _, m in seen if n == 3)
    assert [m["state"] for m in members] == ["completed", "dead"]
    assert "2 fails" in members[1]["error"] and members[1]["result"] is None
    assert {n for n, _, _ in seen} == {1, 2, 3, 4}


def test_a_cancelled_workflow_runs_none_of_its_unstarted_steps() -> None:
    q, seen = queue()
    with q:
        receipt = q.producer.enqueue_workflow(chain(group(t(1), t(2)), t(3)))
        assert receipt.cancel() == 2  # both members were staged, neither had started
        q.run_until_idle()
        status = receipt.status()
        assert (status.state, status.cancelled, status.counts) == ("cancelled", True, {"cancelled": 3})
        with pytest.raises(NotCancellableError, match="is cancelled already"):
            receipt.cancel()
    assert seen == [] and q.dead_letters == []


def test_an_invalid_step_or_an_empty_chain_or_group_is_refused_and_nothing_is_enqueued() -> None:
    with pytest.raises(InvalidTaskError, match="at least one step"):
        chain()
    with pytest.raises(InvalidTaskError, match="at least one member"):
        group()
    with pytest.raises(InvalidTaskError, match="on_failure"):
        group(t(1), on_failure="maybe")  # type: ignore[arg-type]
    with pytest.raises(InvalidTaskError, match="TaskSpecs, chains and groups"):
        chain(t(1), "unit.Job")  # type: ignore[arg-type]
    q, _ = queue()
    with q, pytest.raises(taskq.PayloadValidationError):
        q.producer.enqueue_workflow(chain(t(1), TaskSpec(task_type="unit.Job", payload={"n": "x"})))
    assert q.store.workflows.workflows == {}
