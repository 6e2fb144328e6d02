"""The task envelope: what travels in Kafka headers beside an Avro payload, and the tier vocabulary."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Final, Literal, get_args

from taskq._core.durations import tier_name

if TYPE_CHECKING:
    from taskq._core.broker import Record

Priority = Literal["critical", "high", "normal", "low"]
"""A priority tier's name; each tier is its own topic, `<namespace>.<tier>`."""
PRIORITIES: Final[tuple[Priority, ...]] = get_args(Priority)
"""Priority tiers, highest first. The order is the dispatch preference of workers."""
#: Default weights of the worker's weighted round-robin, in PRIORITIES order.
DEFAULT_WEIGHTS: Final[dict[Priority, int]] = {"critical": 8, "high": 4, "normal": 2, "low": 1}

Headers = list[tuple[str, bytes]]

#: Limits of envelope fields, enforced by producers and again by workers on what they read (invariant 6).
MAX_ATTEMPTS: Final = 1000
MAX_TIMEOUT_SECONDS: Final = 7 * 24 * 3600.0
MAX_HEADER_BYTES: Final = 4096
#: The longest delay a task may be given (longer ones hop through the largest delay tier).
MAX_DELAY: Final = timedelta(days=365)
#: Timestamps are milliseconds since the epoch, before the year 10000.
_MAX_MS: Final = 253_402_300_799_999


class EnvelopeError(ValueError):
    """A record's headers do not form a valid task envelope."""


@dataclass(frozen=True)
class Topics:
    """Topic names of one namespace: four priority tiers, the delay tiers and the DLQ."""

    namespace: str
    delay_tiers: Sequence[timedelta] = ()

    def tier(self, priority: Priority) -> str:
        """The topic of a priority tier."""
        return f"{self.namespace}.{priority}"

    @property
    def priority_topics(self) -> list[str]:
        """The four priority topics, highest first."""
        return [self.tier(p) for p in PRIORITIES]

    def delay(self, tier: timedelta) -> str:
        """The topic of a delay tier."""
        return f"{self.namespace}.delay.{tier_name(tier)}"

    @property
    def delay_topics(self) -> list[str]:
        """Every delay-tier topic, shortest first."""
        return [self.delay(t) for t in self.delay_tiers]

    @property
    def dlq(self) -> str:
        """The dead-letter topic."""
        return f"{self.namespace}.dlq"

    def priority_of(self, topic: str) -> Priority | None:
        """The tier a priority topic carries, or None for any other topic."""
        return self._tiers.get(topic)

    @cached_property
    def _tiers(self) -> dict[str, Priority]:
        # Asked for every record and, each tick, for every assigned partition: a lookup, not four names built.
        return {self.tier(p): p for p in PRIORITIES}


def ms_header(t: datetime) -> bytes:
    """A time as a header value: milliseconds since the epoch."""
    return str(int(t.timestamp() * 1000)).encode()


def timeout_header(seconds: float) -> bytes:
    """A timeout as a header value: seconds."""
    return repr(float(seconds)).encode()


def _from_ms(name: str, raw: bytes) -> datetime:
    ms = int(raw)
    if not 0 <= ms <= _MAX_MS:
        raise EnvelopeError(f"header {name} is {shown(raw)}, not a time in milliseconds since 1970")
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def shown(raw: bytes) -> str:
    """A header value for an error message: bounded, printable."""
    text = raw[:40].decode(errors="replace")
    return repr(text + ("..." if len(raw) > 40 else ""))


def _text(h: dict[str, bytes], name: str) -> str:
    """The text of header `name` (its full name)."""
    raw = h.get(name)
    if raw is None:
        raise EnvelopeError(f"header {name!r} is missing")
    if b"\x00" in raw:  # Postgres text cannot hold it: the task's claim would fail, and its batch's with it
        raise EnvelopeError(f"header {name} contains a NUL byte: {shown(raw)}")
    return raw.decode()


def _number(name: str, raw: bytes, low: int, high: int) -> int:
    value = int(raw) if len(raw) <= 20 else high + 1
    if not low <= value <= high:
        raise EnvelopeError(f"header {name} is {shown(raw)}, not an integer from {low} to {high}")
    return value


def _seconds(name: str, raw: bytes) -> float:
    value = float(raw)
    if not 0 < value <= MAX_TIMEOUT_SECONDS:  # also refuses nan and inf
        raise EnvelopeError(
            f"header {name} is {shown(raw)}, not a number of seconds in (0, {MAX_TIMEOUT_SECONDS:.0f}]"
        )
    return value


def new_task_id() -> str:
    """A fresh task id, 32 hex digits (unique per enqueue; the idempotency key, not this, decides effects)."""
    return os.urandom(16).hex()  # as random as uuid4().hex, at a fifth of the cost


H = "taskq-"  # header prefix; the envelope is the headers starting with it plus `traceparent`
#: The envelope's header names, built once: the producer's hot path builds headers from them too.
TASK_ID: Final = H + "task-id"
TASK_TYPE: Final = H + "task-type"
IDEMPOTENCY_KEY: Final = H + "idempotency-key"
PRIORITY: Final = H + "priority"
ATTEMPT: Final = H + "attempt"
ENQUEUED_AT: Final = H + "enqueued-at"
ORIGIN_TOPIC: Final = H + "origin-topic"
MAX_ATTEMPTS_HEADER: Final = H + "max-attempts"
NOT_BEFORE: Final = H + "not-before"
TIMEOUT: Final = H + "timeout"
#: On a workflow's step only, beside the envelope and kept across its attempts: `<workflow id>:<node>`.
WORKFLOW_HEADER: Final = H + "workflow"


@dataclass(kw_only=True, slots=True, unsafe_hash=True)
class Envelope:
    """Everything about a task except its payload; travels as Kafka headers."""

    task_id: str
    task_type: str
    idempotency_key: str
    priority: Priority
    attempt: int = 1
    max_attempts: int | None = None
    enqueued_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    not_before: datetime | None = None
    timeout: float | None = None
    origin_topic: str = ""
    traceparent: str | None = None

    def to_headers(self) -> Headers:
        """Kafka headers carrying this envelope."""
        h: Headers = [
            (TASK_ID, self.task_id.encode()),
            (TASK_TYPE, self.task_type.encode()),
            (IDEMPOTENCY_KEY, self.idempotency_key.encode()),
            (PRIORITY, self.priority.encode()),
            (ATTEMPT, str(self.attempt).encode()),
            (ENQUEUED_AT, ms_header(self.enqueued_at)),
            (ORIGIN_TOPIC, self.origin_topic.encode()),
        ]
        if self.max_attempts is not None:
            h.append((MAX_ATTEMPTS_HEADER, str(self.max_attempts).encode()))
        if self.not_before is not None:
            h.append((NOT_BEFORE, ms_header(self.not_before)))
        if self.timeout is not None:
            h.append((TIMEOUT, timeout_header(self.timeout)))
        if self.traceparent:
            h.append(("traceparent", self.traceparent.encode()))
        return h

    @classmethod
    def of(cls, record: Record) -> Envelope:
        """The envelope of a fetched record; EnvelopeError also when its headers could not be read."""
        if record.header_error is not None:
            raise EnvelopeError(record.header_error)
        return cls.from_headers(record.headers)

    @classmethod
    def from_headers(cls, headers: Iterable[tuple[str, bytes | None]] | None) -> Envelope:
        """Parse an envelope; EnvelopeError names the missing or malformed header."""
        h = {k: v for k, v in headers or () if v is not None}
        if h and max(map(len, h.values())) > MAX_HEADER_BYTES:  # the exact check only when one is that large
            for k, v in h.items():
                if (k.startswith(H) or k == "traceparent") and len(v) > MAX_HEADER_BYTES:
                    raise EnvelopeError(
                        f"header {k} is {len(v)} bytes, over the {MAX_HEADER_BYTES}-byte limit"
                    )
        # Each header looked up once, by the names built at import: a worker parses each record's envelope
        # in its loop, and this parse was about a twelfth of the loop's time a no-op task.
        get = h.get
        attempt, max_attempts, enqueued_at = get(ATTEMPT), get(MAX_ATTEMPTS_HEADER), get(ENQUEUED_AT)
        not_before, timeout, traceparent = get(NOT_BEFORE), get(TIMEOUT), get("traceparent")
        try:
            priority = _text(h, PRIORITY)
            if priority not in PRIORITIES:
                raise EnvelopeError(f"header {PRIORITY} is {priority!r}, not one of {', '.join(PRIORITIES)}")
            return cls(
                task_id=_text(h, TASK_ID),
                task_type=_text(h, TASK_TYPE),
                idempotency_key=_text(h, IDEMPOTENCY_KEY),
                priority=priority,
                attempt=int(_text(h, ATTEMPT))  # missing
                if attempt is None
                else _number(ATTEMPT, attempt, 1, 1_000_000),
                max_attempts=None
                if max_attempts is None
                else _number(MAX_ATTEMPTS_HEADER, max_attempts, 1, MAX_ATTEMPTS),
                enqueued_at=datetime.now(UTC) if enqueued_at is None else _from_ms(ENQUEUED_AT, enqueued_at),
                not_before=None if not_before is None else _from_ms(NOT_BEFORE, not_before),
                timeout=None if timeout is None else _seconds(TIMEOUT, timeout),
                origin_topic=get(ORIGIN_TOPIC, b"").decode(),
                traceparent=None if traceparent is None else traceparent.decode(),
            )
        except (UnicodeDecodeError, ValueError, OverflowError, OSError) as exc:
            if isinstance(exc, EnvelopeError):
                raise
            raise EnvelopeError(f"malformed task envelope header: {str(exc)[:200]}") from exc
