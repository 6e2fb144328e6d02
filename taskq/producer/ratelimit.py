"""Rate limiting of enqueues: a local token bucket, and a bucket in Postgres shared by every producer."""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from taskq._core.db import Database
from taskq._core.envelope import PRIORITIES
from taskq._core.errors import ConfigurationError, RateLimitedError, StoreUnavailableError
from taskq._core.store import Store

__all__ = ["RateLimit", "RateLimiter", "SharedBucket", "TokenBucket", "Tokens"]

log = logging.getLogger("taskq.ratelimit")


class TokenBucket:
    """A thread-safe token bucket: `rate` tokens per second, holding at most `capacity`, starting full."""

    def __init__(self, *, rate: float, capacity: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not rate > 0:
            raise ConfigurationError(f"rate must be > 0 tokens/s, got {rate}")
        if not capacity >= 1:
            raise ConfigurationError(f"capacity must be >= 1 token, got {capacity}")
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
            raise ConfigurationError(
                f"can take between 0 and capacity ({self.capacity}) tokens at once, got {n}"
            )
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
            raise ConfigurationError(f"can only add tokens >= 0, got {tokens}")
        with self._lock:
            self._refill()
            self._tokens = min(self.capacity, self._tokens + tokens)


@dataclass(frozen=True, kw_only=True)
class RateLimit:
    """At most `rate` enqueues per second (bursts up to `burst`) of a task type and/or tier; None matches all.

    `shared=True` keeps the bucket in Postgres so every producer process draws from the same one.
    """

    rate: float
    burst: float | None = None
    task_type: str | None = None
    priority: str | None = None
    shared: bool = False

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ConfigurationError(f"RateLimit.rate must be > 0 tokens/s, got {self.rate}")
        if self.burst is not None and self.burst < 1:
            raise ConfigurationError(f"RateLimit.burst must be >= 1, got {self.burst}")
        if self.priority is not None and self.priority not in PRIORITIES:
            raise ConfigurationError(
                f"RateLimit.priority {self.priority!r} is not one of {', '.join(PRIORITIES)}"
            )

    @property
    def capacity(self) -> float:
        """Bucket size: the burst, else one second's worth (at least one token)."""
        return self.burst if self.burst is not None else max(1.0, self.rate)

    def name(self, namespace: str) -> str:
        """The bucket's name, also its row in the shared table."""
        return f"{namespace}:{self.task_type or '*'}:{self.priority or '*'}"

    def matches(self, task_type: str, priority: str) -> bool:
        """Whether a task of this type and tier draws from this limit."""
        return (self.task_type in (None, task_type)) and (self.priority in (None, priority))


class Tokens(Protocol):
    """Where shared buckets live: the Postgres `Store`, a worker's `TaskStore`, or the in-memory fake."""

    def take_tokens(
        self, bucket: str, *, rate: float, capacity: float, want: float
    ) -> tuple[float, float, float]: ...
    def pause_tokens(self, bucket: str, *, rate: float, capacity: float, seconds: float) -> None: ...


class SharedBucket:
    """A token bucket in Postgres, leased in small batches so most takes cost no round trip.

    Tokens leave the database only through `take_tokens`, which refills for elapsed time and takes in one
    atomic statement, so all processes together get at most rate * t + capacity over t seconds.
    """

    def __init__(
        self,
        database: Database | Tokens,
        name: str,
        *,
        rate: float,
        capacity: float,
        lease: int | None = None,
    ):
        """`database`: a Database (the bucket keeps a connection of its own) or a store that has buckets."""
        self.name = name
        self.rate = rate
        self.capacity = capacity
        # A lease of ~1/20 s of tokens: a lone producer pays one round trip per 50 ms of full-rate traffic.
        self.lease = lease or max(1, min(int(capacity), math.ceil(rate / 20)))
        self._database = database if isinstance(database, Database) else None
        self._tokens: Tokens = Store(database) if isinstance(database, Database) else database
        self._lock = threading.Lock()
        self._stash = 0.0
        self._db_tokens = 0.0
        self._db_paused = 0.0

    def _take_from_db(self, want: float) -> float:
        take = functools.partial(
            self._tokens.take_tokens, self.name, rate=self.rate, capacity=self.capacity, want=want
        )
        try:
            granted, self._db_tokens, self._db_paused = take()
        except StoreUnavailableError:
            # Once more, on a new connection: the kept one may have died with a Postgres restart, and a take
            # that went through after all only forfeits tokens, never grants too many.
            granted, self._db_tokens, self._db_paused = take()
        return granted

    def try_take(self, n: int = 1) -> float:
        """Take n tokens (0.0) or return the seconds until the shared bucket can give them."""
        with self._lock:
            if self._stash < n:
                self._stash += self._take_from_db(max(self.lease, n - self._stash))
            if self._stash >= n:
                self._stash -= n
                return 0.0
            return max(0.001, self._db_paused + (n - self._stash - self._db_tokens) / self.rate)

    def add(self, n: float) -> None:
        """Keep tokens taken but not used for the next take."""
        with self._lock:
            self._stash += n

    def pause(self, seconds: float) -> None:
        """Grant nothing for `seconds`, in every process sharing the bucket (tokens stashed here are lost)."""
        with self._lock:
            self._stash = 0.0
            self._tokens.pause_tokens(self.name, rate=self.rate, capacity=self.capacity, seconds=seconds)

    def close(self) -> None:
        """Release the connection (leased tokens not yet used are forfeited, never over-granted)."""
        with self._lock:
            if self._database is not None:
                self._database.close()


class RateLimiter:
    """Every configured limit of a producer; a task must get a token from each limit it matches."""

    def __init__(self, limits: Sequence[RateLimit], *, namespace: str, database: Database | None) -> None:
        self._buckets: list[tuple[RateLimit, TokenBucket | SharedBucket]] = []
        for limit in limits:
            bucket: TokenBucket | SharedBucket
            if limit.shared:
                if database is None:
                    raise ConfigurationError("a shared rate limit needs a database")
                bucket = SharedBucket(
                    database, limit.name(namespace), rate=limit.rate, capacity=limit.capacity
                )
            else:
                bucket = TokenBucket(rate=limit.rate, capacity=limit.capacity)
            self._buckets.append((limit, bucket))
        self._namespace = namespace

    @property
    def shared(self) -> bool:
        """Whether acquire() may wait on Postgres (a shared limit applies)."""
        return any(isinstance(bucket, SharedBucket) for _, bucket in self._buckets)

    @property
    def limited(self) -> bool:
        """Whether any limit applies at all (without one, acquire() is a no-op not worth calling)."""
        return bool(self._buckets)

    def acquire(self, tasks: Sequence[tuple[str, str]]) -> None:
        """Take the tokens of these (task type, tier) pairs from every matching bucket, or none at all."""
        if not self._buckets:
            return
        taken: list[tuple[TokenBucket | SharedBucket, int]] = []
        for limit, bucket in self._buckets:
            n = sum(1 for task_type, priority in tasks if limit.matches(task_type, priority))
            if not n:
                continue
            if n > limit.capacity:
                self._give_back(taken)
                raise RateLimitedError(limit.name(self._namespace), retry_after=n / limit.rate)
            retry_after = bucket.try_take(n)
            if retry_after > 0:
                self._give_back(taken)
                raise RateLimitedError(limit.name(self._namespace), retry_after)
            taken.append((bucket, n))

    @staticmethod
    def _give_back(taken: list[tuple[TokenBucket | SharedBucket, int]]) -> None:
        # Tokens of buckets that granted before a later one refused: nothing was sent, so they are unused.
        for bucket, n in taken:
            bucket.add(n)

    def close(self) -> None:
        """Release database connections."""
        for _, bucket in self._buckets:
            if isinstance(bucket, SharedBucket):
                bucket.close()
