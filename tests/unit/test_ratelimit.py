import random
import threading

import pytest

from taskq.producer.ratelimit import TokenBucket


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_starts_full_and_empties():
    clock = FakeClock()
    bucket = TokenBucket(rate=2, capacity=5, clock=clock)
    assert bucket.available() == 5
    assert [bucket.try_take() for _ in range(5)] == [0.0] * 5
    assert bucket.try_take() == pytest.approx(0.5)
    assert bucket.available() == 0


def test_refused_take_takes_nothing():
    clock = FakeClock()
    bucket = TokenBucket(rate=1, capacity=3, clock=clock)
    assert bucket.try_take(2) == 0.0
    assert bucket.try_take(3) == pytest.approx(2.0)
    assert bucket.available() == pytest.approx(1.0)


def test_refill_is_capped_at_capacity():
    clock = FakeClock()
    bucket = TokenBucket(rate=10, capacity=4, clock=clock)
    bucket.try_take(4)
    clock.advance(3600)
    assert bucket.available() == 4


@pytest.mark.parametrize(("rate", "capacity", "n"), [(3, 1, 1), (7.3, 10, 2.5), (0.1, 1, 1), (1000, 50, 13)])
def test_retry_after_is_exact(rate, capacity, n):
    clock = FakeClock(12345.678)
    bucket = TokenBucket(rate=rate, capacity=capacity, clock=clock)
    rng = random.Random(3)
    for _ in range(200):
        wait = bucket.try_take(n)
        if wait == 0.0:
            clock.advance(rng.random() * n / rate)
            continue
        clock.advance(wait * (1 - 1e-6))
        assert bucket.try_take(n) > 0.0
        clock.advance(wait * 1e-6)
        assert bucket.try_take(n) == 0.0


@pytest.mark.parametrize("seed", range(10))
def test_never_more_than_rate_times_t_plus_capacity(seed):
    rng = random.Random(seed)
    clock = FakeClock()
    rate, capacity = 5.0, 20.0
    bucket = TokenBucket(rate=rate, capacity=capacity, clock=clock)
    start = clock.now
    taken = 0.0
    for _ in range(5000):
        clock.advance(rng.choice([0, 0, 0.001, 0.05, 0.3, 2]))
        n = rng.choice([1, 1, 2, 5])
        if bucket.try_take(n) == 0.0:
            taken += n
        assert taken <= rate * (clock.now - start) + capacity + 1e-6


def test_add_puts_back_unused_tokens_up_to_capacity():
    clock = FakeClock()
    bucket = TokenBucket(rate=1, capacity=10, clock=clock)
    bucket.try_take(8)
    bucket.add(3)
    assert bucket.available() == 5
    bucket.add(100)
    assert bucket.available() == 10
    with pytest.raises(ValueError, match="got -1"):
        bucket.add(-1)


def test_clock_stepping_back_removes_nothing():
    clock = FakeClock()
    bucket = TokenBucket(rate=1, capacity=10, clock=clock)
    bucket.try_take(5)
    clock.advance(-100)
    assert bucket.available() == 5


def test_thread_safe_under_contention():
    clock = FakeClock()
    bucket = TokenBucket(rate=1, capacity=1000, clock=clock)
    granted = []

    def worker() -> None:
        granted.append(sum(1 for _ in range(500) if bucket.try_take() == 0.0))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(granted) == 1000


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate": 0, "capacity": 1}, "rate must be > 0 tokens/s, got 0"),
        ({"rate": -1, "capacity": 1}, "rate must be > 0"),
        ({"rate": float("nan"), "capacity": 1}, "rate must be > 0"),
        ({"rate": 1, "capacity": 0.5}, "capacity must be >= 1 token, got 0.5"),
    ],
)
def test_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TokenBucket(**kwargs)


@pytest.mark.parametrize("n", [0, -1, 11])
def test_take_outside_capacity_is_an_error(n):
    bucket = TokenBucket(rate=1, capacity=10, clock=FakeClock())
    with pytest.raises(ValueError, match=r"capacity \(10\)"):
        bucket.try_take(n)
