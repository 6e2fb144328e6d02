"""Pausing a tier or a task type on the in-memory fakes: nothing of it starts, its claims stay leased, and
after the resume each task runs once, on its first attempt."""

from __future__ import annotations

from typing import Any

from taskq import Handlers, TaskContext
from taskq.consumer.scheduler import PriorityScheduler
from taskq.testing import InMemoryStore
from tests.unit.test_worker_on_fakes import JOB, Parts, run

OTHER = {**JOB, "name": "Other"}


def test_the_scheduler_passes_over_skipped_tiers_and_keeps_their_items() -> None:
    s: PriorityScheduler[str] = PriorityScheduler(capacity=8)
    s.push("low", "l1")
    s.push("normal", "n1")
    assert s.pop(skip={"normal"}) == "l1"
    assert s.pop(skip={"normal"}) is None
    assert len(s) == 1
    assert s.pop() == "n1"


def test_paused_tier_and_type_hold_their_tasks_until_resumed_then_each_runs_once() -> None:
    handlers, runs = Handlers(), []

    @handlers.task("unit.Job", schema=JOB)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        runs.append(("job", payload["n"], ctx.attempt))

    @handlers.task("unit.Other", schema=OTHER)
    def other(payload: dict[str, Any], ctx: TaskContext) -> None:
        runs.append(("other", payload["n"], ctx.attempt))

    parts = Parts(handlers)
    parts.registry.register(OTHER)
    worker = parts.worker("a", pause_interval=0.5)
    store = worker.store
    assert isinstance(store, InMemoryStore)
    store.pause("tier", "low")
    store.pause("task_type", "unit.Other")
    for n in range(3):
        parts.producer.enqueue("unit.Job", {"n": n}, priority="low", idempotency_key=f"low-{n}")
        parts.producer.enqueue("unit.Job", {"n": n}, idempotency_key=f"normal-{n}")
        parts.producer.enqueue("unit.Other", {"n": n}, idempotency_key=f"other-{n}")
    parts.producer.flush()

    run(worker, lambda: len(runs) == 3, "the tasks of the normal tier's unpaused type")
    assert sorted(runs) == [("job", n, 1) for n in range(3)]
    # Held past their leases' renewal point: still leased to this worker, still on their first attempt.
    parts.clock.advance(worker.config.default_lease + 2 * worker.config.claim_wait)
    for _ in range(50):
        worker.step()
    assert len(runs) == 3
    held = [parts.rows[k] for k in parts.rows if not k.startswith("normal")]
    assert held and all(r.state == "running" and r.lease_owner == "a" and r.attempts == 1 for r in held)
    assert all(r.lease_expires_at > parts.clock.time() for r in held)

    store.resume("tier", "low")
    store.resume("task_type", "unit.Other")
    parts.clock.advance(1.0)
    run(worker, lambda: len(runs) == 9, "every task after the resume")
    assert sorted(runs) == sorted([(kind, n, 1) for kind in ("job", "job", "other") for n in range(3)]), (
        "each task ran once, on its first attempt"
    )
    run(worker, worker.idle, "the worker to settle")
    worker.close()
