"""What a worker reports as it runs: typed events, and the hooks that receive them.

Cross-cutting concerns hook in here instead of crowding the loop: Prometheus is one hook
(`taskq.consumer.metrics.PrometheusHook`), a test's recorder another (`taskq.testing.RecordingHook`).
Hooks are called on the worker's loop thread and must return quickly.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from taskq._core.broker import TP
from taskq._core.envelope import Priority

__all__ = [
    "AttemptFailed",
    "AttemptStarted",
    "AttemptSucceeded",
    "CancelledSkipped",
    "DeadLettered",
    "DuplicateSkipped",
    "Event",
    "Hook",
    "LoopSampled",
    "OffsetsCommitted",
    "PartitionsAssigned",
    "PartitionsRevoked",
    "TaskCompleted",
    "TaskRetried",
    "WorkerStarted",
    "WorkerStopped",
]


@dataclass(frozen=True, slots=True)
class WorkerStarted:
    """The worker joined its group."""

    worker_id: str
    group: str


@dataclass(frozen=True, slots=True)
class WorkerStopped:
    """The worker left its group and released its clients."""

    worker_id: str


@dataclass(frozen=True, slots=True)
class PartitionsAssigned:
    """Partitions newly assigned to this worker."""

    partitions: list[TP]


@dataclass(frozen=True, slots=True)
class PartitionsRevoked:
    """Partitions taken away; `dropped` buffered tasks of them are left to their new owner."""

    partitions: list[TP]
    dropped: int


@dataclass(frozen=True, slots=True)
class AttemptStarted:
    """An attempt of a task started on a slot (its key claimed); `quarantined`: a suspect's run, alone."""

    task_type: str
    task_id: str
    key: str
    attempt: int
    quarantined: bool = False


@dataclass(frozen=True, slots=True)
class AttemptSucceeded:
    """An attempt returned; its completion is recorded next (TaskCompleted)."""

    task_type: str
    task_id: str
    key: str
    seconds: float
    enqueued_at: datetime


@dataclass(frozen=True, slots=True)
class AttemptFailed:
    """An attempt raised, timed out or crashed; a retry or a DLQ record follows."""

    task_type: str
    task_id: str
    key: str
    seconds: float
    error: str


@dataclass(frozen=True, slots=True)
class TaskCompleted:
    """A task's completion is durable in Postgres."""

    task_type: str
    task_id: str
    key: str


@dataclass(frozen=True, slots=True)
class DuplicateSkipped:
    """A delivery of a key already completed: skipped, never run again."""

    task_type: str
    task_id: str
    key: str


@dataclass(frozen=True, slots=True)
class CancelledSkipped:
    """A task cancelled before it started: its offset is committed, it never runs and never reaches the
    DLQ."""

    task_type: str
    task_id: str
    key: str


@dataclass(frozen=True, slots=True)
class TaskRetried:
    """A failed attempt was sent to a delay tier for another try."""

    task_type: str
    task_id: str
    key: str


@dataclass(frozen=True, slots=True)
class DeadLettered:
    """A task (or input that never became one: no task id then) was sent to the DLQ."""

    reason: str
    error_type: str
    task_id: str | None
    key: str | None
    topic: str
    offset: int


@dataclass(frozen=True, slots=True)
class OffsetsCommitted:
    """The group's offsets moved: every task below them has a durable outcome."""

    offsets: dict[TP, int]


@dataclass(frozen=True, slots=True)
class LoopSampled:
    """The loop's state after a tick; `lag` is measured every few seconds only (None in between)."""

    in_flight: int
    busy_slots: int
    concurrency: int
    buffered: dict[Priority, int]
    lag: dict[Priority, int] | None
    #: Share mode: records the share groups handed to this worker and not acknowledged yet (None otherwise).
    share_held: int | None = None


@dataclass(frozen=True, slots=True)
class ShareRedelivered:
    """Share mode: a record handed out before was handed to this worker again (a lock that expired, a
    release, a member that left); `sent_again` when it was on the group's last delivery and went back to
    its tier as a new record."""

    topic: str
    delivery_count: int
    sent_again: bool


Event = (
    WorkerStarted
    | WorkerStopped
    | PartitionsAssigned
    | PartitionsRevoked
    | AttemptStarted
    | AttemptSucceeded
    | AttemptFailed
    | TaskCompleted
    | DuplicateSkipped
    | CancelledSkipped
    | TaskRetried
    | DeadLettered
    | OffsetsCommitted
    | LoopSampled
    | ShareRedelivered
)


def _lists() -> defaultdict[str, list[Any]]:
    return defaultdict(list)


@dataclass(slots=True)
class Tally:
    """A loop pass's per-task events as the worker's own metrics need them: counted by task type
    (dead-letterings by error type), taken once per pass instead of one metric update per event."""

    started: Counter[str] = field(default_factory=Counter)
    #: Of those, suspects' runs alone.
    quarantined: Counter[str] = field(default_factory=Counter)
    #: How long each attempt that ended ran, succeeded or failed.
    ran: defaultdict[str, list[float]] = field(default_factory=_lists)
    #: When the task of each attempt that succeeded was enqueued.
    succeeded: defaultdict[str, list[datetime]] = field(default_factory=_lists)
    failed: Counter[str] = field(default_factory=Counter)
    retried: Counter[str] = field(default_factory=Counter)
    duplicates: Counter[str] = field(default_factory=Counter)
    dead_lettered: Counter[str] = field(default_factory=Counter)

    def __bool__(self) -> bool:
        return bool(self.started or self.ran or self.retried or self.duplicates or self.dead_lettered)

    def clear(self) -> None:
        """Empty, for the next pass (cheaper than a new one each pass)."""
        self.ran.clear()
        self.succeeded.clear()
        for counts in (self.started, self.quarantined, self.failed, self.retried, self.duplicates):
            counts.clear()
        self.dead_lettered.clear()


class Hook(Protocol):
    """Receives every event of a worker, on its loop thread."""

    def __call__(self, event: Event) -> None: ...
