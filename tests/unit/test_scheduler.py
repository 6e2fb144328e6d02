import random
from collections import Counter

import pytest

from taskq._core.envelope import DEFAULT_WEIGHTS, PRIORITIES
from taskq.consumer.scheduler import PriorityScheduler

BIG = 10**6


def full(capacity=BIG, per_tier=1000, weights=DEFAULT_WEIGHTS):
    sched = PriorityScheduler(weights=weights, capacity=capacity)
    for tier in PRIORITIES:
        for i in range(per_tier):
            sched.push(tier, (tier, i))
    return sched


def tiers_of(sched, n):
    return [item[0] for item in (sched.pop() for _ in range(n))]


@pytest.mark.parametrize("cycles", [1, 2, 7, 40])
def test_exact_shares_over_whole_cycles(cycles):
    picks = tiers_of(full(), 15 * cycles)
    assert Counter(picks) == {tier: w * cycles for tier, w in DEFAULT_WEIGHTS.items()}


def test_every_window_of_one_cycle_has_exact_shares():
    picks = tiers_of(full(), 15 * 20)
    for start in range(len(picks) - 15 + 1):
        assert Counter(picks[start : start + 15]) == DEFAULT_WEIGHTS


def test_picks_are_interleaved():
    picks = tiers_of(full(), 15 * 10)
    critical_runs = "".join("c" if p == "critical" else "." for p in picks).split(".")
    assert max(len(run) for run in critical_runs) <= 2
    first_cycle = picks[:15]
    assert first_cycle[0] == "critical"
    assert first_cycle.index("high") <= 2
    for start in range(0, len(picks), 15):
        assert "low" in picks[start : start + 15]


def test_work_conserving_with_empty_tiers():
    sched = PriorityScheduler(capacity=BIG)
    for i in range(30):
        sched.push("normal", ("normal", i))
        sched.push("low", ("low", i))
    picks = tiers_of(sched, 30)
    # Only normal (2) and low (1) wait: 2:1, and nothing is lost to the idle tiers' turns.
    assert Counter(picks) == {"normal": 20, "low": 10}
    assert len(sched) == 30
    sched = PriorityScheduler(capacity=BIG)
    sched.push("low", "only")
    assert sched.pop() == "only"
    assert sched.pop() is None


def test_pop_on_empty_is_none():
    assert PriorityScheduler(capacity=4).pop() is None


def test_no_burst_after_tier_was_empty_for_long():
    sched = PriorityScheduler(capacity=BIG)
    for i in range(5000):
        sched.push("low", ("low", i))
        sched.push("normal", ("normal", i))
    tiers_of(sched, 3000)  # critical and high idle all along
    for tier in ("critical", "high"):
        for i in range(1000):
            sched.push(tier, (tier, i))
    picks = tiers_of(sched, 150)
    for start in range(len(picks) - 15 + 1):
        window = Counter(picks[start : start + 15])
        for tier, weight in DEFAULT_WEIGHTS.items():
            assert window[tier] <= weight + 1


@pytest.mark.parametrize("seed", range(50))
def test_bounded_burst_and_wait_after_any_history(seed):
    rng = random.Random(seed)
    sched = PriorityScheduler(capacity=BIG)
    for step in range(rng.randrange(1, 300)):
        for tier in PRIORITIES:
            if rng.random() < rng.choice([0.05, 0.3, 0.6]):
                sched.push(tier, (tier, step))
        sched.pop()
    for tier in PRIORITIES:
        for i in range(200):
            sched.push(tier, (tier, i))
    picks = tiers_of(sched, 90)
    for start in range(len(picks) - 15 + 1):
        window = Counter(picks[start : start + 15])
        assert all(window[tier] <= weight + 1 for tier, weight in DEFAULT_WEIGHTS.items())
    assert "low" in picks[:17]
    # Once every tier stays busy, whole cycles are exact again.
    later = tiers_of(sched, 15 * 8)
    assert all(abs(Counter(later)[t] - 8 * w) <= 2 for t, w in DEFAULT_WEIGHTS.items())


def test_custom_weights():
    weights = {"critical": 3, "high": 3, "normal": 1, "low": 1}
    picks = tiers_of(full(weights=weights), 8 * 5)
    assert Counter(picks) == {tier: 5 * w for tier, w in weights.items()}
    equal = dict.fromkeys(PRIORITIES, 1)
    assert tiers_of(full(weights=equal), 8) == list(PRIORITIES) * 2


def test_fifo_within_a_tier():
    sched = full(per_tier=50)
    popped = [sched.pop() for _ in range(200)]
    for tier in PRIORITIES:
        assert [i for t, i in popped if t == tier] == list(range(50))


def test_len_and_depth():
    sched = PriorityScheduler(capacity=100)
    sched.push("high", 1)
    sched.push("high", 2)
    sched.push("low", 3)
    assert len(sched) == 3
    assert [sched.depth(t) for t in PRIORITIES] == [0, 2, 0, 1]
    sched.pop()
    assert len(sched) == 2


def test_remove_if_keeps_fifo_of_rest_and_returns_removed():
    sched = PriorityScheduler(capacity=100)
    for i in range(10):
        sched.push("normal", ("p0" if i % 3 == 0 else "p1", i))
        sched.push("critical", ("p0", 100 + i))
    removed = sched.remove_if(lambda item: item[0] == "p0")
    assert removed == [("p0", 100 + i) for i in range(10)] + [("p0", i) for i in (0, 3, 6, 9)]
    assert len(sched) == 6
    assert sched.depth("critical") == 0
    assert [sched.pop() for _ in range(6)] == [("p1", i) for i in (1, 2, 4, 5, 7, 8)]
    assert sched.pop() is None
    assert sched.remove_if(lambda item: True) == []


def test_reserves_sum_to_at_most_capacity_for_any_weights():
    for weights in (DEFAULT_WEIGHTS, {"critical": 1000, "high": 1, "normal": 1, "low": 1}):
        for capacity in range(4, 400):
            sched = PriorityScheduler(weights=weights, capacity=capacity)
            reserves = [sched.reserve(t) for t in PRIORITIES]
            assert min(reserves) >= 1
            assert sum(reserves) <= capacity


def test_empty_tier_is_never_saturated():
    sched = PriorityScheduler(capacity=100)
    while not sched.saturated("critical"):
        sched.push("critical", "x")
    assert len(sched) <= 100
    for tier in ("high", "normal", "low"):
        assert sched.depth(tier) == 0
        assert not sched.saturated(tier)


def test_saturation_rule_reserve_and_pool():
    sched = PriorityScheduler(capacity=100)
    reserve = {t: sched.reserve(t) for t in PRIORITIES}
    assert reserve == {"critical": 25, "high": 13, "normal": 7, "low": 4}
    # A lone tier may use its reserve plus the pool (capacity - all reserves).
    pool = 100 - sum(reserve.values())
    for _ in range(reserve["low"] + pool):
        assert not sched.saturated("low")
        sched.push("low", "x")
    assert sched.saturated("low")
    # The others can still fill their reserves, and then pause.
    for tier in ("critical", "high", "normal"):
        for _ in range(reserve[tier]):
            assert not sched.saturated(tier)
            sched.push(tier, "x")
        assert sched.saturated(tier)
    assert len(sched) == 100
    # Draining the borrower reopens the pool to everyone.
    sched.remove_if(lambda item: True)
    assert not any(sched.saturated(t) for t in PRIORITIES)


@pytest.mark.parametrize("seed", range(30))
def test_pausing_saturated_tiers_bounds_memory_and_starves_no_tier(seed):
    rng = random.Random(seed)
    capacity = rng.choice([4, 5, 16, 100])
    sched = PriorityScheduler(capacity=capacity)
    served = Counter()
    for _ in range(3000):
        # A fetch delivers a record of a random tier unless that tier is paused.
        tier = rng.choice(PRIORITIES)
        if not sched.saturated(tier):
            sched.push(tier, tier)
        assert len(sched) <= capacity
        assert all(sched.depth(t) <= capacity for t in PRIORITIES)
        if rng.random() < 0.3:
            item = sched.pop()
            if item is not None:
                served[item] += 1
    assert all(served[t] > 0 for t in PRIORITIES)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capacity": 3}, r"capacity must be an int >= 4 \(one task per tier\), got 3"),
        ({"capacity": 0}, "capacity must be an int >= 4"),
        ({"capacity": 10.0}, "capacity must be an int >= 4"),
        (
            {"capacity": 10, "weights": {"critical": 8, "high": 4, "normal": 0, "low": 1}},
            "weight of tier 'normal' must be an int >= 1, got 0",
        ),
        (
            {"capacity": 10, "weights": {"critical": 8, "high": 2.5, "normal": 2, "low": 1}},
            "weight of tier 'high' must be an int >= 1, got 2.5",
        ),
        (
            {"capacity": 10, "weights": {"critical": True, "high": 4, "normal": 2, "low": 1}},
            "weight of tier 'critical' must be an int >= 1, got True",
        ),
        (
            {"capacity": 10, "weights": {"critical": 8, "high": 4, "normal": 2}},
            "weight of tier 'low' missing",
        ),
        (
            {"capacity": 10, "weights": {**DEFAULT_WEIGHTS, "urgent": 9}},
            r"unknown tiers in weights: \['urgent'\]",
        ),
    ],
)
def test_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PriorityScheduler(**kwargs)


def test_resizing_moves_the_reserves_and_the_bound_and_keeps_what_is_buffered():
    # A worker starts with a small buffer (its first wave waits for less) and widens it once running.
    sched = PriorityScheduler(capacity=100)
    for tier in PRIORITIES:
        while not sched.saturated(tier):
            sched.push(tier, (tier, 0))
    assert len(sched) == 100
    sched.resize(400)
    assert sched.capacity == 400
    assert {t: sched.reserve(t) for t in PRIORITIES} == {"critical": 105, "high": 53, "normal": 27, "low": 14}
    assert len(sched) == 100 and not any(sched.saturated(t) for t in PRIORITIES)
    for tier in PRIORITIES:
        while not sched.saturated(tier):
            sched.push(tier, (tier, 0))
    assert len(sched) == 400
    assert Counter(tiers_of(sched, 15)) == DEFAULT_WEIGHTS  # the weights hold across the resize
    with pytest.raises(ValueError, match=r"capacity must be an int >= 4 \(one task per tier\), got 3"):
        sched.resize(3)
    assert sched.capacity == 400
