"""Intake, the worker's first stage: a batch of fetched records in, the tasks they decode to out.

Decoding and validation only: the envelope, the handler, the payload (Avro, read into the handler's reader
schema, then its upcaster) and, for a limited task type, its gate. Input that can never run comes back
as `Rejected`, for the DLQ with its reason (invariant 6). Records that wait for the schema registry are
held here (their offsets stay uncommitted) and come back from `retry_ready` once it may answer again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from taskq._core.envelope import WORKFLOW_HEADER, Envelope, EnvelopeError, Priority, Topics, shown
from taskq._core.kafka import TP, Record
from taskq._core.workflows import parse_header
from taskq.consumer.handlers import Handlers, HandlerSpec, TaskContext, task_fields
from taskq.consumer.limits import Gate, KeyFailedError, Limits
from taskq.schemas import avro
from taskq.schemas.errors import DecodeError, RegistryUnavailableError, SchemaError, SchemaNotFoundError
from taskq.schemas.registry import SchemaRegistry

__all__ = ["Intake", "Rejected", "Task", "fields", "size"]

log = logging.getLogger("taskq.worker")


@dataclass(slots=True)
class Task:
    """One fetched task on its way through the worker's stages."""

    record: Record
    envelope: Envelope
    spec: HandlerSpec
    payload: Any
    generation: int  # its partition's assignment when it was fetched
    tier: Priority
    attempts: int = 0
    claimed_at: float = 0.0
    suspect: bool = False  # taken over from a dead worker before: its run is marked started first
    grouped: bool = False  # runs in a group commit
    gate: Gate | None = None  # the concurrency slot and rate bucket of a limited task type
    recorded: bool = False  # the completion was recorded inside the handler's transaction
    span: Any = None  # the attempt's span, when tracing
    ctx: TaskContext | None = None  # the running attempt's context (ctx.cancelled is set on it)
    workflow: str | None = None  # its workflow header, if it is a step of a workflow (read once)


@dataclass(frozen=True, slots=True)
class Rejected:
    """A record that can never run: to the DLQ with this reason."""

    record: Record
    reason: str
    error_type: str


def fields(task: Task) -> dict[str, Any]:
    """The `extra` of a log line about a task: its id, idempotency key, type, tier and attempt."""
    env = task.envelope
    return task_fields(env.task_id, env.idempotency_key, env.task_type, env.priority, task.attempts)


def size(record: Record) -> int:
    """Bytes a buffered record holds: its value and headers."""
    return len(record.value or b"") + sum(len(k) + len(v) for k, v in record.headers)


def _workflow_of(record: Record) -> str | None:
    """The record's workflow header (`<workflow id>:<node>`), if its task is a step of a workflow;
    EnvelopeError if it is not one (its outcome would be recorded by it, in Postgres)."""
    for name, value in record.headers:
        if name == WORKFLOW_HEADER:
            if b"\x00" in value:
                raise EnvelopeError(f"header {WORKFLOW_HEADER} contains a NUL byte: {shown(value)}")
            try:
                text = value.decode()
                parse_header(text)
            except ValueError:  # UnicodeDecodeError is one
                raise EnvelopeError(
                    f"header {WORKFLOW_HEADER} is {shown(value)}, not <workflow id>:<node>"
                ) from None
            return text
    return None


class Intake:
    """Decodes fetched records into tasks; holds those that wait for the registry."""

    def __init__(
        self,
        handlers: Handlers,
        registry: SchemaRegistry,
        limits: Limits,
        topics: Topics,
        *,
        clock: Callable[[], float],
    ) -> None:
        self.handlers = handlers
        self.registry = registry
        self._limits = limits
        self._topics = topics
        self._clock = clock
        #: Records held while the registry is unavailable, to decode again (their offsets stay pending).
        self.undecoded: list[Record] = []
        self._retry_at = 0.0
        #: The largest record taken in so far, in bytes (the byte bound's quick check).
        self.largest = 0

    def decode(
        self, records: Sequence[Record], generation: Mapping[TP, int]
    ) -> tuple[list[Task], list[Rejected]]:
        """The batch's tasks, in order, and the records that can never run. `generation`: each partition's
        current assignment, which the tasks carry."""
        tasks: list[Task] = []
        rejected: list[Rejected] = []
        for record in records:
            out = self._decode(record, generation.get(record.tp, 0))
            if isinstance(out, Task):
                tasks.append(out)
            elif out is not None:
                rejected.append(out)
        return tasks, rejected

    def weigh(self, records: Sequence[Record]) -> None:
        """Note the largest record fetched (the byte bound's quick check reads it)."""
        if records:
            self.largest = max(self.largest, *map(size, records))

    def retry_ready(self) -> list[Record]:
        """The records held for the registry, once it may be asked again (they leave the hold)."""
        if not self.undecoded or self._clock() < self._retry_at:
            return []
        pending, self.undecoded = self.undecoded, []
        return pending

    def forget(self, tps: Iterable[TP]) -> None:
        """Drop the held records of revoked partitions: their new owner reads them again."""
        gone = set(tps)
        self.undecoded = [r for r in self.undecoded if r.tp not in gone]

    def _decode(self, record: Record, generation: int) -> Task | Rejected | None:
        """The record's task, or why it can never run; None when it is held for the registry."""
        try:
            envelope = Envelope.of(record)
            workflow = _workflow_of(record)
        except EnvelopeError as exc:
            return Rejected(record, f"bad envelope: {exc}", "taskq.EnvelopeError")
        spec = self.handlers.get(envelope.task_type)
        if spec is None:
            reason = f"unknown task type {envelope.task_type!r}: no handler registered"
            return Rejected(record, reason, "taskq.UnknownTaskType")
        try:
            schema_id, body = avro.split_frame(record.value)
            writer = self.registry.cached(schema_id)
            if writer is None:
                if self._clock() < self._retry_at:
                    # The registry failed a moment ago: wait for the retry instead of asking per record.
                    raise RegistryUnavailableError("registry unavailable a moment ago; retrying shortly")
                writer = self.registry.by_id(schema_id)
            payload = avro.decode(body, writer, spec.parsed)
        except SchemaNotFoundError as exc:
            return Rejected(record, f"unknown schema id: {exc}", "taskq.UnknownSchema")
        except DecodeError as exc:
            return Rejected(record, f"undecodable payload: {exc}", "taskq.DecodeError")
        except SchemaError as exc:
            # The registry is down or failing: not the task's fault. Hold it (its offset stays uncommitted).
            if not self.undecoded:
                log.warning("registry unavailable, holding undecoded tasks: %s", exc)
            self.undecoded.append(record)
            self._retry_at = self._clock() + 1.0
            return None
        if spec.upcaster is not None:
            try:
                payload = spec.upcaster(payload, schema_id)
            except Exception as exc:  # an upcaster that raises rejects the payload
                error_type = f"{type(exc).__module__}.{type(exc).__name__}"
                return Rejected(record, f"upcaster failed: {exc}", error_type)
        gate = None
        if spec.concurrency_limit is not None or spec.rate_limit is not None:
            try:
                gate = self._limits.gate(
                    spec.task_type,
                    payload,
                    limit=spec.concurrency_limit,
                    concurrency_key=spec.concurrency_key,
                    rate=spec.rate_limit,
                    rate_key=spec.rate_key,
                )
            except KeyFailedError as exc:  # the task cannot be placed under its limit: it never runs
                return Rejected(record, str(exc), "taskq.LimitKeyFailed")
        tier = self._topics.priority_of(record.topic)
        return Task(
            record,
            envelope,
            spec,
            payload,
            generation,
            tier or envelope.priority,
            gate=gate,
            workflow=workflow,
        )
