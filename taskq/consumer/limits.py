"""Per-key concurrency caps and execution-time rate limits: what a claimed task of a limited type waits for.

A task of a type with `concurrency_limit=N` starts only once it holds one of its key's N slots, rows in
Postgres shared by every worker (a dead worker's slots free when its heartbeat goes stale). A task of a type
with `rate_limit="100/s"` starts only with a token of its key's bucket, shared by every worker through
Postgres and leased in small batches as the producer's are. A task that must wait stays in the worker's
buffer, claimed: it keeps its place and its attempt, and tasks of other keys go by.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from taskq._core.durations import Rate
from taskq._core.errors import StoreUnavailableError, TaskqError
from taskq._core.logs import OUTAGE
from taskq.consumer.store import SlotRequest, TaskStore
from taskq.producer.ratelimit import SharedBucket

__all__ = ["Gate", "KeyFailedError", "Limits"]

log = logging.getLogger("taskq.worker")

#: A key found full (its slots held by other workers) is asked again after this long (seconds), or at
#: once when this worker frees one of its slots.
SLOT_RECHECK = 0.2
#: How long limited tasks wait when Postgres cannot be asked (seconds).
UNAVAILABLE_WAIT = 1.0
#: Buckets a worker keeps, beyond which the least recently used is dropped: with a key per user, say, memory
#: stays bounded. A dropped bucket forfeits the few tokens it had leased; it never grants more.
MAX_BUCKETS = 10_000


class KeyFailedError(TaskqError):
    """A task's concurrency_key or rate_key function raised: the task cannot be placed under its limit."""


@dataclass(frozen=True, slots=True)
class Gate:
    """What one task of a limited type starts under: a slot of (task type, key) and/or a bucket's token."""

    slot: tuple[str, str] | None
    limit: int
    bucket: str | None
    rate: Rate | None


def _key_of(fn: Callable[[Any], Any] | None, payload: Any, name: str) -> str:
    if fn is None:
        return ""  # one key for the whole task type
    try:
        return str(fn(payload))
    except Exception as exc:
        raise KeyFailedError(f"{name} raised {type(exc).__name__}: {exc}") from exc


class Limits:
    """A worker's view of the slots and buckets its limited tasks start under; used from its loop only.

    `admit` asks Postgres once per dispatch batch (one transaction for the slots, a token take per bucket
    whose leased tokens ran out); a key found full or empty is not asked again until it may have room.
    """

    def __init__(self, store: TaskStore, namespace: str, *, clock: Callable[[], float] = time.monotonic):
        self._store = store
        self._namespace = namespace
        self._clock = clock
        self._buckets: dict[str, SharedBucket] = {}
        self._slot_wait: dict[tuple[str, str], float] = {}  # key -> when to ask again
        self._bucket_wait: dict[str, float] = {}  # bucket -> when to ask again
        self._held: Counter[tuple[str, str]] = Counter()  # slots this worker holds, per key
        self._holding: dict[str, tuple[str, str]] = {}  # idempotency key -> the key of its slot
        self._to_release: list[str] = []

    def gate(
        self,
        task_type: str,
        payload: Any,
        *,
        limit: int | None,
        concurrency_key: Callable[[Any], Any] | None,
        rate: Rate | None,
        rate_key: Callable[[Any], Any] | None,
    ) -> Gate | None:
        """The gate of a task of a limited type (None if its type has no limit); KeyFailedError if a key
        function raised."""
        if limit is None and rate is None:
            return None
        slot = (
            (task_type, _key_of(concurrency_key, payload, "concurrency_key")) if limit is not None else None
        )
        bucket = None
        if rate is not None:
            bucket = f"{self._namespace}:run:{task_type}:{_key_of(rate_key, payload, 'rate_key')}"
        return Gate(slot, limit or 0, bucket, rate)

    def ready(self, gate: Gate) -> bool:
        """Whether a task may be offered to `admit` now: its key is not known to be full or out of tokens."""
        now = self._clock()
        if gate.slot is not None and (
            self._held[gate.slot] >= gate.limit or self._slot_wait.get(gate.slot, 0.0) > now
        ):
            return False
        return gate.bucket is None or self._bucket_wait.get(gate.bucket, 0.0) <= now

    def ready_at(self, gate: Gate) -> float:
        """The clock time a task found not `ready` may be offered again (its key may have room by then)."""
        at = self._clock()
        if gate.slot is not None:
            at = max(at, self._slot_wait.get(gate.slot, at))
        if gate.bucket is not None:
            at = max(at, self._bucket_wait.get(gate.bucket, at))
        return at

    def admit(self, tasks: Sequence[tuple[str, Gate, float]]) -> set[str]:
        """Of (idempotency key, gate, slot lease seconds) tasks about to start, the keys of those that may:
        each took its bucket's token and its key's slot. The others wait, holding neither."""
        now = self._clock()
        if len(self._slot_wait) + len(self._bucket_wait) > MAX_BUCKETS:  # forget the waits that are over
            self._slot_wait = {k: t for k, t in self._slot_wait.items() if t > now}
            self._bucket_wait = {k: t for k, t in self._bucket_wait.items() if t > now}
        admitted = {key for key, _, _ in tasks}
        tokens: list[tuple[str, SharedBucket]] = []
        for key, gate, _ in tasks:
            if gate.bucket is None or gate.rate is None:
                continue
            if self._bucket_wait.get(gate.bucket, 0.0) > now:
                admitted.discard(key)  # the bucket ran dry for an earlier task of this batch
                continue
            bucket = self._bucket(gate.bucket, gate.rate)
            try:
                wait = bucket.try_take(1)
            except StoreUnavailableError as exc:
                log.warning("rate limit %s not checked, its tasks wait: %s", gate.bucket, exc, extra=OUTAGE)
                wait = UNAVAILABLE_WAIT
            if wait > 0:
                admitted.discard(key)
                self._bucket_wait[gate.bucket] = now + wait
            else:
                tokens.append((key, bucket))
        capped = [
            (key, gate, lease) for key, gate, lease in tasks if key in admitted and gate.slot is not None
        ]
        if capped:
            try:
                granted = self._store.acquire_slots(
                    [
                        SlotRequest(key, gate.slot[0], gate.slot[1], gate.limit, lease)
                        for key, gate, lease in capped
                        if gate.slot
                    ]
                )
            except StoreUnavailableError as exc:
                log.warning(
                    "concurrency slots not taken, %d task(s) wait: %s", len(capped), exc, extra=OUTAGE
                )
                granted = set()
            for key, gate, _ in capped:
                assert gate.slot is not None
                if key in granted:
                    self._holding[key] = gate.slot
                    self._held[gate.slot] += 1
                else:
                    admitted.discard(key)
                    self._slot_wait[gate.slot] = now + SLOT_RECHECK
        for key, bucket in tokens:
            if key not in admitted:
                bucket.add(1)  # taken for a task that found no slot: the next task of the bucket uses it
        return admitted

    def release(self, idempotency_key: str) -> None:
        """The task's attempt ended (or never started): its slot, if it holds one, is given back at the
        next `flush`; tasks of its key may start here at once."""
        slot = self._holding.pop(idempotency_key, None)
        if slot is None:
            return
        self._held[slot] -= 1
        if not self._held[slot]:
            del self._held[slot]
        self._slot_wait.pop(slot, None)
        self._to_release.append(idempotency_key)

    def pending(self) -> int:
        """Slots released and not yet given back."""
        return len(self._to_release)

    def flush(self) -> None:
        """Give back the slots released since the last flush, in one round trip."""
        if not self._to_release:
            return
        keys, self._to_release = self._to_release, []
        try:
            self._store.release_slots(keys)
        except StoreUnavailableError as exc:
            # Kept for the next flush; meanwhile they count against their keys (until their leases end).
            log.warning(
                "could not give back %d concurrency slot(s), will try again: %s", len(keys), exc, extra=OUTAGE
            )
            self._to_release = keys + self._to_release

    def pause(self, gate: Gate, seconds: float) -> None:
        """Pause the task's bucket for every worker (its handler was told to back off for `seconds`)."""
        if gate.bucket is None or gate.rate is None:
            return
        try:
            self._bucket(gate.bucket, gate.rate).pause(seconds)
        except StoreUnavailableError as exc:
            log.warning("could not pause rate limit %s for the other workers: %s", gate.bucket, exc)
        self._bucket_wait[gate.bucket] = max(self._bucket_wait.get(gate.bucket, 0.0), self._clock() + seconds)

    def _bucket(self, name: str, rate: Rate) -> SharedBucket:
        bucket = self._buckets.pop(name, None)
        if bucket is None:
            bucket = SharedBucket(self._store, name, rate=rate.per_second, capacity=rate.burst)
        self._buckets[name] = bucket  # the most recently used last
        if len(self._buckets) > MAX_BUCKETS:
            del self._buckets[next(iter(self._buckets))]
        return bucket
