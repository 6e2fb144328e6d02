"""Retry decisions as values: a policy maps (attempt, error) to the next delay, or None for dead-letter."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from datetime import timedelta

from taskq._core.errors import ConfigurationError

__all__ = ["Reject", "Retry", "RetryPolicy"]

_RNG = random.Random()



class Retry(Exception):
    """Raised by a handler to ask for another attempt, optionally after an explicit delay."""

    delay: timedelta | None
    reason: str

    def __init__(self, delay: timedelta | float | None = None, reason: str = "") -> None:
        if isinstance(delay, int | float):
            delay = timedelta(seconds=delay)
        if delay is not None and delay < timedelta(0):
            raise ConfigurationError(f"Retry delay must be >= 0, got {delay!r}")
        super().__init__(reason or "retry requested")
        self.delay = delay
        self.reason = reason


class Reject(Exception):
    """Raised by a handler for a payload it can never process: the task goes straight to the DLQ."""


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Exponential backoff with jitter, a cap, an attempt limit and errors that are never retried.

    Jitter is downward: the delay of attempt `a` is drawn uniformly from
    [min(b * (1 - jitter), cap), min(b, cap)] with b = base * 2**(a - 1), so it is never below
    b * (1 - jitter) unless the cap is, and never above the cap. Downward jitter keeps the configured
    backoff an upper bound and still spreads a burst of failures over time.
    """

    max_attempts: int = 5
    base: timedelta = timedelta(seconds=1)
    cap: timedelta = timedelta(hours=1)
    jitter: float = 0.2
    non_retryable: tuple[type[BaseException], ...] = ()

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigurationError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.base <= timedelta(0):
            raise ConfigurationError(f"base must be > 0, got {self.base!r}")
        if self.cap < self.base:
            raise ConfigurationError(f"cap must be >= base ({self.base!r}), got {self.cap!r}")
        if not 0 <= self.jitter < 1:
            raise ConfigurationError(f"jitter must be in [0, 1), got {self.jitter}")

    def next_delay(
        self, attempt: int, error: BaseException, *, rng: random.Random | None = None
    ) -> timedelta | None:
        """Delay before the next attempt after attempt `attempt` (1-based) failed; None means dead-letter."""
        if attempt < 1:
            raise ConfigurationError(f"attempt is 1-based, got {attempt}")
        if attempt >= self.max_attempts or isinstance(error, self.non_retryable):
            return None
        if isinstance(error, Retry) and error.delay is not None:
            return error.delay
        cap = self.cap.total_seconds()
        # Beyond 2**64 every realistic base is past any cap; inf avoids float overflow.
        backoff = self.base.total_seconds() * 2.0 ** (attempt - 1) if attempt <= 64 else math.inf
        low, high = min(backoff * (1 - self.jitter), cap), min(backoff, cap)
        return timedelta(seconds=(_RNG if rng is None else rng).uniform(low, high))
