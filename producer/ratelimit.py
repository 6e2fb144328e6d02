"""Rate limiting of enqueues: a local token bucket."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["TokenBucket"]


class TokenBucket:
    """A thread-safe token bucket: `rate` tokens per second, holding at most `capacity`, starting full."""

    def __init__(self, *, rate: float, capacity: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not rate > 0:
            raise ValueError(f"rate must be > 0 tokens/s, got {rate}")
        if not capacity >= 1:
            raise ValueError(f"capacity must be >= 1 token, got {capacity}")
        self.rate = rate
        self.capacity = capacity
        self._clock = clock
        self._lock = threading.Lock()
        # Float rounding in (n - tokens) / rate and in the refill must not make an exact
        # retry-after come up a hair short; the slack is far below one token, and a take that
        # uses it leaves the balance slightly negative, so it is repaid, never granted for free.
        self._slack = 1e-9 * capacity
        self._tokens = capacity
        self._updated = clock()

    def _refill(self) -> None:
        # Caller holds the lock. A clock that steps back adds nothing rather than removing tokens.
        now = self._clock()
        elapsed = max(0.0, now - self._updated)
        self._tokens = min(self.capacity, self._tokens + elapsed * self.rate)
        self._updated = now

    def try_take(self, n: float = 1.0) -> float:
        """Take `n` tokens and return 0.0, or take nothing and return the seconds until `n` are available."""
        if not 0 < n <= self.capacity:
            raise ValueError(f"can take between 0 and capacity ({self.capacity}) tokens at once, got {n}")
        with self._lock:
            self._refill()
            if self._tokens + self._slack >= n:
                self._tokens -= n
                return 0.0
            return (n - self._tokens) / self.rate

    def available(self) -> float:
        """Tokens that could be taken now."""
        with self._lock:
            self._refill()
            return max(0.0, self._tokens)

    def add(self, tokens: float) -> None:
        """Put back tokens taken but not used (e.g. the unused part of a lease), up to capacity."""
        if tokens < 0:
            raise ValueError(f"can only add tokens >= 0, got {tokens}")
        with self._lock:
            self._refill()
            self._tokens = min(self.capacity, self._tokens + tokens)
