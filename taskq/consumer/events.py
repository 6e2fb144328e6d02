"""What a worker reports as it runs: typed events, and the hooks that receive them.

Cross-cutting concerns hook in here instead of crowding the loop: a test's recorder is a hook
(`taskq.testing.RecordingHook`), the worker's Prometheus metrics another
(`taskq.consumer.metrics.PrometheusHook`). Hooks are called on the worker's loop thread and must return
quickly. The stages report each task's events through a `Reporter`, which tallies them for the metrics
(applied once per loop pass) and builds the events only when the worker has hooks besides its metrics.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from taskq._core.broker import TP
from taskq._core.envelope import Envelope, Priority

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
    """Receives the events of a worker, on its loop thread: every one, unless the hook has an
    `event_types` attribute naming the kinds it takes (a tuple or set of event classes). A worker builds no
    per-task event that none of its hooks takes."""

    def __call__(self, event: Event) -> None: ...


class Hooks:
    """A worker's hooks: each event goes to those taking its kind (see `Hook`), found once per kind."""

    def __init__(self, hooks: Sequence[Hook] = ()) -> None:
        self.all = tuple(hooks)
        self._of: dict[type[Any], tuple[Hook, ...]] = {}

    def taking(self, kind: type[Any]) -> tuple[Hook, ...]:
        """The hooks that take events of `kind`."""
        hooks = self._of.get(kind)
        if hooks is None:
            hooks = self._of[kind] = tuple(hook for hook in self.all if _takes(hook, kind))
        return hooks

    def emit(self, event: Event) -> None:
        """Send `event` to the hooks taking its kind."""
        _send(self.taking(type(event)), event)


def _takes(hook: Hook, kind: type[Any]) -> bool:
    kinds = getattr(hook, "event_types", None)
    return kinds is None or kind in kinds


def _send(hooks: tuple[Hook, ...], event: Event) -> None:
    for hook in hooks:
        hook(event)


class Reporter:
    """Where the stages report what happens to each task. Always into the pass's tally, which the worker's
    Prometheus metrics apply once per pass; as an event only for the hooks that take its kind: a per-task
    event costs an object and a call per hook, and a production worker usually has no hook but its metrics.
    """

    def __init__(self, tally: Tally, hooks: Sequence[Hook] = ()) -> None:
        self.tally = tally
        # The worker's hooks (not its metrics): each per-task event goes, as it happens, to those taking it.
        taking = Hooks(hooks).taking
        self._started, self._succeeded = taking(AttemptStarted), taking(AttemptSucceeded)
        self._failed, self._completed, self._retried = (
            taking(AttemptFailed),
            taking(TaskCompleted),
            taking(TaskRetried),
        )
        self._duplicates, self._cancelled = taking(DuplicateSkipped), taking(CancelledSkipped)
        self._dead_lettered = taking(DeadLettered)

    def attempt_started(self, env: Envelope, attempt: int, quarantined: bool = False) -> None:
        """An attempt started (AttemptStarted)."""
        self.tally.started[env.task_type] += 1
        if quarantined:
            self.tally.quarantined[env.task_type] += 1
        if self._started:
            _send(
                self._started,
                AttemptStarted(env.task_type, env.task_id, env.idempotency_key, attempt, quarantined),
            )

    def attempt_succeeded(self, env: Envelope, seconds: float) -> None:
        """An attempt returned (AttemptSucceeded)."""
        self.tally.ran[env.task_type].append(seconds)
        self.tally.succeeded[env.task_type].append(env.enqueued_at)
        if self._succeeded:
            _send(
                self._succeeded,
                AttemptSucceeded(env.task_type, env.task_id, env.idempotency_key, seconds, env.enqueued_at),
            )

    def attempt_failed(self, env: Envelope, seconds: float, error: str) -> None:
        """An attempt raised, timed out or crashed (AttemptFailed)."""
        self.tally.ran[env.task_type].append(seconds)
        self.tally.failed[env.task_type] += 1
        if self._failed:
            failed = AttemptFailed(env.task_type, env.task_id, env.idempotency_key, seconds, error)
            _send(self._failed, failed)

    def task_completed(self, env: Envelope) -> None:
        """A task's completion is durable (TaskCompleted)."""
        if self._completed:
            _send(self._completed, TaskCompleted(env.task_type, env.task_id, env.idempotency_key))

    def task_retried(self, env: Envelope) -> None:
        """A failed attempt will be tried again (TaskRetried)."""
        self.tally.retried[env.task_type] += 1
        if self._retried:
            _send(self._retried, TaskRetried(env.task_type, env.task_id, env.idempotency_key))

    def duplicate_skipped(self, env: Envelope) -> None:
        """A delivery of a key already completed was skipped (DuplicateSkipped)."""
        self.tally.duplicates[env.task_type] += 1
        if self._duplicates:
            _send(self._duplicates, DuplicateSkipped(env.task_type, env.task_id, env.idempotency_key))

    def cancelled_skipped(self, env: Envelope) -> None:
        """A task cancelled before it started was skipped (CancelledSkipped)."""
        if self._cancelled:
            _send(self._cancelled, CancelledSkipped(env.task_type, env.task_id, env.idempotency_key))

    def dead_lettered(
        self, reason: str, error_type: str, env: Envelope | None, topic: str, offset: int
    ) -> None:
        """A task, or input that never became one (no envelope), was sent to the DLQ (DeadLettered)."""
        self.tally.dead_lettered[error_type] += 1
        if self._dead_lettered:
            task_id, key = (env.task_id, env.idempotency_key) if env is not None else (None, None)
            _send(self._dead_lettered, DeadLettered(reason, error_type, task_id, key, topic, offset))
