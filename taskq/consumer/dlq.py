"""The DLQ as an operator's tool: list, show and replay DLQ records, and the DLQ depth gauge.

The DLQ topic has one partition, so a DLQ record is named by its offset. Reading never joins a consumer
group and commits nothing; which records were replayed lives in Postgres (`taskq_dlq_replays`).
"""

from __future__ import annotations

import bisect
import builtins
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from fnmatch import fnmatchcase
from functools import cache
from typing import Any, Protocol

from prometheus_client import Gauge

from taskq._core.broker import Broker, Record, RecordSink
from taskq._core.db import Database
from taskq._core.envelope import Envelope, EnvelopeError, H, Headers, Topics
from taskq._core.errors import ConfigurationError, DeliveryError, KafkaUnavailableError, TaskqError
from taskq._core.kafka_clients import KafkaBroker
from taskq._core.settings import Settings
from taskq._core.store import Store
from taskq.consumer import routing
from taskq.schemas import avro
from taskq.schemas.errors import SchemaError
from taskq.schemas.registry import Registry, SchemaRegistry

__all__ = [
    "DeadLetters",
    "DlqRecord",
    "DlqRecordNotFoundError",
    "PostgresReplayLog",
    "ReplayLog",
    "ReplayResult",
    "dlq_depth_gauge",
    "parse_record",
]


@cache
def dlq_depth_gauge() -> Gauge:
    """The DLQ depth gauge of the process (default registry), created on first use, never at import."""
    return Gauge("taskq_dlq_depth", "DLQ records not yet replayed (set when DeadLetters.depth() runs)")


#: What a redacted header or payload field shows instead of its value.
REDACTED = "***"
#: How long a read may go without reaching the DLQ's end offset before it gives up.
READ_TIMEOUT = 30.0
#: How long a replay waits for the broker's acknowledgement.
ACK_TIMEOUT = 60.0


class DlqRecordNotFoundError(TaskqError, LookupError):
    """No DLQ record at this offset."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DlqRecord:
    """One DLQ record: the original key, value and headers, why it failed, and whether it was replayed.

    Input that never became a task (garbage bytes, a bad envelope) is a DLQ record too: its task fields
    are None and `envelope_error` says why.
    """

    offset: int
    task_id: str | None
    task_type: str | None
    idempotency_key: str | None
    priority: str | None
    attempts: int
    reason: str
    error_type: str
    traceback: str
    failed_at: datetime
    worker: str
    topic: str
    partition: int | None
    original_offset: int | None
    headers: dict[str, bytes]
    key: bytes | None
    value: bytes | None
    replayed_at: datetime | None = None
    replays: int = 0
    envelope_error: str | None = None
    #: The decoded payload and why it could not be decoded; filled by DeadLetters.show() only.
    payload: Any = None
    payload_error: str | None = None

    def redacted(self, names: Iterable[str]) -> DlqRecord:
        """A copy for display with the headers and payload fields that `names` match shown as '***'.

        A name matches a header, or a payload field by its dotted path (`card.number`) or the end of it
        (`password` hides `user.password` too); `*` matches any run of characters; case is ignored.
        """
        patterns = [name.lower() for name in names]
        if any(not p.strip() for p in patterns):
            raise ConfigurationError("a name to redact must not be empty")

        def hidden(name: str) -> bool:
            name = name.lower()
            return any(fnmatchcase(name, p) or fnmatchcase(name, "*." + p) for p in patterns)

        headers = {k: REDACTED.encode() if hidden(k) else v for k, v in self.headers.items()}
        return replace(self, headers=headers, payload=_redact_payload(self.payload, "", hidden))

    def envelope(self) -> Envelope:
        """The task envelope of the original headers; EnvelopeError if they do not form one."""
        return Envelope.from_headers(self.headers.items())

    def to_dict(self, *, full: bool = False) -> dict[str, Any]:
        """A JSON-friendly summary; `full` adds every header (binary ones as hex), traceback and payload."""
        out = {
            "offset": self.offset,
            "task_id": self.task_id,
            "task_type": self.task_type,
            "idempotency_key": self.idempotency_key,
            "priority": self.priority,
            "attempts": self.attempts,
            "reason": self.reason,
            "error_type": self.error_type,
            "failed_at": self.failed_at.isoformat(),
            "worker": self.worker,
            "original": {"topic": self.topic, "partition": self.partition, "offset": self.original_offset},
            "replayed_at": self.replayed_at.isoformat() if self.replayed_at else None,
            "replays": self.replays,
            "envelope_error": self.envelope_error,
        }
        if full:
            out["headers"] = {k: _text(v) for k, v in self.headers.items()}
            out["traceback"] = self.traceback
            out["payload"] = self.payload
            out["payload_error"] = self.payload_error
            if self.payload_error is not None:
                out["value_hex"] = (self.value or b"")[:64].hex()
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplayResult:
    """What replaying one DLQ record did: re-enqueued it to `topic`, or refused and why."""

    offset: int
    task_id: str | None
    idempotency_key: str | None
    topic: str | None = None
    refused: str | None = None
    #: The key's effect already happened: the worker will skip the replayed task as a duplicate.
    already_completed: bool = False
    replays: int = 0

    @property
    def replayed(self) -> bool:
        """Whether the task is back on its priority topic."""
        return self.refused is None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly form."""
        return {
            "offset": self.offset,
            "task_id": self.task_id,
            "idempotency_key": self.idempotency_key,
            "replayed": self.replayed,
            "topic": self.topic,
            "refused": self.refused,
            "already_completed": self.already_completed,
            "replays": self.replays,
        }


class ReplayLog(Protocol):
    """What the DLQ tools record of replays, and the idempotency records a replay resets: Postgres
    (`PostgresReplayLog`) or `taskq.testing.InMemoryStore`."""

    def replayed(self, topic: str) -> dict[int, tuple[datetime, int]]: ...
    def replayed_between(self, topic: str, start: int, end: int) -> int: ...
    def replaying(
        self, *, topic: str, offset: int, task_id: str, idempotency_key: str, force: bool
    ) -> AbstractContextManager[int | None]: ...
    def reset_for_replay(self, idempotency_key: str) -> bool: ...
    def get(self, idempotency_key: str) -> Mapping[str, Any] | None: ...
    def close(self) -> None: ...


class PostgresReplayLog:
    """Replay records in Postgres (taskq_dlq_replays), beside the idempotency records of a namespace."""

    def __init__(self, database: Database, *, namespace: str) -> None:
        self.database = database
        self.namespace = namespace
        self._store = Store(database)

    def replayed(self, topic: str) -> dict[int, tuple[datetime, int]]:
        """The replayed offsets of a DLQ topic: when, and how many times."""
        return self._store.dlq_replayed(topic)

    def replayed_between(self, topic: str, start: int, end: int) -> int:
        """How many records of an offset range were replayed."""
        return self._store.dlq_replayed_between(topic, start, end)

    @contextmanager
    def replaying(
        self, *, topic: str, offset: int, task_id: str, idempotency_key: str, force: bool
    ) -> Iterator[int | None]:
        """Mark a record replayed for the block: yields its replay count, or None if refused (replayed
        already and not forced). The mark commits when the block exits cleanly, rolls back otherwise."""
        # The row stays uncommitted until the broker acknowledged the task: a concurrent replay of the
        # same record waits on it and is then refused, and a failed send rolls the mark back, so
        # "replayed" never names a task that is not back on its topic.
        with self.database.transaction() as tx:
            yield self._store.dlq_record_replay(
                tx, topic=topic, offset=offset, task_id=task_id, idempotency_key=idempotency_key, force=force
            )

    def reset_for_replay(self, idempotency_key: str) -> bool:
        """Start a dead key's attempts over; False if it is not dead (a completed key stays completed)."""
        return self._store.reset_for_replay(self.namespace, idempotency_key)

    def get(self, idempotency_key: str) -> Mapping[str, Any] | None:
        """The idempotency record of a key."""
        return self._store.get(self.namespace, idempotency_key)

    def close(self) -> None:
        """Release the connection."""
        self.database.close()


class DeadLetters:
    """The DLQ of one namespace: list, show and replay its records; measure its depth."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        broker: Broker | None = None,
        registry: SchemaRegistry | None = None,
        store: ReplayLog | None = None,
    ) -> None:
        """Parts not given are the real ones of `settings`: Kafka, the registry, Postgres."""
        self.settings = settings or Settings.from_env()
        self.topics = Topics(self.settings.namespace, self.settings.delay_tiers)
        self.broker: Broker = broker or KafkaBroker(self.settings)
        self._admin = self.broker.admin()
        self._store: ReplayLog = store or PostgresReplayLog(
            Database(self.settings.database_url, schema=self.settings.database_schema),
            namespace=self.settings.namespace,
        )
        self._sink: RecordSink | None = None
        self._registry: SchemaRegistry | None = registry
        # What depth() has counted: the offsets of the DLQ's records below _counted_to.
        self._record_offsets: builtins.list[int] = []
        self._counted_to = 0

    # ------------------------------------------------------------------------------------------------ read
    def list(
        self,
        *,
        task_type: str | None = None,
        since: timedelta | None = None,
        limit: int | None = None,
        include_replayed: bool = False,
    ) -> builtins.list[DlqRecord]:
        """DLQ records oldest first: not yet replayed (unless include_replayed), of a type, failed since."""
        if limit is not None and limit < 0:
            raise ConfigurationError(f"limit must be >= 0, got {limit}")
        replayed = self._store.replayed(self.topics.dlq)
        cutoff = datetime.now(UTC) - since if since is not None else None
        out: builtins.list[DlqRecord] = []
        if limit == 0:
            return out
        # A worker killed between a DLQ record's acknowledgement and the commit of its offset leaves the
        # record to be dead-lettered again from the same delivery: one dead task, two DLQ records. The
        # first stands for both, replayed or not.
        seen: set[tuple[str, int | None, int | None, str | None]] = set()
        for raw in self._read():  # read as needed: a limit stops the reading, not only the output
            rec = parse_record(raw, replayed.get(raw.offset))
            origin = (rec.topic, rec.partition, rec.original_offset, rec.task_id)
            if rec.original_offset is not None and origin in seen:
                continue
            seen.add(origin)
            if rec.replayed_at is not None and not include_replayed:
                continue
            if task_type is not None and rec.task_type != task_type:
                continue
            if cutoff is not None and rec.failed_at < cutoff:
                continue
            out.append(rec)
            if limit is not None and len(out) >= limit:
                break
        return out

    def show(self, offset: int) -> DlqRecord:
        """One DLQ record with its payload decoded through the registry; DlqRecordNotFoundError if absent."""
        found = [r for r in self._read(offset, offset + 1) if r.offset == offset]
        if not found:
            raise self._not_found([offset])
        rec = parse_record(found[0], self._store.replayed(self.topics.dlq).get(offset))
        try:
            schema_id, body = avro.split_frame(rec.value)
            return replace(rec, payload=avro.decode(body, self._schemas().by_id(schema_id)))
        except SchemaError as exc:
            return replace(rec, payload_error=str(exc))

    def depth(self) -> int:
        """How many DLQ records (not offsets) were not replayed yet; sets the taskq_dlq_depth gauge."""
        start, end = self._bounds()
        if end < self._counted_to:  # the topic was deleted and created again: count from scratch
            self._record_offsets, self._counted_to = [], 0
        # Offsets are not records: the forwarder dead-letters in transactions, and each commit marker
        # takes an offset no reader ever sees. So the records are counted by reading them, once: a later
        # call reads only what was added since (the DLQ is small, and only grows at its end).
        if self._counted_to < end:
            self._record_offsets.extend(r.offset for r in self._read(max(self._counted_to, start), end))
            self._counted_to = end
        del self._record_offsets[: bisect.bisect_left(self._record_offsets, start)]  # gone by retention
        replayed = self._store.replayed_between(self.topics.dlq, start, end)
        depth = max(0, len(self._record_offsets) - replayed)
        dlq_depth_gauge().set(depth)
        return depth

    # ---------------------------------------------------------------------------------------------- replay
    def replay(
        self,
        offsets: Iterable[int] | None = None,
        *,
        all: bool = False,
        task_type: str | None = None,
        force: bool = False,
    ) -> builtins.list[ReplayResult]:
        """Re-enqueue DLQ records at their original priority with their original task id and idempotency key.

        `all=True` replays every record not replayed yet (of `task_type`, if given). A record replayed before
        is refused unless `force`; the idempotency record still prevents a second effect. Offsets that name
        no DLQ record raise DlqRecordNotFoundError before anything is replayed.
        """
        wanted = sorted(set(offsets or ()))
        if all == bool(wanted):
            raise ConfigurationError("replay needs either DLQ offsets or all=True")
        if all:
            records = self.list(task_type=task_type)
        else:
            if task_type is not None:
                raise ConfigurationError(
                    "task_type filters all=True only; name offsets or the type, not both"
                )
            replayed = self._store.replayed(self.topics.dlq)
            raws = self._read(wanted[0], wanted[-1] + 1)
            found = {r.offset: parse_record(r, replayed.get(r.offset)) for r in raws}
            missing = [o for o in wanted if o not in found]
            if missing:
                raise self._not_found(missing)
            records = [found[o] for o in wanted]
        return [self._replay_one(rec, force=force) for rec in records]

    def _replay_one(self, rec: DlqRecord, *, force: bool) -> ReplayResult:
        result = ReplayResult(offset=rec.offset, task_id=rec.task_id, idempotency_key=rec.idempotency_key)
        try:
            env = rec.envelope()
        except EnvelopeError as exc:
            return replace(result, refused=f"not a task: {exc}")
        topic = self.topics.tier(env.priority)
        # The original task id and idempotency key, so the idempotency record still guards the effect;
        # attempt 1 and no delay; the DLQ headers are dropped, other headers (not the envelope's) kept.
        headers = replace(env, attempt=1, not_before=None).to_headers() + [
            (k, v) for k, v in rec.headers.items() if not k.startswith(H) and k != "traceparent"
        ]
        # The replay mark holds until the broker acknowledged the task (see ReplayLog.replaying).
        with self._store.replaying(
            topic=self.topics.dlq,
            offset=rec.offset,
            task_id=env.task_id,
            idempotency_key=env.idempotency_key,
            force=force,
        ) as replays:
            if replays is None:
                when = f" at {rec.replayed_at.isoformat()}" if rec.replayed_at else ""
                return replace(result, refused=f"already replayed{when}; force to replay it again")
            # Reset before producing: a worker counts an attempt when it claims the key, and a key still
            # dead at max attempts would be dead-lettered again at once. A completed key stays completed.
            # Both are committed at once, outside the replay mark.
            completed = False
            if not self._store.reset_for_replay(env.idempotency_key):
                current = self._store.get(env.idempotency_key)
                completed = current is not None and current["state"] == "completed"
            self._send(topic, rec, headers, env.task_id)
        return replace(result, topic=topic, already_completed=completed, replays=replays)

    def _send(self, topic: str, rec: DlqRecord, headers: Headers, task_id: str) -> None:
        if self._sink is None:
            self._sink = self.broker.sink()
        errors: builtins.list[str | None] = []
        self._sink.send(
            topic, rec.value, key=rec.key, headers=headers, on_delivery=lambda e, _: errors.append(e)
        )
        # Delivery guarantee: the replay counts only once the broker acknowledged the task (acks=all).
        left = self._sink.flush(ACK_TIMEOUT)
        if left or not errors or errors[0] is not None:
            err = errors[0] if errors and errors[0] else f"no acknowledgement within {ACK_TIMEOUT}s"
            what = f"replaying DLQ offset {rec.offset} to {topic}: {err}"
            raise DeliveryError(what, failures=[(task_id, err)])

    # --------------------------------------------------------------------------------------------- helpers
    def _bounds(self) -> tuple[int, int]:
        """(first offset still in the log, end offset) of the DLQ."""
        tp = (self.topics.dlq, 0)
        start = self._admin.start_offsets([self.topics.dlq])
        if tp not in start:
            raise TaskqError(f"the DLQ topic {self.topics.dlq} does not exist (run `taskq topics create`)")
        return start[tp], self._admin.end_offsets([self.topics.dlq])[tp]

    def _read(self, first: int | None = None, stop: int | None = None) -> Iterator[Record]:
        """The DLQ records with offsets in [first, stop), clipped to what the log holds, read as they are
        needed: a caller that stops early (a listing's limit) reads no further than one fetch."""
        start, end = self._bounds()
        first = start if first is None else max(first, start)
        stop = end if stop is None else min(stop, end)
        if first >= stop:
            return
        source = self.broker.source(group=f"{self.settings.namespace}.dlq-reader")
        try:
            source.assign([(self.topics.dlq, 0, first)])
            nxt, deadline = first, time.monotonic() + READ_TIMEOUT
            while nxt < stop:
                batch = source.poll(500, 0.5)
                for r in batch:
                    if r.offset < stop:
                        yield r
                    nxt = max(nxt, r.offset + 1)
                if batch:
                    deadline = time.monotonic() + READ_TIMEOUT
                elif source.position((self.topics.dlq, 0)) >= stop:
                    break  # the rest are transaction markers (the forwarder dead-letters in transactions)
                elif time.monotonic() > deadline:
                    raise KafkaUnavailableError(
                        f"reading {self.topics.dlq}: stuck at offset {nxt} of {stop} for {READ_TIMEOUT}s"
                    )
        finally:
            source.close()

    def _schemas(self) -> SchemaRegistry:
        if self._registry is None:
            self._registry = Registry.from_settings(self.settings)
        return self._registry

    def _not_found(self, offsets: builtins.list[int]) -> DlqRecordNotFoundError:
        start, end = self._bounds()
        held = f"offsets {start}..{end - 1}" if end > start else "no records"
        names = ", ".join(str(o) for o in offsets)
        return DlqRecordNotFoundError(f"no DLQ record at offset {names} in {self.topics.dlq} (holds {held})")

    def close(self) -> None:
        """Release the Kafka producer, the store connection and the registry client."""
        if self._sink is not None:
            self._sink.flush(ACK_TIMEOUT)
            self._sink = None
        self._store.close()
        if self._registry is not None:
            self._registry.close()
            self._registry = None

    def __enter__(self) -> DeadLetters:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse_record(record: Record, replayed: tuple[datetime, int] | None = None) -> DlqRecord:
    """A DLQ record from its Kafka record; tolerant of missing or malformed headers."""
    headers = dict(record.headers)

    def text(name: str) -> str:
        raw = headers.get(name)
        return _printable(raw.decode(errors="replace")) if raw is not None else ""

    def number(name: str) -> int | None:
        try:
            return int(headers[name])
        except (KeyError, ValueError):
            return None

    env: Envelope | None = None
    env_error: str | None = None
    try:
        env = Envelope.of(record)
    except EnvelopeError as exc:
        env_error = str(exc)
    failed_ms = number(routing.DLQ_FAILED_AT)
    return DlqRecord(
        offset=record.offset,
        task_id=env.task_id if env else None,
        task_type=env.task_type if env else None,
        idempotency_key=env.idempotency_key if env else None,
        priority=env.priority if env else None,
        attempts=number(routing.DLQ_ATTEMPTS) or 0,
        reason=text(routing.DLQ_REASON),
        error_type=text(routing.DLQ_ERROR_TYPE),
        traceback=text(routing.DLQ_TRACEBACK),
        failed_at=datetime.fromtimestamp((failed_ms or record.timestamp_ms) / 1000, tz=UTC),
        worker=text(routing.DLQ_WORKER),
        topic=text(routing.DLQ_TOPIC),
        partition=number(routing.DLQ_PARTITION),
        original_offset=number(routing.DLQ_OFFSET),
        headers=headers,
        key=record.key,
        value=record.value,
        replayed_at=replayed[0] if replayed else None,
        replays=replayed[1] if replayed else 0,
        envelope_error=env_error,
    )


def _redact_payload(value: Any, path: str, hidden: Callable[[str], bool]) -> Any:
    """`value` with each field (of a record or map, at any depth) whose dotted path is `hidden` as '***'."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            at = f"{path}.{key}" if path else str(key)
            out[key] = REDACTED if hidden(at) else _redact_payload(item, at, hidden)
        return out
    if isinstance(value, list):  # items of an array share its path
        return [_redact_payload(item, path, hidden) for item in value]
    return value


def _text(raw: bytes) -> str:
    try:
        return _printable(raw.decode())
    except UnicodeDecodeError:
        return "hex:" + raw.hex()


def _printable(text: str) -> str:
    """Text safe to print on an operator's terminal: control characters (escape sequences included) are
    shown as \\xNN, except newlines and tabs."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in "\n\t" else f"\\x{ord(c):02x}" for c in text)
