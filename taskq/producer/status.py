"""What became of a task: its status (`TaskStatus`), waiting for its result, and cancelling it.

All of it reads the task's idempotency record in Postgres (or `taskq.testing.InMemoryStore`'s), the record
the worker writes in the transaction that records an attempt's end. A record is found by its idempotency key
(one primary-key probe: what a receipt uses) or by its task id (a scan of the namespace's records: task ids
carry no index, kept off the claim's path).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, Protocol

from taskq._core.db import Database
from taskq._core.errors import InvalidTaskError, NotCancellableError, TaskCancelled, TaskFailed
from taskq._core.store import NodeRecord, Store
from taskq._core.workflows import PostgresNodes, advance

__all__ = ["TaskRecords", "TaskState", "TaskStatus"]

#: unknown: no record (not claimed by a worker yet, or purged); queued: recorded and waiting for a worker
#: (released, or replayed from the DLQ); running: leased by a worker (running, or claimed ahead of its run);
#: retrying: an attempt failed and the next waits in a delay tier; completed, dead (dead-lettered) and
#: cancelled are final.
TaskState = Literal["unknown", "queued", "running", "retrying", "completed", "dead", "cancelled"]
FINAL: frozenset[str] = frozenset({"completed", "dead", "cancelled"})


@dataclass(frozen=True, slots=True)
class TaskStatus:
    """A task's state as its idempotency record says, with its attempts, last error, result and times."""

    task_id: str
    idempotency_key: str | None
    state: TaskState
    task_type: str | None = None
    #: Attempts claimed, the current one included (a takeover from a dead worker is not a new attempt).
    attempts: int = 0
    #: Claims taken over from workers that died holding the task.
    takeovers: int = 0
    last_error: str | None = None
    #: The handler's return value (JSON), once completed.
    result: Any = None
    #: A running task was asked to stop (cancel): its handler sees ctx.cancelled.
    cancel_requested: bool = False
    #: Where a dead task's DLQ record is: the namespace's DLQ topic, partition and offset.
    dlq_topic: str | None = None
    dlq_partition: int | None = None
    dlq_offset: int | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    completed_at: datetime | None = None

    @property
    def final(self) -> bool:
        """Completed, dead or cancelled: nothing more will happen to the task (a DLQ replay aside)."""
        return self.state in FINAL

    def as_dict(self) -> dict[str, Any]:
        """The status as JSON-ready values (times in ISO 8601)."""
        out: dict[str, Any] = {}
        for name in self.__slots__:
            value = getattr(self, name)
            out[name] = value.isoformat() if isinstance(value, datetime) else value
        return out


def status_of(row: Mapping[str, Any] | None, *, task_id: str, dlq_topic: str) -> TaskStatus:
    """The status a record (a row of `get`, or None) says, for the task `task_id`."""
    if row is None:
        return TaskStatus(task_id=task_id, idempotency_key=None, state="unknown")
    stored: str = row["state"]
    state: TaskState
    if stored == "running":
        # A released claim (its worker stopped or lost the partition before the run) waits for a new owner.
        state = "running" if row.get("lease_owner") else "queued"
    elif stored == "failed":
        state = "retrying" if row["attempts"] else "queued"  # a DLQ replay starts the attempts over
    elif stored in ("completed", "dead", "cancelled"):
        state = stored  # type: ignore[assignment]
    else:
        state = "unknown"
    dead = stored == "dead" and row.get("dlq_offset") is not None
    return TaskStatus(
        task_id=row["task_id"] or task_id,
        idempotency_key=row["idempotency_key"],
        state=state,
        task_type=row["task_type"] or None,
        attempts=int(row["attempts"] or 0),
        takeovers=int(row.get("takeovers") or 0),
        last_error=row["last_error"],
        result=row["result"] if stored == "completed" else None,
        cancel_requested=bool(row.get("cancel_requested")),
        dlq_topic=dlq_topic if dead else None,
        dlq_partition=row.get("dlq_partition") if dead else None,
        dlq_offset=row.get("dlq_offset") if dead else None,
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        completed_at=row["completed_at"],
    )


class TaskRecords(Protocol):
    """Where task records are read and cancelled: Postgres (`PostgresTaskRecords`), or
    `taskq.testing.InMemoryStore`."""

    def get(self, idempotency_key: str) -> Mapping[str, Any] | None: ...
    def find(self, task_id: str) -> Mapping[str, Any] | None: ...
    def cancel(self, idempotency_key: str, task_id: str = "") -> tuple[str, int, bool]: ...
    def workflow_create(self, workflow_id: str, nodes: Sequence[NodeRecord]) -> None: ...
    def workflow_status(self, workflow_id: str) -> tuple[str | None, bool, dict[str, int]]: ...
    def workflow_cancel(self, workflow_id: str) -> tuple[int, int]: ...
    def close(self) -> None: ...


class PostgresTaskRecords:
    """One namespace's task records in Postgres."""

    def __init__(self, database: Database, namespace: str) -> None:
        self.database = database
        self.namespace = namespace
        self._store = Store(database)

    def get(self, idempotency_key: str) -> Mapping[str, Any] | None:
        """The record of one key, or None."""
        return self._store.get(self.namespace, idempotency_key)

    def find(self, task_id: str) -> Mapping[str, Any] | None:
        """The record of the task with this id (a scan of the namespace's records), or None."""
        return self._store.task_by_id(self.namespace, task_id)

    def cancel(self, idempotency_key: str, task_id: str = "") -> tuple[str, int, bool]:
        """Cancel a key: (its stored state before, or "unknown"; its attempts; whether a worker held it)."""
        return self._store.cancel(self.namespace, idempotency_key, task_id)

    def workflow_create(self, workflow_id: str, nodes: Sequence[NodeRecord]) -> None:
        """Write a new workflow and stage its first tasks in the outbox, in one transaction."""
        with self.database.transaction() as tx:
            self._store.workflow_create(tx, self.namespace, workflow_id, nodes)
            advance(PostgresNodes(tx, self.namespace), start=[(workflow_id, 0)])

    def workflow_status(self, workflow_id: str) -> tuple[str | None, bool, dict[str, int]]:
        """(the workflow's state or None if unknown, whether it was cancelled, its tasks by state)."""
        row, counts = self._store.workflow_get(self.namespace, workflow_id)
        return (None, False, {}) if row is None else (row["state"], bool(row["cancelled"]), counts)

    def workflow_cancel(self, workflow_id: str) -> tuple[int, int]:
        """Cancel a workflow: (its staged tasks, of which not started)."""
        with self.database.transaction() as tx:
            return self._store.workflow_cancel(tx, self.namespace, workflow_id)

    def close(self) -> None:
        """Close the connection."""
        self.database.close()


def lookup(
    records: TaskRecords, task_id: str | None, idempotency_key: str | None
) -> tuple[str, Mapping[str, Any] | None]:
    """(the name to report the task by, its record or None), by key if given, else by task id."""
    if idempotency_key is not None:
        row = records.get(idempotency_key)
        if row is not None and task_id is not None and row["task_id"] not in (task_id, ""):
            # The key's record is another task's (a duplicate enqueue of the key): it decides this one.
            return task_id, row
        return task_id or idempotency_key, row
    if task_id is None:
        raise InvalidTaskError("give a task id or an idempotency key")
    return task_id, records.find(task_id)


class Polls:
    """When to read a task's status again while waiting for its result: 50 ms, growing by half to 1 s,
    never past `timeout` seconds from now (then TimeoutError). Shared by the blocking and the asyncio
    producers, which differ only in how they wait."""

    def __init__(self, timeout: float | None) -> None:
        self._timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._pause = 0.05

    def next(self, current: TaskStatus) -> float:
        """Seconds to wait before reading again, `current` not being final; TimeoutError when time is up."""
        pause = self._pause
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"task {current.task_id} is {current.state} after {self._timeout}s")
            pause = min(pause, left)
        self._pause = min(pause * 1.5, 1.0)
        return pause


def wait_for_result(
    status: Callable[[], TaskStatus], timeout: float | None, *, sleep: Callable[[float], None] = time.sleep
) -> Any:
    """Poll `status` (see Polls) until the task is final: its result if completed; TaskFailed if dead,
    TaskCancelled if cancelled, TimeoutError if `timeout` seconds pass first."""
    polls = Polls(timeout)
    while True:
        current = status()
        if current.final:
            return result_of(current)
        sleep(polls.next(current))


def result_of(status: TaskStatus) -> Any:
    """A final status's result, or the error saying why there is none."""
    if status.state == "completed":
        return status.result
    if status.state == "dead":
        raise TaskFailed(
            status.task_id,
            status.last_error or "dead-lettered",
            dlq_topic=status.dlq_topic,
            dlq_partition=status.dlq_partition,
            dlq_offset=status.dlq_offset,
        )
    if status.state == "cancelled":
        raise TaskCancelled(f"task {status.task_id} was cancelled")
    raise InvalidTaskError(f"task {status.task_id} is {status.state}: it has no result yet")


def cancel(records: TaskRecords, task_id: str | None, idempotency_key: str | None) -> bool:
    """Cancel a task (see TaskProducer.cancel); whether it had started."""
    name = task_id or idempotency_key
    if idempotency_key is None:
        if task_id is None:
            raise InvalidTaskError("give a task id or an idempotency key")
        row = records.find(task_id)
        if row is None:
            raise InvalidTaskError(
                f"task {task_id} has no record yet (no worker has claimed it): cancel it by its "
                "idempotency key (its receipt's), which a claim checks"
            )
        idempotency_key = row["idempotency_key"]
    before, attempts, held = records.cancel(idempotency_key, task_id or "")
    if before in FINAL:
        raise NotCancellableError(f"task {name}", before)
    # Started: a worker holds it (running, or claimed ahead of its run), or an attempt of it ran before.
    return held or (attempts > 0 and before != "unknown")
