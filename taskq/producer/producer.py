"""TaskProducer: validate a payload against its task type's schema, then enqueue it at a priority."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any
from uuid import UUID

import psycopg
from psycopg import sql

from taskq._core.db import Database
from taskq._core.durations import pick_delay_tier
from taskq._core.envelope import (
    MAX_ATTEMPTS,
    MAX_DELAY,
    MAX_HEADER_BYTES,
    MAX_TIMEOUT_SECONDS,
    PRIORITIES,
    Envelope,
    Priority,
    Topics,
    new_task_id,
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
from taskq._core.kafka import Broker, KafkaBroker, Record
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


@dataclass(frozen=True, slots=True)
class Receipt:
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
    schema_id: int
    parsed: avro.ParsedSchema
    fetched_at: float
    check: avro.Check | None  # the quick payload test; full validation when it is None or says no


#: An accepted task, ready to send: topic, framed value, message key, envelope.
_Prepared = tuple[str, bytes, bytes, Envelope]


def _settled(outcomes: Sequence[tuple[Receipt, str | None]]) -> list[Receipt]:
    """The acknowledged receipts of a batch someone waited for; DeliveryError if any task failed."""
    failed = [(r.task_id, err) for r, err in outcomes if err is not None]
    if failed:
        raise DeliveryError(f"{len(failed)} task(s) not acknowledged: {failed[0][1]}", failures=failed)
    return [r for r, _ in outcomes]


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
        entry = _TaskType(reg.schema_id, reg.parsed, now, avro.compile_check(reg.parsed))
        with self._lock:
            self._types[task_type] = entry
        return entry

    # ---------------------------------------------------------------- enqueue
    def _check_priority(self, priority: str) -> Priority:
        if priority not in PRIORITIES:
            raise InvalidPriorityError(f"priority {priority!r} is not one of {', '.join(PRIORITIES)}")
        return priority

    def _prepare(self, spec: TaskSpec, now: datetime) -> _Prepared:
        """Validate and encode one task, in a span of its own when tracing; raises before anything is sent."""
        tracer = self._tracer
        if not tracer.active():
            return self._encode(spec, now)
        with tracer.send() as span:
            topic, value, key, env = self._encode(spec, now)
            # The context travels with the task: its attempts, retries and replays join this trace.
            return topic, value, key, replace(env, traceparent=tracer.sent(span, topic, env))

    def _encode(self, spec: TaskSpec, now: datetime) -> _Prepared:
        """Validate and encode one task; raises before anything is sent."""
        if self._closed:
            raise ProducerClosedError()
        priority = self._check_priority(spec.priority)
        if not isinstance(spec.task_type, str) or not spec.task_type:
            raise InvalidTaskError(f"task_type must be a non-empty string, got {spec.task_type!r}")
        attempts = spec.max_attempts
        # bool is an int to Python, but max_attempts=True is a mistake, not "one attempt".
        if attempts is not None and (
            not isinstance(attempts, int) or isinstance(attempts, bool) or not 1 <= attempts <= MAX_ATTEMPTS
        ):
            raise InvalidTaskError(
                f"max_attempts must be an integer from 1 to {MAX_ATTEMPTS}, got {attempts!r}"
            )
        timeout = spec.timeout.total_seconds() if isinstance(spec.timeout, timedelta) else spec.timeout
        if timeout is not None and not (_is_number(timeout) and 0 < timeout <= MAX_TIMEOUT_SECONDS):
            raise InvalidTaskError(
                f"timeout must be a positive number of seconds up to {MAX_TIMEOUT_SECONDS:.0f} (7 days), "
                f"got {spec.timeout!r}"
            )
        if spec.at is not None:
            if spec.delay is not None:
                raise InvalidTaskError("give delay= or at=, not both")
            if not isinstance(spec.at, datetime):
                raise InvalidTaskError(f"at must be a timezone-aware datetime, got {spec.at!r}")
        not_before = self._not_before(spec.at if spec.at is not None else spec.delay, now)
        tt = self._task_type(spec.task_type)
        if tt.check is None or not tt.check(spec.payload):
            avro.validate(tt.parsed, spec.payload, task_type=spec.task_type)
        body = avro.encode(tt.parsed, spec.payload)
        if len(body) > self._max_payload:
            raise PayloadTooLargeError(
                f"payload of {spec.task_type} encodes to {len(body)} bytes, "
                f"over the limit of {self._max_payload}"
            )
        idem = spec.idempotency_key
        if idem is None:
            idem = derive_idempotency_key(spec.task_type, spec.payload)
        elif not isinstance(idem, str) or not idem:
            raise InvalidTaskError(f"idempotency_key must be a non-empty string, got {idem!r}")
        if len(idem.encode()) > MAX_HEADER_BYTES or len(spec.task_type.encode()) > MAX_HEADER_BYTES:
            raise InvalidTaskError(f"task_type and idempotency_key must be at most {MAX_HEADER_BYTES} bytes")
        key = spec.key.encode() if isinstance(spec.key, str) else spec.key
        origin = self.topics.tier(priority)
        if not_before is None:
            topic = origin
        else:
            topic = self.topics.delay(pick_delay_tier(not_before - now, self.settings.delay_tiers))
        env = Envelope(
            task_id=spec.task_id or new_task_id(),
            task_type=spec.task_type,
            idempotency_key=idem,
            priority=priority,
            attempt=1,
            max_attempts=spec.max_attempts,
            enqueued_at=now,
            not_before=not_before,
            timeout=float(timeout) if timeout is not None else None,
            origin_topic=origin,
        )
        # The message key orders and partitions: the caller's key, else the idempotency key.
        return topic, avro.frame(tt.schema_id, body), key if key is not None else idem.encode(), env

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
        spec = TaskSpec(
            task_type=task_type,
            payload=payload,
            priority=priority,
            idempotency_key=idempotency_key,
            key=key,
            delay=delay,
            at=at,
            max_attempts=max_attempts,
            timeout=timeout,
        )
        return self.enqueue_many([spec], wait=wait, conn=conn)[0]

    def enqueue_many(
        self, tasks: Iterable[TaskSpec], *, wait: bool = False, conn: psycopg.Connection[Any] | None = None
    ) -> list[Receipt]:
        """Enqueue a batch: every task is validated first, so an invalid one means none is sent.

        With `conn` (a psycopg connection in the application's open transaction) the tasks are staged in the
        outbox through it instead: they are published by a relay after, and only if, that transaction
        commits.
        """
        started = time.perf_counter()
        specs = list(tasks)
        if conn is not None:
            self._check_stageable(wait)
            prepared = self._accept(specs)
            statement, params, receipts = self._staged(prepared, specs)
            try:
                conn.execute(statement, params)
            except psycopg.Error as exc:
                raise self._stage_failed(exc) from exc
            self._metrics.enqueue_seconds.observe(time.perf_counter() - started)
            return receipts
        prepared = self._accept(specs)
        if not wait:
            receipts = self._send(prepared, specs, None)
            self._sink.poll(0)
            self._metrics.enqueue_seconds.observe(time.perf_counter() - started)
            return receipts
        outcomes: list[tuple[Receipt, str | None] | None] = [None] * len(specs)
        pending = threading.Semaphore(0)

        def settle(i: int, receipt: Receipt, err: str | None) -> None:
            outcomes[i] = (receipt, err)
            pending.release()

        receipts = self._send(prepared, specs, settle)
        self._sink.poll(0)
        self._metrics.enqueue_seconds.observe(time.perf_counter() - started)
        for _ in receipts:
            while not pending.acquire(timeout=0.05):
                self._sink.poll(0.05)
        return _settled([o for o in outcomes if o is not None])

    # The two halves of an enqueue, for AsyncTaskProducer too: _accept may wait on the registry or a shared
    # rate limit (_may_block says whether it can), _send only hands records to the Kafka client.
    def _accept(self, specs: Sequence[TaskSpec]) -> list[_Prepared]:
        """Validate, encode, and pass the depth and rate limits; raises, having sent nothing."""
        now = datetime.now(UTC)
        try:
            prepared = [self._prepare(s, now) for s in specs]
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
            incoming = Counter(env.priority for _, _, _, env in prepared)
            try:
                for priority, n in incoming.items():
                    self._depth.check(priority, incoming=n)
            except QueueFullError:
                self._metrics.rejected.labels("queue_full").inc()
                raise
        if self._limiter.limited:
            try:
                self._limiter.acquire([(env.task_type, env.priority) for _, _, _, env in prepared])
            except RateLimitedError:
                self._metrics.rejected.labels("rate_limited").inc()
                raise
        return prepared

    @staticmethod
    def _check_stageable(wait: bool) -> None:
        if wait:
            raise InvalidTaskError(
                "wait=True cannot be combined with conn=: a task staged in your transaction is published "
                "after it commits"
            )

    def _staged(
        self, prepared: Sequence[_Prepared], specs: Sequence[TaskSpec]
    ) -> tuple[sql.Composed, dict[str, Any], list[Receipt]]:
        """The statement staging accepted tasks in the outbox, its parameters, and their receipts."""
        records = []
        receipts = []
        for (topic, value, key, env), spec in zip(prepared, specs, strict=True):
            headers = env.to_headers()
            if spec.extra_headers:
                headers.extend(spec.extra_headers)
            records.append((topic, key, value, headers))
            receipts.append(
                Receipt(env.task_id, env.task_type, topic, env.priority, env.idempotency_key, env.not_before)
            )
            self._count(env)
        statement, params = outbox_stage(self.settings.database_schema, self.settings.namespace, records)
        return statement, params, receipts

    def _stage_failed(self, exc: psycopg.Error) -> StoreUnavailableError:
        hint = " (run `taskq db migrate`)" if isinstance(exc, psycopg.errors.UndefinedTable) else ""
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return StoreUnavailableError(
            redact(f"staging tasks in the outbox failed: {text}{hint}", self.settings.database_url)
        )

    def _count(self, env: Envelope) -> None:
        counter = self._enqueued.get((env.task_type, env.priority))
        if counter is None:
            counter = self._enqueued[env.task_type, env.priority] = self._metrics.enqueued.labels(
                env.task_type, env.priority
            )
        counter.inc()

    def _may_block(self, specs: Sequence[TaskSpec]) -> bool:
        """Whether _accept could wait on I/O: a schema to fetch from the registry, or a shared rate limit."""
        if self._limiter.shared:
            return True
        now = time.monotonic()
        for spec in specs:
            hit = self._types.get(spec.task_type)
            if hit is None or (
                spec.task_type not in self._local_schemas and now - hit.fetched_at >= self._schema_ttl
            ):
                return True
        return False

    def _send(
        self,
        prepared: Sequence[_Prepared],
        specs: Sequence[TaskSpec],
        settle: Callable[[int, Receipt, str | None], None] | None,
    ) -> list[Receipt]:
        """Hand accepted tasks to the Kafka client. `settle(i, receipt, error)` hears of the i-th task's
        acknowledgement (with its partition and offset) or failure, from whichever thread polls the client;
        a failure nobody settles is kept for flush()."""
        receipts: list[Receipt] = []
        # A record needs a callback of its own only when someone waits for its offset: the caller (settle)
        # or the on_delivery hook. Any other is reported only if it fails (_undelivered), which saves turning
        # every acknowledgement into a record and a receipt.
        reported = settle is not None or self._on_delivery is not None
        for i, ((topic, value, key, env), spec) in enumerate(zip(prepared, specs, strict=True)):
            receipt = Receipt(
                env.task_id, env.task_type, topic, env.priority, env.idempotency_key, env.not_before
            )
            receipts.append(receipt)
            headers = env.to_headers()
            if spec.extra_headers:
                headers.extend(spec.extra_headers)
            self._sink.send(
                topic,
                value,
                key=key,
                headers=headers,
                on_delivery=self._delivered(receipt, None if settle is None else partial(settle, i))
                if reported
                else None,
                on_failure=partial(self._undelivered, receipt),
            )
            self._count(env)
        return receipts

    def _undelivered(self, receipt: Receipt, err: str, *, waited: bool = False) -> None:
        """A task was not acknowledged: kept for flush() unless its waiter raises it (reported once)."""
        self._metrics.delivery_failed.inc()
        log.error("task %s (%s) was not acknowledged: %s", receipt.task_id, receipt.task_type, err)
        if not waited:
            with self._lock:
                self._failures.append((receipt.task_id, err))

    def _delivered(
        self, receipt: Receipt, settle: Callable[[Receipt, str | None], None] | None
    ) -> Callable[[str | None, Record | None], None]:
        def done(err: str | None, record: Record | None) -> None:
            if err is not None:
                self._undelivered(receipt, err, waited=settle is not None)
            final = receipt
            if record is not None:
                final = Receipt(
                    receipt.task_id,
                    receipt.task_type,
                    receipt.topic,
                    receipt.priority,
                    receipt.idempotency_key,
                    receipt.not_before,
                    record.partition,
                    record.offset,
                )
            if self._on_delivery is not None:
                self._on_delivery(final, err)
            if settle is not None:
                settle(final, err)

        return done

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
