import random
from datetime import timedelta

import pytest

from taskq.consumer.retry import Retry, RetryPolicy


class Poison(Exception):
    pass


def test_backoff_doubles_within_jitter_band_and_never_exceeds_cap():
    policy = RetryPolicy(max_attempts=100, base=timedelta(seconds=1), cap=timedelta(minutes=1), jitter=0.2)
    rng = random.Random(7)
    for attempt in range(1, 30):
        for _ in range(50):
            delay = policy.next_delay(attempt, RuntimeError(), rng=rng)
            assert delay is not None
            backoff = timedelta(seconds=1) * 2 ** (attempt - 1)
            assert min(backoff * 0.8, policy.cap) <= delay <= min(backoff, policy.cap)


def test_no_jitter_is_exact_exponential_backoff():
    policy = RetryPolicy(base=timedelta(milliseconds=500), cap=timedelta(seconds=3), jitter=0, max_attempts=9)
    delays = [policy.next_delay(a, ValueError()) for a in range(1, 9)]
    assert delays == [timedelta(seconds=s) for s in (0.5, 1, 2, 3, 3, 3, 3, 3)]


def test_jitter_is_deterministic_given_rng_and_actually_spreads():
    policy = RetryPolicy(max_attempts=10)
    first = [policy.next_delay(4, OSError(), rng=random.Random(42)) for _ in range(3)]
    assert len(set(first)) == 1
    spread = {policy.next_delay(4, OSError(), rng=random.Random(seed)) for seed in range(20)}
    assert len(spread) > 10


def test_huge_attempt_numbers_are_capped_not_overflowing():
    policy = RetryPolicy(max_attempts=10**6, jitter=0)
    assert policy.next_delay(10**5, RuntimeError()) == policy.cap


@pytest.mark.parametrize("attempt", [5, 6, 100])
def test_exhausted_attempts_dead_letter(attempt):
    assert RetryPolicy(max_attempts=5).next_delay(attempt, RuntimeError()) is None


def test_last_attempt_before_limit_still_retries():
    assert RetryPolicy(max_attempts=5).next_delay(4, RuntimeError()) is not None


def test_max_attempts_one_never_retries():
    assert RetryPolicy(max_attempts=1).next_delay(1, Retry(delay=1)) is None


def test_non_retryable_errors_dead_letter_including_subclasses():
    class WorsePoison(Poison):
        pass

    policy = RetryPolicy(non_retryable=(Poison, KeyError))
    assert policy.next_delay(1, Poison()) is None
    assert policy.next_delay(1, WorsePoison()) is None
    assert policy.next_delay(1, KeyError("k")) is None
    assert policy.next_delay(1, LookupError()) is not None


@pytest.mark.parametrize(
    ("delay", "expected"),
    [(timedelta(minutes=7), timedelta(minutes=7)), (2.5, timedelta(seconds=2.5)), (3, timedelta(seconds=3))],
)
def test_explicit_retry_delay_is_used_verbatim(delay, expected):
    policy = RetryPolicy(cap=timedelta(minutes=1))
    assert policy.next_delay(1, Retry(delay)) == expected
    assert policy.next_delay(5, Retry(delay)) is None


def test_retry_without_delay_uses_backoff():
    policy = RetryPolicy(jitter=0, base=timedelta(seconds=2))
    assert policy.next_delay(3, Retry(reason="upstream busy")) == timedelta(seconds=8)


def test_retry_carries_reason_and_normalises_delay():
    err = Retry(1.5, reason="rate limited")
    assert err.delay == timedelta(seconds=1.5)
    assert err.reason == "rate limited"
    assert str(err) == "rate limited"
    assert Retry().delay is None


def test_retry_rejects_negative_delay():
    with pytest.raises(ValueError, match="delay must be >= 0"):
        Retry(-1)


def test_attempt_is_one_based():
    with pytest.raises(ValueError, match="1-based"):
        RetryPolicy().next_delay(0, RuntimeError())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_attempts": 0}, "max_attempts must be >= 1, got 0"),
        ({"base": timedelta(0)}, "base must be > 0"),
        ({"base": timedelta(seconds=-1)}, "base must be > 0"),
        ({"base": timedelta(seconds=10), "cap": timedelta(seconds=5)}, "cap must be >= base"),
        ({"jitter": 1.0}, r"jitter must be in \[0, 1\), got 1.0"),
        ({"jitter": -0.1}, r"jitter must be in \[0, 1\), got -0.1"),
    ],
)
def test_policy_validation_names_field_and_limit(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RetryPolicy(**kwargs)


def test_policy_is_frozen_and_keyword_only():
    policy = RetryPolicy()
    with pytest.raises(AttributeError):
        policy.max_attempts = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        RetryPolicy(3)  # type: ignore[misc]
