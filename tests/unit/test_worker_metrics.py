"""The worker's Prometheus metrics, counted per loop pass: the values /metrics shows, in-process and in
multiprocess mode (`taskq worker --processes N`)."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Histogram, values
from prometheus_client.multiprocess import MultiProcessCollector

from taskq import Handlers, Reject, TaskContext
from taskq.consumer.events import (
    AttemptFailed,
    AttemptStarted,
    AttemptSucceeded,
    CancelledSkipped,
    DeadLettered,
    DuplicateSkipped,
    Tally,
    TaskCompleted,
    TaskRetried,
)
from taskq.consumer.metrics import _LATENCY, PrometheusHook
from taskq.consumer.worker import Worker, WorkerConfig
from taskq.testing import InMemoryQueue

SEND = {"type": "record", "name": "Send", "namespace": "shop", "fields": [{"name": "to", "type": "string"}]}
#: On the buckets' bounds, between them, below the first and past the last.
AMOUNTS = [0.0, 0.004, 0.005, 0.0051, 0.7, 1.0, 2.5, 299.0, 300.0, 301.0, 1e6, 0.7, 0.7]


def _handlers() -> Handlers:
    handlers = Handlers()

    @handlers.task("shop.Send", schema=SEND, max_attempts=3, timeout=5)
    def send(payload: dict[str, Any], ctx: TaskContext) -> None:
        if payload["to"] == "flaky" and ctx.attempt == 1:
            raise ConnectionError("mail server busy")
        if payload["to"] == "nobody":
            raise Reject("no such address")

    return handlers


def _enqueue(q: InMemoryQueue) -> None:
    for n in range(20):
        q.producer.enqueue("shop.Send", {"to": f"{n}@example.com"}, idempotency_key=f"welcome:{n}")
    q.producer.enqueue("shop.Send", {"to": "0@example.com"}, idempotency_key="welcome:0")  # a duplicate
    q.producer.enqueue("shop.Send", {"to": "flaky"}, idempotency_key="welcome:flaky")
    q.producer.enqueue("shop.Send", {"to": "nobody"}, idempotency_key="welcome:nobody")


PER_TASK = (
    AttemptStarted,
    AttemptSucceeded,
    AttemptFailed,
    TaskCompleted,
    TaskRetried,
    DuplicateSkipped,
    CancelledSkipped,
    DeadLettered,
)


def _value(hook: PrometheusHook, name: str, **labels: str) -> float:
    return hook.registry.get_sample_value(name, labels) or 0.0


def test_the_metrics_count_every_attempt_once_each_pass_is_over() -> None:
    with InMemoryQueue(_handlers()) as q:
        hook, events, step = q.worker.metrics, q.events, q.worker.step
        t = {"task_type": "shop.Send"}
        passes = []

        def checked_step() -> None:
            # After every pass, what /metrics shows is what the pass's events said: no more lag than a pass.
            step()
            passes.append(None)
            assert _value(hook, "taskq_tasks_started_total", **t) == len(events.of(AttemptStarted))
            assert _value(hook, "taskq_tasks_succeeded_total", **t) == len(events.of(AttemptSucceeded))
            ended = len(events.of(AttemptSucceeded)) + len(events.of(AttemptFailed))
            assert _value(hook, "taskq_processing_seconds_count", **t) == ended

        q.worker.step = checked_step  # type: ignore[method-assign]
        _enqueue(q)
        q.run_until_idle()

        assert len(passes) > 3
        assert _value(hook, "taskq_tasks_started_total", **t) == 23  # 21 keys, the flaky one twice
        assert _value(hook, "taskq_tasks_succeeded_total", **t) == 21
        assert _value(hook, "taskq_tasks_failed_total", **t) == 2
        assert _value(hook, "taskq_tasks_retried_total", **t) == 1
        assert _value(hook, "taskq_duplicates_skipped_total", **t) == len(events.of(DuplicateSkipped)) == 1
        assert _value(hook, "taskq_tasks_dead_lettered_total", reason="Reject") == 1
        assert _value(hook, "taskq_processing_seconds_count", **t) == 23
        assert _value(hook, "taskq_processing_seconds_bucket", le="+Inf", **t) == 23
        assert _value(hook, "taskq_enqueue_to_completion_seconds_count", **t) == 21
        assert len(events.of(TaskRetried)) == 1


def _samples(registry: CollectorRegistry, name: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        if family.name == name
        for s in family.samples
        if not s.name.endswith("_created")
    }


def _applied(registry: CollectorRegistry) -> PrometheusHook:
    """A hook given one pass's tally of AMOUNTS (as attempts that failed) and a succeeded one."""
    hook = PrometheusHook(registry)
    tally = Tally()
    tally.ran["shop.Send"] += AMOUNTS
    tally.failed["shop.Send"] += len(AMOUNTS)
    hook.apply(tally)
    return hook


def _observed(registry: CollectorRegistry) -> None:
    """AMOUNTS observed one by one, as the hook did per event before."""
    histogram = Histogram(
        "taskq_processing_seconds",
        "Wall time of one attempt",
        ["task_type"],
        buckets=_LATENCY,
        registry=registry,
    )
    for amount in AMOUNTS:
        histogram.labels("shop.Send").observe(amount)


def test_a_pass_applied_at_once_reads_as_each_attempt_observed_in_turn() -> None:
    applied, observed = CollectorRegistry(), CollectorRegistry()
    _applied(applied)
    _observed(observed)
    assert _samples(applied, "taskq_processing_seconds") == pytest.approx(
        _samples(observed, "taskq_processing_seconds")
    )
    buckets = _samples(applied, "taskq_processing_seconds")
    assert buckets[("taskq_processing_seconds_bucket", (("le", "0.005"), ("task_type", "shop.Send")))] == 3
    assert buckets[("taskq_processing_seconds_bucket", (("le", "300.0"), ("task_type", "shop.Send")))] == 11


def test_a_pass_applied_at_once_reads_the_same_in_multiprocess_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What `taskq worker --processes N` does: PROMETHEUS_MULTIPROC_DIR set before any metric is created,
    # every value an mmapped file per process, summed by the supervisor's collector.
    def collected(directory: Path, feed: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        directory.mkdir()
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
        monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())
        feed(CollectorRegistry())
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(directory))  # type: ignore[no-untyped-call]
        return _samples(registry, "taskq_processing_seconds")

    applied = collected(tmp_path / "applied", _applied)
    observed = collected(tmp_path / "observed", _observed)
    assert applied == pytest.approx(observed)
    assert applied[("taskq_processing_seconds_count", (("task_type", "shop.Send"),))] == len(AMOUNTS)


def test_counters_take_a_pass_as_many_increments_and_the_age_is_from_enqueue() -> None:
    hook = PrometheusHook(CollectorRegistry())
    tally = Tally()
    tally.started.update({"a": 3, "b": 1})
    tally.quarantined["b"] += 1
    tally.ran["a"] += [0.01, 0.02, 0.03]
    tally.succeeded["a"] += [datetime.now(UTC) - timedelta(seconds=s) for s in (0.5, 20, 400)]
    tally.retried["b"] += 1
    tally.dead_lettered.update(Counter({"builtins.RuntimeError": 2, "taskq.PoisonPill": 1}))
    hook.apply(tally)
    hook.apply(tally)  # a second pass adds to the first
    assert _value(hook, "taskq_tasks_started_total", task_type="a") == 6
    assert _value(hook, "taskq_quarantined_runs_total", task_type="b") == 2
    assert _value(hook, "taskq_tasks_succeeded_total", task_type="a") == 6
    assert _value(hook, "taskq_tasks_retried_total", task_type="b") == 2
    assert _value(hook, "taskq_tasks_dead_lettered_total", reason="RuntimeError") == 4
    assert _value(hook, "taskq_tasks_dead_lettered_total", reason="PoisonPill") == 2
    end_to_end = "taskq_enqueue_to_completion_seconds_bucket"
    assert _value(hook, end_to_end, task_type="a", le="1.0") == 2
    assert _value(hook, end_to_end, task_type="a", le="30.0") == 4
    assert _value(hook, end_to_end, task_type="a", le="300.0") == 4
    assert _value(hook, end_to_end, task_type="a", le="+Inf") == 6
    # A task type seen only in a pass's other counts still shows every series of its own, at 0.
    assert hook.registry.get_sample_value("taskq_tasks_failed_total", {"task_type": "b"}) == 0


def _counted(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Every per-task event built from now on, counted by type (wherever the code that builds it lives)."""
    built: Counter[str] = Counter()
    for kind in PER_TASK:

        def counting(self: Any, *args: Any, __init: Any = kind.__init__, **kwargs: Any) -> None:
            built[type(self).__name__] += 1
            __init(self, *args, **kwargs)

        monkeypatch.setattr(kind, "__init__", counting)
    return built


def test_a_worker_without_hooks_builds_no_per_task_event_and_one_with_a_hook_hands_it_every_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built = _counted(monkeypatch)
    expected = {
        "AttemptStarted": 23,  # 21 keys, the flaky one twice
        "AttemptSucceeded": 21,
        "AttemptFailed": 2,
        "TaskCompleted": 21,
        "TaskRetried": 1,
        "DuplicateSkipped": 1,
        "DeadLettered": 1,
    }
    with InMemoryQueue(_handlers()) as q:
        # The queue's worker again, without the queue's RecordingHook: production's usual worker.
        q.worker = Worker(
            q.worker.handlers,
            q.settings,
            WorkerConfig(forwarder=False, commit_interval=0.001, worker_id="in-memory"),
            broker=q.broker,
            store=q.store,
            registry=q.registry,
            clock=q.clock.monotonic,
        )
        _enqueue(q)
        q.run_until_idle()
        assert built == Counter()
        # The metrics counted every task all the same.
        hook, t = q.worker.metrics, {"task_type": "shop.Send"}
        assert _value(hook, "taskq_tasks_started_total", **t) == expected["AttemptStarted"]
        assert _value(hook, "taskq_tasks_succeeded_total", **t) == expected["AttemptSucceeded"]
        assert _value(hook, "taskq_tasks_failed_total", **t) == expected["AttemptFailed"]
        assert _value(hook, "taskq_tasks_retried_total", **t) == expected["TaskRetried"]
        assert _value(hook, "taskq_duplicates_skipped_total", **t) == expected["DuplicateSkipped"]
        assert _value(hook, "taskq_tasks_dead_lettered_total", reason="Reject") == expected["DeadLettered"]
        assert _value(hook, "taskq_enqueue_to_completion_seconds_count", **t) == expected["AttemptSucceeded"]

    with InMemoryQueue(_handlers()) as q:  # its worker has a hook: every per-task event, as before
        _enqueue(q)
        q.run_until_idle()
        delivered = Counter(type(e).__name__ for e in q.events.events if isinstance(e, PER_TASK))
        assert delivered == built == expected


def test_an_enqueue_time_ahead_of_this_hosts_clock_counts_as_no_wait() -> None:
    # The sender's clock ahead of the worker's: the task's age is negative, and counts as 0 s.
    hook = PrometheusHook(CollectorRegistry())
    tally = Tally()
    tally.succeeded["a"] += [datetime.now(UTC) + timedelta(seconds=5), datetime.now(UTC) - timedelta(seconds=2)]
    hook.apply(tally)
    assert _value(hook, "taskq_enqueue_to_completion_seconds_bucket", task_type="a", le="0.005") == 1
    assert _value(hook, "taskq_enqueue_to_completion_seconds_bucket", task_type="a", le="+Inf") == 2
    total = hook.registry.get_sample_value("taskq_enqueue_to_completion_seconds_sum", {"task_type": "a"})
    assert total == pytest.approx(2.0, abs=0.5)
