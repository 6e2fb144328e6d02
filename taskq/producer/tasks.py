"""What the producer takes and gives (`TaskSpec`, `Receipt`, the derived idempotency key), and `Encoder`,
which turns tasks into Kafka records: a task type's schema (fetched, cached, compiled), the checks on a
task's options, its envelope headers and its encoded payload. Nothing here sends."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any, NamedTuple
from uuid import UUID

from taskq._core.broker import OutRecord
from taskq._core.durations import pick_delay_tier
from taskq._core.envelope import (
    ATTEMPT,
    ENQUEUED_AT,
    IDEMPOTENCY_KEY,
    MAX_ATTEMPTS,
    MAX_ATTEMPTS_HEADER,
    MAX_DELAY,
    MAX_HEADER_BYTES,
    MAX_TIMEOUT_SECONDS,
    NOT_BEFORE,
    ORIGIN_TOPIC,
    PRIORITIES,
    PRIORITY,
    TASK_ID,
    TASK_TYPE,
    TIMEOUT,
    Envelope,
    Priority,
    Topics,
    ms_header,
    new_task_id,
    timeout_header,
)
from taskq._core.errors import (
    InvalidPriorityError,
    InvalidTaskError,
    PayloadTooLargeError,
    UnknownTaskTypeError,
)
from taskq._core.settings import Settings
from taskq._core.tracing import Tracer
from taskq.schemas import avro
from taskq.schemas.errors import PayloadValidationError, SchemaNotFoundError
from taskq.schemas.registry import SchemaRegistry


class _ReceiptFields(NamedTuple):
    task_id: str
    task_type: str
    topic: str
    priority: Priority
    idempotency_key: str
    not_before: datetime | None = None
    partition: int | None = None
    offset: int | None = None


class Receipt(_ReceiptFields):
    """What enqueue() accepted: the task id, its topic and keys; partition/offset once confirmed.

    From a producer's enqueue, it also asks that producer what became of the task (`status`, `result`,
    `cancel`), by the task's idempotency key: one primary-key probe of its record.
    """

    #: The producer that enqueued it (None for a receipt built by hand).
    producer: Any = None

    def _asked(self) -> Any:
        if self.producer is None:
            raise InvalidTaskError("this receipt was not made by a producer: ask one, producer.status(...)")
        return self.producer

    def status(self) -> Any:
        """The task's TaskStatus (TaskProducer.status)."""
        return self._asked().status(self.task_id, idempotency_key=self.idempotency_key)

    def result(self, timeout: float | None = None) -> Any:
        """Wait for the task's result (TaskProducer.result)."""
        return self._asked().result(self.task_id, idempotency_key=self.idempotency_key, timeout=timeout)

    def cancel(self) -> bool:
        """Cancel the task (TaskProducer.cancel); whether it had started."""
        started: bool = self._asked().cancel(self.task_id, idempotency_key=self.idempotency_key)
        return started


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskSpec:
    """One task for enqueue_many(): the arguments of enqueue()."""

    task_type: str
    payload: Mapping[str, Any]
    priority: str = "normal"
    idempotency_key: str | None = None
    key: str | bytes | None = None
    delay: timedelta | float | datetime | None = None
    #: When the task is due (a timezone-aware datetime; a past one runs now), instead of a delay.
    at: datetime | None = None
    max_attempts: int | None = None
    timeout: float | timedelta | None = None
    task_id: str | None = None
    extra_headers: Sequence[tuple[str, bytes]] = field(default_factory=tuple)


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return {"$bytes": bytes(value).hex()}
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Decimal | UUID):
        return str(value)
    raise TypeError(f"cannot derive an idempotency key from a {type(value).__name__}")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def derive_idempotency_key(task_type: str, payload: Mapping[str, Any]) -> str:
    """`<task type>:<sha256 of the payload's canonical JSON>`: sorted keys, no spaces, bytes as hex.

    The same payload always gives the same key, so enqueueing it twice has one effect. Pass an explicit
    key (``charge:<payment-id>``) when the meaning of the task, not its bytes, decides what is a duplicate.
    """
    canonical = json.dumps(
        payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_jsonable
    )
    return f"{task_type}:{hashlib.sha256(canonical.encode()).hexdigest()[:32]}"


@dataclass(frozen=True, slots=True)
class _TaskType:
    name: str
    schema_id: int
    parsed: avro.ParsedSchema
    fetched_at: float
    check: avro.Check | None  # the quick payload test; full validation when it is None or says no
    write: avro.Writer | None  # the compiled encoder of what the quick test passes; fastavro's otherwise
    prefix: bytes  # the Confluent framing of its values: magic byte and schema id
    header: tuple[str, bytes]  # its task-type header


@dataclass(frozen=True, slots=True)
class _Route:
    """Where a task goes and the envelope headers its options decide: shared by every task of a batch."""

    priority: Priority
    topic: str
    not_before: datetime | None
    head: tuple[tuple[str, bytes], ...]  # after the task's id, type and idempotency key: priority, attempt
    tail: tuple[tuple[str, bytes], ...]  # after enqueued-at: origin topic, max attempts, not-before, timeout


class _Accepted(NamedTuple):
    """A batch that passed validation and the limits: its records, in order, and what their receipts say."""

    records: list[OutRecord]
    tasks: list[tuple[str, str, str, _Route]]  # task id, idempotency key, task type, route

    def receipts(self, producer: Any = None) -> list[Receipt]:
        """The receipts of the batch, before acknowledgement (no partition, no offset)."""
        out = [Receipt(t, tt, r.topic, r.priority, k, r.not_before) for t, k, tt, r in self.tasks]
        if producer is not None:
            for receipt in out:
                receipt.producer = producer
        return out


class _Bulk(NamedTuple):
    """enqueue_many(task_type, payloads, ...): one task type and one set of options for many payloads."""

    task_type: str
    payloads: list[Mapping[str, Any]]
    idempotency_keys: Sequence[str] | None
    keys: Sequence[str | bytes | None] | None
    priority: str
    delay: timedelta | float | datetime | None
    at: datetime | None
    max_attempts: int | None
    timeout: float | timedelta | None


#: What refuses one task of a batch (rather than the whole call).
_REFUSED_TASK = (PayloadValidationError, PayloadTooLargeError, InvalidTaskError, InvalidPriorityError)


def _in_batch(exc: Exception, i: int, n: int) -> Exception:
    """The same refusal, naming the task of the batch it is about."""
    if n > 1 and exc.args and isinstance(exc.args[0], str):
        exc.args = (f"task {i} of {n}: {exc.args[0]}", *exc.args[1:])
    return exc


def check_priority(priority: str) -> Priority:
    """The priority, if it is one of PRIORITIES; InvalidPriorityError if not."""
    if priority not in PRIORITIES:
        raise InvalidPriorityError(f"priority {priority!r} is not one of {', '.join(PRIORITIES)}")
    return priority


class Encoder:
    """Validates and encodes tasks into records; a task type's schema is cached, for `schema_ttl` seconds
    unless it was given (`local_schemas`, full name -> schema), which the registry must then hold."""

    def __init__(
        self,
        settings: Settings,
        registry: SchemaRegistry,
        *,
        local_schemas: Mapping[str, dict[str, Any]],
        auto_register: bool,
        schema_ttl: float,
        max_payload_bytes: int,
    ) -> None:
        self.settings = settings
        self.topics = Topics(settings.namespace, settings.delay_tiers)
        self.registry = registry
        self._tracer = Tracer()
        self._max_payload = max_payload_bytes
        self._auto_register = auto_register
        self._schema_ttl = schema_ttl
        self._lock = threading.Lock()
        self._types: dict[str, _TaskType] = {}
        self._local_schemas = dict(local_schemas)
        self._plain_routes: dict[str, _Route] = {}

    def must_fetch(self, batch: _Bulk | Sequence[TaskSpec]) -> bool:
        """Whether encoding the batch would ask the registry for a schema (one not cached, or stale)."""
        now = time.monotonic()
        names = (batch.task_type,) if isinstance(batch, _Bulk) else {s.task_type for s in batch}
        for name in names:
            hit = self._types.get(name)
            if hit is None or (name not in self._local_schemas and now - hit.fetched_at >= self._schema_ttl):
                return True
        return False

    def _task_type(self, task_type: str) -> _TaskType:
        now = time.monotonic()
        hit = self._types.get(task_type)  # a dict read is atomic; the lock guards the writes
        if hit is not None and (task_type in self._local_schemas or now - hit.fetched_at < self._schema_ttl):
            return hit
        if not isinstance(task_type, str) or not task_type:
            raise InvalidTaskError(f"task_type must be a non-empty string, got {task_type!r}")
        if len(task_type.encode()) > MAX_HEADER_BYTES:
            raise InvalidTaskError(f"task_type must be at most {MAX_HEADER_BYTES} bytes")
        local = self._local_schemas.get(task_type)
        try:
            if local is not None:
                try:
                    reg = self.registry.lookup(local)
                except SchemaNotFoundError:
                    if not self._auto_register:
                        raise UnknownTaskTypeError(
                            f"the schema of {task_type!r} given to the producer is not registered; "
                            "run `taskq schemas register` for it (or pass auto_register=True)"
                        ) from None
                    reg = self.registry.register(local)
            else:
                reg = self.registry.latest(task_type)
        except SchemaNotFoundError as exc:
            raise UnknownTaskTypeError(
                f"unknown task type {task_type!r}: no schema is registered under that subject "
                "(register it with `taskq schemas register PATH`)"
            ) from exc
        entry = _TaskType(
            task_type,
            reg.schema_id,
            reg.parsed,
            now,
            avro.compile_check(reg.parsed),
            avro.compile_writer(reg.parsed),
            avro.frame(reg.schema_id, b""),
            (TASK_TYPE, task_type.encode()),
        )
        with self._lock:
            self._types[task_type] = entry
        return entry

    def _route(
        self,
        priority: str,
        delay: timedelta | float | datetime | None,
        at: datetime | None,
        max_attempts: int | None,
        timeout: float | timedelta | None,
        now: datetime,
    ) -> _Route:
        """Check a task's options and decide its topic and the envelope headers they give."""
        if delay is None and at is None and max_attempts is None and timeout is None:
            plain = self._plain_routes.get(priority)  # the usual case, decided once per tier
            if plain is not None:
                return plain
        checked = check_priority(priority)
        # bool is an int to Python, but max_attempts=True is a mistake, not "one attempt".
        if max_attempts is not None and (
            not isinstance(max_attempts, int)
            or isinstance(max_attempts, bool)
            or not 1 <= max_attempts <= MAX_ATTEMPTS
        ):
            raise InvalidTaskError(
                f"max_attempts must be an integer from 1 to {MAX_ATTEMPTS}, got {max_attempts!r}"
            )
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        if seconds is not None and not (_is_number(seconds) and 0 < seconds <= MAX_TIMEOUT_SECONDS):
            raise InvalidTaskError(
                f"timeout must be a positive number of seconds up to {MAX_TIMEOUT_SECONDS:.0f} (7 days), "
                f"got {timeout!r}"
            )
        if at is not None:
            if delay is not None:
                raise InvalidTaskError("give delay= or at=, not both")
            if not isinstance(at, datetime):
                raise InvalidTaskError(f"at must be a timezone-aware datetime, got {at!r}")
        not_before = self._not_before(at if at is not None else delay, now)
        origin = self.topics.tier(checked)
        if not_before is None:
            topic = origin
        else:
            topic = self.topics.delay(pick_delay_tier(not_before - now, self.settings.delay_tiers))
        tail = [(ORIGIN_TOPIC, origin.encode())]
        if max_attempts is not None:
            tail.append((MAX_ATTEMPTS_HEADER, str(max_attempts).encode()))
        if not_before is not None:
            tail.append((NOT_BEFORE, ms_header(not_before)))
        if seconds is not None:
            tail.append((TIMEOUT, timeout_header(seconds)))
        route = _Route(
            checked, topic, not_before, ((PRIORITY, checked.encode()), (ATTEMPT, b"1")), tuple(tail)
        )
        if len(tail) == 1:
            self._plain_routes[checked] = route
        return route

    def _record(
        self,
        tt: _TaskType,
        route: _Route,
        payload: Mapping[str, Any],
        idem: str | None,
        key: str | bytes | None,
        task_id: str,
        enqueued_at: bytes,
    ) -> tuple[OutRecord, str]:
        """Validate and encode one task: its record and idempotency key; raises before anything is sent."""
        check, write = tt.check, tt.write
        if check is not None and check(payload):
            body = write(payload) if write is not None else avro.encode(tt.parsed, payload)
        else:
            avro.validate(tt.parsed, payload, task_type=tt.name)
            body = avro.encode(tt.parsed, payload)
        if len(body) > self._max_payload:
            raise PayloadTooLargeError(
                f"payload of {tt.name} encodes to {len(body)} bytes, over the limit of {self._max_payload}"
            )
        if idem is None:
            idem = derive_idempotency_key(tt.name, payload)
        elif not isinstance(idem, str) or not idem:
            raise InvalidTaskError(f"idempotency_key must be a non-empty string, got {idem!r}")
        elif "\x00" in idem:  # Postgres text cannot hold it: the key could never be recorded
            raise InvalidTaskError(f"idempotency_key must not contain a NUL character, got {idem!r}")
        idem_bytes = idem.encode()
        if len(idem_bytes) > MAX_HEADER_BYTES:
            raise InvalidTaskError(f"task_type and idempotency_key must be at most {MAX_HEADER_BYTES} bytes")
        headers = [
            (TASK_ID, task_id.encode()),
            tt.header,
            (IDEMPOTENCY_KEY, idem_bytes),
            *route.head,
            (ENQUEUED_AT, enqueued_at),
            *route.tail,
        ]
        # The message key orders and partitions: the caller's key, else the idempotency key.
        if key is None:
            key = idem_bytes
        elif isinstance(key, str):
            key = key.encode()
        return (route.topic, tt.prefix + body, key, headers), idem

    def _traced(
        self,
        tt: _TaskType,
        route: _Route,
        payload: Mapping[str, Any],
        idem: str | None,
        key: str | bytes | None,
        task_id: str,
        enqueued_at: bytes,
    ) -> tuple[OutRecord, str]:
        """_record in a `send` span of its own, whose context travels with the task."""
        tracer = self._tracer
        with tracer.send() as span:
            (topic, value, key_bytes, headers), idem = self._record(
                tt, route, payload, idem, key, task_id, enqueued_at
            )
            env = Envelope(task_id=task_id, task_type=tt.name, idempotency_key=idem, priority=route.priority)
            # The context travels with the task: its attempts, retries and replays join this trace.
            headers.append(("traceparent", tracer.sent(span, topic, env).encode()))
            return (topic, value, key_bytes, headers), idem

    @staticmethod
    def _not_before(delay: timedelta | float | datetime | None, now: datetime) -> datetime | None:
        if delay is None:
            return None
        if isinstance(delay, datetime):
            if delay.tzinfo is None:
                raise InvalidTaskError(f"a due time must be a timezone-aware datetime, got {delay!r} (naive)")
            at = delay
        elif isinstance(delay, timedelta | int | float) and not isinstance(delay, bool):
            # NaN and out-of-range delays would escape as ValueError/OverflowError, not as a bad argument.
            try:
                at = now + (delay if isinstance(delay, timedelta) else timedelta(seconds=delay))
            except (ValueError, OverflowError):
                raise InvalidTaskError(f"delay {delay!r} is not a representable duration") from None
        else:
            raise InvalidTaskError(f"delay must be a timedelta, seconds or an aware datetime, got {delay!r}")
        if at - now > MAX_DELAY:
            raise InvalidTaskError(f"delay {delay!r} is longer than the maximum of {MAX_DELAY.days} days")
        return at if at > now else None

    def encode(self, batch: _Bulk | Sequence[TaskSpec]) -> _Accepted:
        """Validate and encode every task of a batch; raises, naming the task, before anything is sent."""
        now = datetime.now(UTC)
        enqueued_at = ms_header(now)
        record = self._traced if self._tracer.active() else self._record
        records: list[OutRecord] = []
        tasks: list[tuple[str, str, str, _Route]] = []
        if isinstance(batch, _Bulk):
            n = len(batch.payloads)
            tt = self._task_type(batch.task_type)
            route = self._route(batch.priority, batch.delay, batch.at, batch.max_attempts, batch.timeout, now)
            # One read of the system's randomness for the whole batch, as random as one per task.
            ids = new_task_id() if n == 1 else os.urandom(16 * n).hex()
            idems = batch.idempotency_keys
            keys = batch.keys
            for i, payload in enumerate(batch.payloads):
                task_id = ids[32 * i : 32 * i + 32]
                try:
                    out, idem = record(
                        tt,
                        route,
                        payload,
                        None if idems is None else idems[i],
                        None if keys is None else keys[i],
                        task_id,
                        enqueued_at,
                    )
                except _REFUSED_TASK as exc:
                    raise _in_batch(exc, i, n) from None
                records.append(out)
                tasks.append((task_id, idem, batch.task_type, route))
            return _Accepted(records, tasks)
        n = len(batch)
        for i, spec in enumerate(batch):
            try:
                tt = self._task_type(spec.task_type)
                route = self._route(spec.priority, spec.delay, spec.at, spec.max_attempts, spec.timeout, now)
                task_id = spec.task_id or new_task_id()
                out, idem = record(
                    tt, route, spec.payload, spec.idempotency_key, spec.key, task_id, enqueued_at
                )
            except _REFUSED_TASK as exc:
                raise _in_batch(exc, i, n) from None
            if spec.extra_headers:
                out[3].extend(spec.extra_headers)
            records.append(out)
            tasks.append((task_id, idem, spec.task_type, route))
        return _Accepted(records, tasks)
