"""TaskProducer: validate a payload against its task type's schema, then enqueue it at a priority."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple, overload
from uuid import UUID

import psycopg
from psycopg import sql

from taskq._core.broker import Broker, OutRecord, Record
from taskq._core.db import Database
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
    DeliveryError,
    InvalidPriorityError,
    InvalidTaskError,
    PayloadTooLargeError,
    ProducerClosedError,
    QueueFullError,
    RateLimitedError,
    StoreUnavailableError,
    UnknownTaskTypeError,
)
from taskq._core.kafka_clients import KafkaBroker
from taskq._core.settings import Settings, redact
from taskq._core.store import outbox_stage
from taskq._core.tracing import Tracer
from taskq.producer.backpressure import DepthMonitor
from taskq.producer.metrics import producer_metrics
from taskq.producer.ratelimit import RateLimit, RateLimiter
from taskq.schemas import avro
from taskq.schemas.errors import PayloadValidationError, SchemaNotFoundError
from taskq.schemas.registry import Registry, SchemaRegistry

log = logging.getLogger("taskq.producer")

#: Kafka's default max.message.bytes is 1 MiB; leave room for headers and batch overhead.
DEFAULT_MAX_PAYLOAD_BYTES = 900 * 1024


class Receipt(NamedTuple):
    """What enqueue() accepted: the task id, its topic and keys; partition/offset once confirmed."""

    task_id: str
    task_type: str
    topic: str
    priority: Priority
    idempotency_key: str
    not_before: datetime | None = None
    partition: int | None = None
    offset: int | None = None


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

    def receipts(self) -> list[Receipt]:
        """The receipts of the batch, before acknowledgement (no partition, no offset)."""
        return [Receipt(t, tt, r.topic, r.priority, k, r.not_before) for t, k, tt, r in self.tasks]


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


class _Reports:
    """The delivery reports of one batch someone waits for or hooks into, filled in by whichever thread
    polls the Kafka client; `done(outcomes)` runs once every record is settled."""

    __slots__ = ("_done", "_hook", "_left", "_lock", "_producer", "accepted", "outcomes")

    def __init__(
        self,
        producer: TaskProducer,
        accepted: _Accepted,
        done: Callable[[list[tuple[Receipt, str | None]]], None] | None,
    ) -> None:
        self._producer = producer
        self.accepted = accepted
        self._hook = producer._on_delivery
        self._done = done
        self.outcomes: list[tuple[Receipt, str | None] | None] = [None] * len(accepted.tasks)
        self._left = len(accepted.tasks)
        self._lock = threading.Lock()

    def __call__(self, i: int, err: str | None, record: Record | None) -> None:
        task_id, idem, task_type, route = self.accepted.tasks[i]
        receipt = Receipt(
            task_id,
            task_type,
            route.topic,
            route.priority,
            idem,
            route.not_before,
            None if record is None else record.partition,
            None if record is None else record.offset,
        )
        if err is not None:
            self._producer._undelivered(task_id, task_type, err, waited=self._done is not None)
        if self._hook is not None:
            self._hook(receipt, err)
        with self._lock:  # two threads may serve reports (the caller's poll, another's flush)
            self.outcomes[i] = (receipt, err)
            self._left -= 1
            last = self._left == 0
        if last and self._done is not None:
            self._done([o for o in self.outcomes if o is not None])


class _Failures:
    """The one delivery callback of a batch nobody waits for: it hears only of failures.

    In-flight records keep it alive until their reports, so it keeps little: the task ids and types, and
    for a batch of more than one the topic, value and key that tell its records apart (a failed record comes
    back without its headers)."""

    __slots__ = ("_producer", "_tasks")

    def __init__(self, producer: TaskProducer, accepted: _Accepted) -> None:
        self._producer = producer
        tasks = accepted.tasks
        if len(tasks) == 1:
            self._tasks: list[tuple[str, str, str, bytes | None, bytes | None]] = [
                (tasks[0][0], tasks[0][2], "", None, None)
            ]
        else:
            self._tasks = [
                (task_id, task_type, topic, value, key)
                for (task_id, _, task_type, _), (topic, value, key, _) in zip(
                    tasks, accepted.records, strict=True
                )
            ]

    def __call__(self, err: str, record: Record) -> None:
        tasks = self._tasks
        found = 0
        if len(tasks) > 1:
            # Records equal in topic, value and key are told apart by reporting each one once.
            target = (record.topic, record.value, record.key)
            found = next((i for i, t in enumerate(tasks) if (t[2], t[3], t[4]) == target), -1)
        if found < 0:
            self._producer._undelivered("?", "?", err)
            return
        task_id, task_type, _, _, _ = tasks[found]
        tasks[found] = (task_id, task_type, "", None, None)  # reported: matches no record any more
        self._producer._undelivered(task_id, task_type, err)


def _settled(outcomes: Sequence[tuple[Receipt, str | None]]) -> list[Receipt]:
    """The acknowledged receipts of a batch someone waited for; DeliveryError if any task failed."""
    failed = [(r.task_id, err) for r, err in outcomes if err is not None]
    if failed:
        raise DeliveryError(f"{len(failed)} task(s) not acknowledged: {failed[0][1]}", failures=failed)
    return [r for r, _ in outcomes]


#: What refuses one task of a batch (rather than the whole call).
_REFUSED_TASK = (PayloadValidationError, PayloadTooLargeError, InvalidTaskError, InvalidPriorityError)


def _in_batch(exc: Exception, i: int, n: int) -> Exception:
    """The same refusal, naming the task of the batch it is about."""
    if n > 1 and exc.args and isinstance(exc.args[0], str):
        exc.args = (f"task {i} of {n}: {exc.args[0]}", *exc.args[1:])
    return exc


#: The enqueues between two polls of the Kafka client when nobody waits: a poll serves delivery reports
#: (only failures, then) and costs about as much as building a record's headers.
_POLL_EVERY = 64


class TaskProducer:
    """Enqueues typed tasks: validates, rate-limits, checks depth, then hands them to Kafka (acks=all)."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        schemas: Mapping[str, str | Path | Mapping[str, Any]] | Iterable[str | Path] = (),
        registry: SchemaRegistry | None = None,
        broker: Broker | None = None,
        rate_limits: Sequence[RateLimit] = (),
        depth_limits: Mapping[str, int] | None = None,
        depth_refresh: float = 2.0,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        auto_register: bool = False,
        on_delivery: Callable[[Receipt, str | None], None] | None = None,
        schema_ttl: float = 60.0,
        kafka_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.settings = settings or Settings.from_env()
        self.topics = Topics(self.settings.namespace, self.settings.delay_tiers)
        self._owns_registry = registry is None
        self.registry: SchemaRegistry = registry or Registry.from_settings(self.settings)
        self.broker: Broker = broker or KafkaBroker(self.settings)
        self._metrics = producer_metrics()
        self._tracer = Tracer()
        # Label children bound once per (task type, priority): labels() costs a lock and a tuple per call.
        self._enqueued: dict[tuple[str, str], Any] = {}
        self._sink = self.broker.sink(**dict(kafka_config or {}))
        self._max_payload = max_payload_bytes
        self._auto_register = auto_register
        self._on_delivery = on_delivery
        self._schema_ttl = schema_ttl
        self._lock = threading.Lock()
        self._types: dict[str, _TaskType] = {}
        self._local_schemas: dict[str, dict[str, Any]] = {}
        self._failures: list[tuple[str, str]] = []
        self._plain_routes: dict[str, _Route] = {}
        self._unpolled = 0
        self._closed = False
        items = schemas.items() if isinstance(schemas, Mapping) else ((None, s) for s in schemas)
        for name, source in items:
            schema = dict(source) if isinstance(source, Mapping) else avro.load_schema(source)
            full = avro.full_name(schema)
            if name is not None and name != full:
                raise InvalidTaskError(f"schema given for task type {name!r} is the record {full!r}")
            self._local_schemas[full] = schema
        needs_db = any(limit.shared for limit in rate_limits)
        self._limiter = RateLimiter(
            rate_limits,
            namespace=self.settings.namespace,
            database=Database(self.settings.database_url, schema=self.settings.database_schema)
            if needs_db
            else None,
        )
        self._depth: DepthMonitor | None = None
        if depth_limits:
            for p in depth_limits:
                self._check_priority(p)
            self._depth = DepthMonitor(
                self.broker.admin(),
                self.settings.worker_group,
                self.topics,
                depth_limits,
                refresh=depth_refresh,
            )

    @classmethod
    def from_env(cls, **kwargs: Any) -> TaskProducer:
        """A producer configured from TASKQ_* environment variables."""
        return cls(Settings.from_env(), **kwargs)

    # ---------------------------------------------------------------- schemas
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

    # ---------------------------------------------------------------- enqueue
    def _check_priority(self, priority: str) -> Priority:
        if priority not in PRIORITIES:
            raise InvalidPriorityError(f"priority {priority!r} is not one of {', '.join(PRIORITIES)}")
        return priority

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
        checked = self._check_priority(priority)
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

    def enqueue(
        self,
        task_type: str,
        payload: Mapping[str, Any],
        *,
        priority: str = "normal",
        idempotency_key: str | None = None,
        key: str | bytes | None = None,
        delay: timedelta | float | datetime | None = None,
        at: datetime | None = None,
        max_attempts: int | None = None,
        timeout: float | timedelta | None = None,
        wait: bool = False,
        conn: psycopg.Connection[Any] | None = None,
    ) -> Receipt:
        """Enqueue one task; raises, sending nothing, on invalid input, a full tier or an exhausted limit.
        With `conn`, the task is staged in the outbox inside that connection's transaction (enqueue_many)."""
        started = time.perf_counter()
        # Positional: a named tuple built by keyword costs twice as much, on every enqueue.
        bulk = _Bulk(
            task_type,
            [payload],
            None if idempotency_key is None else (idempotency_key,),
            None if key is None else (key,),
            priority,
            delay,
            at,
            max_attempts,
            timeout,
        )
        return self._enqueue(bulk, wait, conn, started)[0]

    @overload
    def enqueue_many(
        self, tasks: Iterable[TaskSpec], /, *, wait: bool = False, conn: psycopg.Connection[Any] | None = None
    ) -> list[Receipt]: ...

    @overload
    def enqueue_many(
        self,
        task_type: str,
        payloads: Iterable[Mapping[str, Any]],
        /,
        *,
        priority: str = "normal",
        idempotency_keys: Sequence[str] | None = None,
        keys: Sequence[str | bytes | None] | None = None,
        delay: timedelta | float | datetime | None = None,
        at: datetime | None = None,
        max_attempts: int | None = None,
        timeout: float | timedelta | None = None,
        wait: bool = False,
        conn: psycopg.Connection[Any] | None = None,
    ) -> list[Receipt]: ...

    def enqueue_many(
        self,
        tasks: Iterable[TaskSpec] | str,
        payloads: Iterable[Mapping[str, Any]] | None = None,
        /,
        *,
        priority: str = "normal",
        idempotency_keys: Sequence[str] | None = None,
        keys: Sequence[str | bytes | None] | None = None,
        delay: timedelta | float | datetime | None = None,
        at: datetime | None = None,
        max_attempts: int | None = None,
        timeout: float | timedelta | None = None,
        wait: bool = False,
        conn: psycopg.Connection[Any] | None = None,
    ) -> list[Receipt]:
        """Enqueue a batch: every task is validated first, so an invalid one means none is sent (the error
        names it: `task 3 of 100: ...`). Either `enqueue_many(task_type, payloads, ...)`, the payloads of one
        task type with the options of enqueue() shared by all (idempotency_keys and keys, if given, one per
        payload), or `enqueue_many(tasks)`, TaskSpecs each with options of its own.

        With `wait`, returns once the broker acknowledged every task (each receipt with its partition and
        offset), or raises DeliveryError listing those it refused. With `conn` (a psycopg connection in the
        application's open transaction) the tasks are staged in the outbox through it instead: they are
        published by a relay after, and only if, that transaction commits.
        """
        started = time.perf_counter()
        return self._enqueue(
            self._batch(tasks, payloads, priority, idempotency_keys, keys, delay, at, max_attempts, timeout),
            wait,
            conn,
            started,
        )

    def _batch(
        self,
        tasks: Iterable[TaskSpec] | str,
        payloads: Iterable[Mapping[str, Any]] | None,
        priority: str,
        idempotency_keys: Sequence[str] | None,
        keys: Sequence[str | bytes | None] | None,
        delay: timedelta | float | datetime | None,
        at: datetime | None,
        max_attempts: int | None,
        timeout: float | timedelta | None,
    ) -> _Bulk | list[TaskSpec]:
        """enqueue_many's arguments as one batch; InvalidTaskError for a call that mixes its two forms."""
        if not isinstance(tasks, str):
            if payloads is not None or idempotency_keys is not None or keys is not None:
                raise InvalidTaskError(
                    "enqueue_many(tasks) takes TaskSpecs only; give payloads with a task type: "
                    "enqueue_many(task_type, payloads, ...)"
                )
            shared = (priority != "normal", delay, at, max_attempts, timeout)
            if any(v not in (None, False) for v in shared):
                raise InvalidTaskError(
                    "enqueue_many(tasks): each TaskSpec carries its own options (priority, delay, ...)"
                )
            return list(tasks)
        if payloads is None:
            raise InvalidTaskError("enqueue_many(task_type, payloads): the payloads are missing")
        listed = list(payloads)
        for name, given in (("idempotency_keys", idempotency_keys), ("keys", keys)):
            if given is not None and (isinstance(given, str | bytes) or len(given) != len(listed)):
                raise InvalidTaskError(
                    f"{name} must be a sequence of one per payload ({len(listed)}), got {given!r:.80}"
                )
        return _Bulk(
            task_type=tasks,
            payloads=listed,
            idempotency_keys=idempotency_keys,
            keys=keys,
            priority=priority,
            delay=delay,
            at=at,
            max_attempts=max_attempts,
            timeout=timeout,
        )

    def _enqueue(
        self, batch: _Bulk | list[TaskSpec], wait: bool, conn: psycopg.Connection[Any] | None, started: float
    ) -> list[Receipt]:
        if conn is not None:
            self._check_stageable(wait)
            accepted = self._accept(batch)
            statement, params = self._staged(accepted)
            try:
                conn.execute(statement, params)
            except psycopg.Error as exc:
                raise self._stage_failed(exc) from exc
            self._metrics.enqueue_seconds.observe(time.perf_counter() - started)
            return accepted.receipts()
        accepted = self._accept(batch)
        if not wait or not accepted.tasks:  # an empty batch has nothing to wait for
            self._send(accepted, None)
            self._metrics.enqueue_seconds.observe(time.perf_counter() - started)
            return accepted.receipts()
        settled: list[list[tuple[Receipt, str | None]]] = []
        self._send(accepted, settled.append)
        self._metrics.enqueue_seconds.observe(time.perf_counter() - started)
        while not settled:
            self._sink.poll(0.05)
        return _settled(settled[0])

    # The two halves of an enqueue, for AsyncTaskProducer too: _accept may wait on the registry or a shared
    # rate limit (_may_block says whether it can), _send only hands records to the Kafka client.
    def _accept(self, batch: _Bulk | Sequence[TaskSpec]) -> _Accepted:
        """Validate, encode, and pass the depth and rate limits; raises, having sent nothing."""
        if self._closed:
            raise ProducerClosedError()
        try:
            accepted = self._encode(batch)
        except PayloadValidationError:
            self._metrics.rejected.labels("invalid_payload").inc()
            raise
        except UnknownTaskTypeError:
            self._metrics.rejected.labels("unknown_task_type").inc()
            raise
        except PayloadTooLargeError:
            self._metrics.rejected.labels("too_large").inc()
            raise
        except (InvalidPriorityError, InvalidTaskError):
            self._metrics.rejected.labels("invalid_argument").inc()
            raise
        if self._depth is not None:
            incoming = Counter(route.priority for _, _, _, route in accepted.tasks)
            try:
                for priority, n in incoming.items():
                    self._depth.check(priority, incoming=n)
            except QueueFullError:
                self._metrics.rejected.labels("queue_full").inc()
                raise
        if self._limiter.limited:
            try:
                self._limiter.acquire([(tt, route.priority) for _, _, tt, route in accepted.tasks])
            except RateLimitedError:
                self._metrics.rejected.labels("rate_limited").inc()
                raise
        return accepted

    def _encode(self, batch: _Bulk | Sequence[TaskSpec]) -> _Accepted:
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

    @staticmethod
    def _check_stageable(wait: bool) -> None:
        if wait:
            raise InvalidTaskError(
                "wait=True cannot be combined with conn=: a task staged in your transaction is published "
                "after it commits"
            )

    def _staged(self, accepted: _Accepted) -> tuple[sql.Composed, dict[str, Any]]:
        """The statement staging accepted tasks in the outbox, and its parameters."""
        statement, params = outbox_stage(
            self.settings.database_schema,
            self.settings.namespace,
            [(topic, key, value or b"", headers) for topic, value, key, headers in accepted.records],
        )
        self._count(accepted)
        return statement, params

    def _stage_failed(self, exc: psycopg.Error) -> StoreUnavailableError:
        hint = " (run `taskq db migrate`)" if isinstance(exc, psycopg.errors.UndefinedTable) else ""
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return StoreUnavailableError(
            redact(f"staging tasks in the outbox failed: {text}{hint}", self.settings.database_url)
        )

    def _count(self, accepted: _Accepted) -> None:
        """Count a batch's tasks, one increment per task type and tier."""
        tasks = accepted.tasks
        if not tasks:
            return
        _, _, first, route = tasks[0]
        if len(tasks) == 1 or all(tt is first and r is route for _, _, tt, r in tasks):
            counts: Mapping[tuple[str, str], int] = {(first, route.priority): len(tasks)}
        else:
            counts = Counter((tt, r.priority) for _, _, tt, r in tasks)
        for labels, n in counts.items():
            counter = self._enqueued.get(labels)
            if counter is None:
                counter = self._enqueued[labels] = self._metrics.enqueued.labels(*labels)
            counter.inc(n)

    def _may_block(self, batch: _Bulk | Sequence[TaskSpec]) -> bool:
        """Whether _accept could wait on I/O: a schema to fetch from the registry, or a shared rate limit."""
        if self._limiter.shared:
            return True
        now = time.monotonic()
        names = (batch.task_type,) if isinstance(batch, _Bulk) else {s.task_type for s in batch}
        for name in names:
            hit = self._types.get(name)
            if hit is None or (name not in self._local_schemas and now - hit.fetched_at >= self._schema_ttl):
                return True
        return False

    def _send(
        self, accepted: _Accepted, done: Callable[[list[tuple[Receipt, str | None]]], None] | None
    ) -> None:
        """Hand accepted tasks to the Kafka client. `done(outcomes)` hears, once, of every task's
        acknowledgement (its receipt with partition and offset) or failure, from whichever thread polls the
        client; a failure nobody waits for is kept for flush()."""
        if done is not None or self._on_delivery is not None:
            self._sink.send_many(accepted.records, on_delivery=_Reports(self, accepted, done))
        else:
            # Nobody waits for an offset: the batch shares one callback, which hears only of failures.
            self._sink.send_many(accepted.records, on_failure=_Failures(self, accepted))
        self._count(accepted)
        self._unpolled += len(accepted.records)
        if self._unpolled >= _POLL_EVERY or self._on_delivery is not None:
            self._unpolled = 0
            self._sink.poll(0)

    def _undelivered(self, task_id: str, task_type: str, err: str, *, waited: bool = False) -> None:
        """A task was not acknowledged: kept for flush() unless its waiter raises it (reported once)."""
        self._metrics.delivery_failed.inc()
        log.error("task %s (%s) was not acknowledged: %s", task_id, task_type, err)
        if not waited:
            with self._lock:
                self._failures.append((task_id, err))

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every accepted task is acknowledged; DeliveryError lists any the broker refused."""
        left = self._sink.flush(timeout)
        with self._lock:
            failures, self._failures = self._failures, []
        if failures:
            raise DeliveryError(
                f"{len(failures)} task(s) were not acknowledged by Kafka, first: {failures[0][1]}",
                failures=failures,
            )
        if left:
            raise DeliveryError(f"{left} task(s) still unacknowledged after {timeout}s")

    def close(self, timeout: float | None = None) -> None:
        """Flush, then release the Kafka client and background threads."""
        if self._closed:
            return
        try:
            self.flush(timeout)
        finally:
            self._closed = True
            if self._depth is not None:
                self._depth.close()
            self._limiter.close()
            if self._owns_registry:
                self.registry.close()

    def depth(self) -> dict[str, int]:
        """The last measured depth per tier (empty without depth limits)."""
        return self._depth.depths() if self._depth is not None else {}

    def __enter__(self) -> TaskProducer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
