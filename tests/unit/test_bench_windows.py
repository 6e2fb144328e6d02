"""The windows of `bench latency`'s report: tasks by the time their send was due, completions by completion
time."""

from __future__ import annotations

from taskq._core.envelope import PRIORITIES
from taskq.tools.bench.latency import _key, _tier, _windows


def test_windows_count_tasks_by_their_due_time_and_completions_by_completion_time() -> None:
    t0 = 100.0
    a, b, c, d = (_key(i) for i in range(4))
    due = {a: 0.0, b: 1.5, c: 2.0, d: 3.9}  # seconds from t0
    enqueued = {a: 100.0, b: 101.5, c: 102.0, d: 104.2}  # d: a send late past the schedule's end
    started = {a: 100.01, b: 101.6, c: 102.4, d: 104.3}
    completed = {a: 100.02, b: 102.1, c: 102.5, d: 104.4}  # d completes after the last window
    first, last = _windows(t0, 4.0, 2.0, due, enqueued, started, completed)
    assert (first["from_s"], first["to_s"], first["enqueued"], first["completed"]) == (0.0, 2.0, 2, 1)
    assert (last["from_s"], last["to_s"], last["enqueued"], last["completed"]) == (2.0, 4.0, 2, 2)
    assert first["completed_per_s"] == 0.5 and last["completed_per_s"] == 1.0
    assert round(first["enqueue_to_start_ms"]["max"], 6) == 100.0
    assert round(last["enqueue_to_start_ms"]["max"], 6) == 400.0


def test_a_last_window_shorter_than_the_others_is_rated_over_its_own_length() -> None:
    a = _key(0)
    windows = _windows(0.0, 5.0, 2.0, {a: 4.5}, {a: 4.5}, {a: 4.6}, {a: 4.7})
    assert [(w["from_s"], w["to_s"], w["completed_per_s"]) for w in windows] == [
        (0.0, 2.0, 0.0),
        (2.0, 4.0, 0.0),
        (4.0, 5.0, 1.0),
    ]
    assert windows[0]["enqueue_to_start_ms"]["p99"] is None


def test_a_send_made_late_counts_in_the_window_it_was_due_in_and_its_wait_from_the_send() -> None:
    # The 200th send of 100/s was due at 1.99 s; a busy machine made it at 2.01 s. It is the first window's:
    # a window of the schedule holds rate x window sends however late some of them went out.
    due = {_key(i): i / 100 for i in range(400)}
    enqueued = {**due, _key(199): 2.01}
    started = {k: t + 0.005 for k, t in enqueued.items()}
    windows = _windows(0.0, 4.0, 2.0, due, enqueued, started, started)
    assert [(w["from_s"], w["to_s"], w["enqueued"]) for w in windows] == [(0.0, 2.0, 200), (2.0, 4.0, 200)]
    assert round(windows[0]["enqueue_to_start_ms"]["max"], 6) == 5.0


def test_each_window_gives_the_p99_of_each_tier_by_the_keys_the_run_sent() -> None:
    # The run deals its sends to the tiers in turn; a worker behind its schedule keeps the lighter tiers
    # waiting longest, so the window's p99 of all is the lightest tier's, and each tier has its own.
    assert [_tier(_key(i)) for i in range(6)] == [*PRIORITIES, *PRIORITIES[:2]]
    waits = {"critical": 0.001, "high": 0.002, "normal": 0.004, "low": 0.8}
    due = {_key(i): i / 100 for i in range(400)}
    started = {key: t + waits[_tier(key)] for key, t in due.items()}
    started.pop(_key(3))  # a low task that never started (the run's timeout): none of the figures
    for w in _windows(0.0, 4.0, 2.0, due, due, started, started):
        by_tier = {tier: round(p99, 6) for tier, p99 in w["enqueue_to_start_p99_ms_by_tier"].items()}
        assert by_tier == {"critical": 1.0, "high": 2.0, "normal": 4.0, "low": 800.0}
        assert round(w["enqueue_to_start_ms"]["p99"], 6) == 800.0
    empty = _windows(0.0, 2.0, 2.0, {_key(0): 0.5}, {_key(0): 0.5}, {_key(0): 0.6}, {})
    by_tier = {
        tier: p99 and round(p99, 6) for tier, p99 in empty[0]["enqueue_to_start_p99_ms_by_tier"].items()
    }
    assert by_tier == {"critical": 100.0, "high": None, "normal": None, "low": None}
