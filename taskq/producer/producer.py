"""TaskProducer: validate a payload against its task type's schema, then enqueue it at a priority.

The tasks become records in `taskq.producer.tasks`; here they pass the depth and rate limits and reach Kafka,
or the outbox, and their delivery reports come back."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path
from types import TracebackType
from typing import Any, overload

import psycopg
from psycopg import sql

from taskq._core.broker import Broker, Record
from taskq._core.db import Database
from taskq._core.envelope import (
    Topics,
)
from taskq._core.errors import (
    DeliveryError,
    InvalidPriorityError,
    InvalidTaskError,
    KafkaUnavailableError,
    NotCancellableError,
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
from taskq.producer.backpressure import DepthMonitor
from taskq.producer.metrics import producer_metrics
from taskq.producer.outbox import OutboxRelay
from taskq.producer.ratelimit import RateLimit, RateLimiter
from taskq.producer.status import (
    PostgresTaskRecords,
    TaskRecords,
    TaskStatus,
    lookup,
    status_of,
    wait_for_result,
)
from taskq.producer.status import cancel as cancel_task
from taskq.producer.tasks import (
    Encoder,
    Receipt,
    TaskSpec,
    _Accepted,
    _Bulk,
    check_priority,
    derive_idempotency_key,
)
from taskq.producer.workflows import (
    Chain,
    Group,
    WorkflowReceipt,
    WorkflowStatus,
    flatten,
    new_workflow_id,
)
from taskq.schemas import avro
from taskq.schemas.errors import PayloadValidationError
from taskq.schemas.registry import Registry, SchemaRegistry

__all__ = ["DEFAULT_MAX_PAYLOAD_BYTES", "Receipt", "TaskProducer", "TaskSpec", "derive_idempotency_key"]

log = logging.getLogger("taskq.producer")

#: Kafka's default max.message.bytes is 1 MiB; leave room for headers and batch overhead.
DEFAULT_MAX_PAYLOAD_BYTES = 900 * 1024


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
        receipt.producer = self._producer
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
        records: TaskRecords | None = None,
    ) -> None:
        self.settings = settings or Settings.from_env()
        # Task records (status, results, cancel): Postgres, connected on first use, unless given.
        self._records = records
        self._owns_records = records is None
        self._relay: OutboxRelay | None = None  # publishes a workflow's first tasks, made on first use
        self.topics = Topics(self.settings.namespace, self.settings.delay_tiers)
        self._owns_registry = registry is None
        self.registry: SchemaRegistry = registry or Registry.from_settings(self.settings)
        self.broker: Broker = broker or KafkaBroker(self.settings)
        self._metrics = producer_metrics()
        # Label children bound once per (task type, priority): labels() costs a lock and a tuple per call.
        self._enqueued: dict[tuple[str, str], Any] = {}
        self._sink = self.broker.sink(**dict(kafka_config or {}))
        self._on_delivery = on_delivery
        self._lock = threading.Lock()
        self._failures: list[tuple[str, str]] = []
        self._unpolled = 0
        self._closed = False
        local_schemas: dict[str, dict[str, Any]] = {}
        items = schemas.items() if isinstance(schemas, Mapping) else ((None, s) for s in schemas)
        for name, source in items:
            schema = dict(source) if isinstance(source, Mapping) else avro.load_schema(source)
            full = avro.full_name(schema)
            if name is not None and name != full:
                raise InvalidTaskError(f"schema given for task type {name!r} is the record {full!r}")
            local_schemas[full] = schema
        self._encoder = Encoder(
            self.settings,
            self.registry,
            local_schemas=local_schemas,
            auto_register=auto_register,
            schema_ttl=schema_ttl,
            max_payload_bytes=max_payload_bytes,
        )
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
                check_priority(p)
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
            return accepted.receipts(self)
        accepted = self._accept(batch)
        if not wait or not accepted.tasks:  # an empty batch has nothing to wait for
            self._send(accepted, None)
            self._metrics.enqueue_seconds.observe(time.perf_counter() - started)
            return accepted.receipts(self)
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
            accepted = self._encoder.encode(batch)
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
        return self._limiter.shared or self._encoder.must_fetch(batch)

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
            if self._owns_records and self._records is not None:
                self._records.close()
            if self._relay is not None:
                self._relay.close()
            if self._owns_registry:
                self.registry.close()

    def status(self, task_id: str | None = None, *, idempotency_key: str | None = None) -> TaskStatus:
        """What became of a task, from its idempotency record: by `idempotency_key` (one primary-key probe;
        a receipt's `status()` uses it) or else by task id (a scan of the namespace's records)."""
        name, row = lookup(self._task_records(), task_id, idempotency_key)
        return status_of(row, task_id=name, dlq_topic=self.topics.dlq)

    def result(
        self, task_id: str | None = None, *, idempotency_key: str | None = None, timeout: float | None = None
    ) -> Any:
        """Wait up to `timeout` seconds (None: no limit) for a task's result, its handler's return value.

        Raises TaskFailed (dead-lettered: the reason and where its DLQ record is), TaskCancelled, or
        TimeoutError. Polls the record with backoff (50 ms growing to 1 s); found by task id once, then by
        its key.
        """
        key = idempotency_key

        def poll() -> TaskStatus:
            nonlocal key
            current = self.status(task_id, idempotency_key=key)
            key = key or current.idempotency_key
            return current

        return wait_for_result(poll, timeout)

    def cancel(self, task_id: str | None = None, *, idempotency_key: str | None = None) -> bool:
        """Cancel a task; returns whether it had started (a worker held it, or an attempt of it ran).

        A task that has not started never does: its record says cancelled, and the worker that claims it
        commits its offset without running it (nor dead-lettering it), even from a delay tier. A running
        task's handler sees `ctx.cancelled` (cooperative; its outcome is recorded as usual), and a failed
        attempt of it is not retried. A finished task is refused: NotCancellableError, with its state. A task
        no worker has claimed yet has no record to find by its id: cancel it by its idempotency key (its
        receipt's `cancel()` does).
        """
        return cancel_task(self._task_records(), task_id, idempotency_key)

    def enqueue_workflow(self, workflow: TaskSpec | Chain | Group) -> WorkflowReceipt:
        """Enqueue a workflow (`taskq.chain`, `taskq.group`, nested): every task is validated and encoded now
        (an invalid one means nothing is enqueued), kept in Postgres, and staged in the outbox when its turn
        comes, in the transaction that records the end of the step before it. Its first tasks are staged
        now; a relay (every worker runs one) publishes them. Delays count from now."""
        workflow_id = new_workflow_id()
        nodes, specs = flatten(workflow_id, workflow)
        accepted = self._accept([spec for _, spec in specs])
        for (node, _), (topic, value, key, headers), (task_id, idem, task_type, _) in zip(
            specs, accepted.records, accepted.tasks, strict=True
        ):
            nodes[node] = replace(
                nodes[node],
                task_id=task_id,
                idempotency_key=idem,
                task_type=task_type,
                topic=topic,
                key=key,
                value=value or b"",
                headers=list(headers),
            )
        records = self._task_records()
        records.workflow_create(workflow_id, nodes)
        self._count(accepted)
        if isinstance(records, PostgresTaskRecords):
            self._publish_staged(len(specs))
        return WorkflowReceipt(workflow_id, self)

    def _publish_staged(self, most: int) -> None:
        """Publish the outbox's oldest rows (this workflow's first tasks among them) as a relay would, so
        they do not wait for a worker's relay; rows left (Kafka away) are published by the relays."""
        if self._relay is None:
            self._relay = OutboxRelay(self.settings, broker=self.broker, batch=500)
        published = 0
        try:
            while published < most:
                n = self._relay.relay_once()
                published += n
                if n < self._relay.batch:
                    break
        except (KafkaUnavailableError, StoreUnavailableError) as exc:
            log.warning("a workflow's first tasks wait in the outbox for a relay: %s", exc)

    def workflow_status(self, workflow_id: str) -> WorkflowStatus:
        """What became of a workflow: its state, done or not, and its tasks counted by state."""
        state, cancelled, counts = self._task_records().workflow_status(workflow_id)
        return WorkflowStatus(workflow_id, state or "unknown", counts, cancelled)

    def cancel_workflow(self, workflow_id: str) -> int:
        """Cancel a workflow: its steps not started never start (waiting ones, and staged tasks no worker has
        started, as `cancel` does); running ones see ctx.cancelled. Returns how many staged tasks were
        stopped before they started. A workflow that has ended is refused (NotCancellableError)."""
        state, _, _ = self._task_records().workflow_status(workflow_id)
        if state is None:
            raise InvalidTaskError(f"no workflow {workflow_id}")
        if state != "running":
            raise NotCancellableError(f"workflow {workflow_id}", state)
        _, not_started = self._task_records().workflow_cancel(workflow_id)
        return not_started

    def _task_records(self) -> TaskRecords:
        if self._records is None:
            with self._lock:
                if self._records is None:
                    self._records = PostgresTaskRecords(
                        Database(self.settings.database_url, schema=self.settings.database_schema),
                        self.settings.namespace,
                    )
        return self._records

    def depth(self) -> dict[str, int]:
        """The last measured depth per tier (empty without depth limits)."""
        return self._depth.depths() if self._depth is not None else {}

    def __enter__(self) -> TaskProducer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
