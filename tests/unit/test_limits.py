"""Per-key concurrency caps and execution-time rate limits: declarations, and the worker's rules on fakes."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import pytest

from taskq import Handlers, Retry, TaskContext
from taskq._core.durations import parse_rate
from taskq._core.errors import ConfigurationError
from taskq.testing import InMemoryQueue
from tests.acceptance.helpers import wait_until

JOB = {
    "type": "record",
    "name": "Call",
    "namespace": "unit",
    "fields": [{"name": "partner", "type": "string"}, {"name": "n", "type": "long"}],
}


@pytest.mark.parametrize(
    ("text", "per_second", "burst"),
    [("100/s", 100.0, 100.0), ("10/m", 10 / 60, 10.0), ("5/h", 5 / 3600, 5.0), ("20/10s", 2.0, 20.0),
     (" 0.5 / s ", 0.5, 1.0)],
)  # fmt: skip
def test_a_rate_is_a_count_per_period_and_bursts_up_to_the_count(
    text: str, per_second: float, burst: float
) -> None:
    rate = parse_rate(text)
    assert (rate.per_second, rate.burst) == (pytest.approx(per_second), burst)


@pytest.mark.parametrize("text", ["100", "fast", "0/s", "-1/s", "10/x", "10/0s", "/s", "10/s/s"])
def test_a_rate_limit_that_is_not_a_count_per_period_is_refused_naming_the_type(text: str) -> None:
    with pytest.raises(ConfigurationError, match=r"^unit\.Call: rate_limit must be tasks per period"):
        Handlers().task("unit.Call", rate_limit=text)


@pytest.mark.parametrize("limit", [0, -2, 1.5, True, "2"])
def test_a_concurrency_limit_below_one_or_not_a_whole_number_is_refused(limit: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"^unit\.Call: concurrency_limit must be an int >= 1"):
        Handlers().task("unit.Call", concurrency_limit=limit)


def test_a_key_function_needs_its_limit_and_must_be_callable() -> None:
    with pytest.raises(ConfigurationError, match="concurrency_key needs concurrency_limit"):
        Handlers().task("unit.Call", concurrency_key=lambda p: p["partner"])
    with pytest.raises(ConfigurationError, match="rate_key needs rate_limit"):
        Handlers().task("unit.Call", rate_key=lambda p: p["partner"])
    with pytest.raises(ConfigurationError, match="rate_key must be a function of the payload, got str"):
        Handlers().task("unit.Call", rate_limit="1/s", rate_key="partner")  # type: ignore[arg-type]


def test_a_key_function_that_raises_dead_letters_the_task_with_the_reason_and_the_worker_goes_on() -> None:
    handlers = Handlers()
    ran: list[int] = []

    @handlers.task(
        "unit.Call", schema=JOB, concurrency_limit=2, concurrency_key=lambda p: {"a": 1}[p["partner"]]
    )
    def call(payload: dict[str, Any], ctx: TaskContext) -> None:
        ran.append(payload["n"])

    with InMemoryQueue(handlers, namespace="unit") as q:
        q.producer.enqueue("unit.Call", {"partner": "b", "n": 1})
        q.producer.enqueue("unit.Call", {"partner": "a", "n": 2})
        q.run_until_idle(timeout=30)
        (dead,) = q.dead_letters
        assert dead.reason == "concurrency_key raised KeyError: 'b'"
        assert dead.error_type == "taskq.LimitKeyFailed"
        assert ran == [2]


def test_at_most_n_tasks_of_a_key_run_at_once_and_other_keys_go_by() -> None:
    handlers = Handlers()
    changed = threading.Condition()
    running: dict[str, int] = {}
    most: dict[str, int] = {}
    b_done = threading.Event()

    @handlers.task("unit.Call", schema=JOB, concurrency_limit=2, concurrency_key=lambda p: p["partner"])
    def call(payload: dict[str, Any], ctx: TaskContext) -> None:
        key = payload["partner"]
        with changed:
            running[key] = running.get(key, 0) + 1
            most[key] = max(most.get(key, 0), running[key])
            changed.notify_all()
        if key == "a":
            # a's tasks hold their slots until b's task ran: b is not stuck behind a's waiting tasks.
            assert b_done.wait(10)
        else:
            # b runs while two of a's hold both of a's slots (whatever order the threads are scheduled in).
            with changed:
                assert changed.wait_for(lambda: running.get("a", 0) == 2, timeout=10), running
            b_done.set()
        with changed:
            running[key] -= 1

    with InMemoryQueue(handlers, namespace="unit", concurrency=8) as q:
        for n in range(10):
            q.producer.enqueue("unit.Call", {"partner": "a", "n": n}, key="k")
        q.producer.enqueue("unit.Call", {"partner": "b", "n": 99}, key="k")  # behind a's, same partition
        q.run_until_idle(timeout=30)
        assert len(q.completed) == 11 and not q.dead_letters
        assert most == {"a": 2, "b": 1}
        assert q.store.retries() == (0, 0)  # waiting used up no attempt
        assert q.store.slots == {}  # every slot given back


def test_a_rate_limited_key_starts_at_its_rate_and_a_retry_delay_pauses_its_bucket() -> None:
    handlers = Handlers()
    starts: list[tuple[str, int, float]] = []
    clock: list[Any] = []

    @handlers.task("unit.Call", schema=JOB, rate_limit="2/s", rate_key=lambda p: p["partner"], max_attempts=3)
    def call(payload: dict[str, Any], ctx: TaskContext) -> None:
        starts.append((payload["partner"], payload["n"], clock[0].time()))
        if payload["n"] == 0 and ctx.attempt == 1:
            raise Retry(delay=30)  # the partner answered 429, Retry-After: 30

    with InMemoryQueue(handlers, namespace="unit", concurrency=4) as q:
        clock.append(q.clock)
        for n in range(6):
            q.producer.enqueue("unit.Call", {"partner": "a", "n": n}, key="k")
        q.run_until_idle(timeout=30)
        assert len(q.completed) == 6 and not q.dead_letters
        times = [t for _, _, t in starts]
        first = times[0]
        # A burst of 2, then a pause of 30 s after the 429, then 2 a second again (the fake clock leaps).
        assert times[1] - first < 1
        assert all(t >= first + 30 for t in times[2:]), times
        later = sorted(times[2:])
        assert all(b - a > 0.4 for a, b in itertools.pairwise(later)), later
        assert q.store.retries() == (1, 1)  # only the task told to retry used a second attempt


def test_a_task_waiting_for_its_key_keeps_its_claim_renewed_and_its_attempt() -> None:
    handlers = Handlers()
    first_running, release = threading.Event(), threading.Event()

    @handlers.task("unit.Call", schema=JOB, concurrency_limit=1)
    def call(payload: dict[str, Any], ctx: TaskContext) -> None:
        if payload["n"] == 0:
            first_running.set()
            assert release.wait(10)

    with InMemoryQueue(handlers, namespace="unit") as q:
        for n in range(2):
            q.producer.enqueue("unit.Call", {"partner": "a", "n": n}, idempotency_key=f"call-{n}")
        runner = threading.Thread(target=q.run_until_idle, kwargs={"timeout": 30})
        runner.start()
        try:
            assert first_running.wait(10)
            waiting = q.store.rows["call-1"]
            claimed_until = waiting.lease_expires_at or 0.0
            # Far past its claim's lease (300 s run + 10 s wait): the loop renews it while it waits.
            q.clock.advance(400)
            wait_until(
                lambda: (waiting.lease_expires_at or 0.0) > claimed_until + 390,
                timeout=10,
                what="the waiting task's claim to be renewed",
            )
        finally:
            release.set()
            runner.join(30)
        assert len(q.completed) == 2
        assert [q.store.rows[f"call-{n}"].attempts for n in range(2)] == [1, 1]
