"""Fakes for tests, yours and ours: an in-memory broker, idempotency store and schema registry with the real
ones' semantics, and `InMemoryQueue`, which runs a `Handlers` registry over them with no services.

```python
from taskq.testing import InMemoryQueue

q = InMemoryQueue(handlers)                      # the app's taskq.Handlers
q.producer.enqueue("demo.SendEmail", {...}, idempotency_key="k")
q.run_until_idle()                               # runs what is due, retries included; delays fast-forwarded
q.completed, q.dead_letters                      # what happened, to assert on
```

The fakes keep the rules that matter to correctness: partitions with offsets, committed offsets per group,
pause and seek, range assignment over a group's members with revocation before reassignment, transactions
whose records and offsets commit together; claims with leases, attempts counted at claim time, completion
only by the lease holder's current attempt; BACKWARD compatibility of schema versions. One contract suite
(`tests/contract`) runs the same tests against these and against the real services, so they cannot drift.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from itertools import count
from typing import Any, TypeVar

from taskq._core.envelope import Headers, Topics
from taskq._core.errors import KafkaUnavailableError, RecordTooLargeError, TaskqError
from taskq._core.kafka import (
    TP,
    TRANSACTION_TIMEOUT,
    BatchCallback,
    Committed,
    DeliveryCallback,
    OutRecord,
    Record,
    RecordSource,
    TopicSpec,
)
from taskq._core.settings import Settings
from taskq.consumer.dlq import DeadLetters, DlqRecord, parse_record
from taskq.consumer.events import Event, TaskCompleted
from taskq.consumer.forwarder import Forwarder
from taskq.consumer.handlers import Handlers
from taskq.consumer.store import (
    FORGET_WORKERS_AFTER,
    Claim,
    ClaimRequest,
    Finished,
    LeaseLostError,
    Member,
    NotStarted,
    Pauses,
    SlotRequest,
    WorkerRecord,
)
from taskq.consumer.worker import Worker, WorkerConfig
from taskq.producer.admin import topic_specs
from taskq.producer.producer import TaskProducer
from taskq.schemas import avro
from taskq.schemas.errors import IncompatibleSchemaError, SchemaNotFoundError
from taskq.schemas.registry import RegisteredSchema

E = TypeVar("E")

__all__ = [
    "Clock",
    "InMemoryBroker",
    "InMemoryQueue",
    "InMemoryRegistry",
    "InMemoryStore",
    "RecordingHook",
]


class Clock:
    """Real time plus an offset that tests move forward: delays and leases pass without waiting."""

    def __init__(self) -> None:
        self.offset = 0.0

    def time(self) -> float:
        """Wall-clock seconds (what envelopes' not-before and leases are compared with)."""
        return time.time() + self.offset

    def monotonic(self) -> float:
        """Monotonic seconds (what the worker's timers use)."""
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        """Move both clocks forward."""
        self.offset += max(0.0, seconds)


# ------------------------------------------------------------------------------------------------- broker
@dataclass
class _Group:
    committed: dict[TP, int] = field(default_factory=dict)
    members: list[_Source] = field(default_factory=list)  # subscribed members, in join order


class InMemoryBroker:
    """Topics, partitions and consumer groups in memory; hands out sources, sinks and an admin."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock  # record timestamps (the forwarder's holds count from them)
        self._lock = threading.RLock()
        self._arrived = threading.Condition(self._lock)
        self._logs: dict[str, list[list[Record]]] = {}
        self._groups: dict[str, _Group] = {}
        self._producers: dict[str, _Sink] = {}  # transactional id -> its current producer
        #: Records handed out by every poll so far (how much consumers read).
        self.fetched = 0
        self._round_robin = count()

    # The Broker protocol.
    def source(
        self,
        *,
        group: str,
        on_assign: Callable[[list[TP]], None] | None = None,
        on_revoke: Callable[[list[TP]], None] | None = None,
        on_commit: Committed | None = None,
        raise_when_stuck: bool = False,  # an in-memory consumer never leaves a partition unfetched
    ) -> _Source:
        """A consumer in `group`."""
        return _Source(self, group, on_assign, on_revoke, on_commit)

    def sink(self, *, transactional_id: str | None = None, **overrides: Any) -> _Sink:
        """A producer; transactional with an id. Like librdkafka it refuses a record over
        `message.max.bytes` (1,000,000 unless overridden) when it is sent."""
        return _Sink(self, transactional_id, int(overrides.get("message.max.bytes", 1_000_000)))

    def admin(self) -> _Admin:
        """Topic provisioning and offset look-ups."""
        return _Admin(self)

    # What tests look at.
    def records(self, topic: str) -> list[Record]:
        """Every record of a topic, partition by partition."""
        with self._lock:
            return [r for part in self._logs.get(topic, []) for r in part]

    def uncommitted(self, group: str, topics: Iterable[str]) -> int:
        """Records of these topics past the group's committed offsets."""
        with self._lock:
            committed = self._group(group).committed
            return sum(
                len(part) - max(0, committed.get((topic, p), 0))
                for topic in topics
                for p, part in enumerate(self._logs.get(topic, []))
            )

    # Internals shared by the clients.
    def _group(self, name: str) -> _Group:
        return self._groups.setdefault(name, _Group())

    def _partitions(self, topic: str) -> list[list[Record]]:
        try:
            return self._logs[topic]
        except KeyError:
            raise KafkaUnavailableError(f"producing to {topic}: Broker: Unknown topic or partition") from None

    def _append(self, topic: str, partition: int | None, key: bytes | None, value: bytes | None,
                headers: Headers) -> Record:  # fmt: skip
        parts = self._partitions(topic)
        if partition is None:
            # Keyed records keep to one partition (Kafka hashes the key); others spread round-robin.
            partition = (
                zlib.crc32(key) % len(parts) if key is not None else next(self._round_robin) % len(parts)
            )
        log = parts[partition]
        record = Record(topic, partition, len(log), key, value, list(headers), int(self._clock() * 1000))
        log.append(record)
        self._arrived.notify_all()
        return record

    def _rebalance(self, group: _Group) -> None:
        """Range assignment, topic by topic, over the subscribed members (join order)."""
        targets: dict[_Source, set[TP]] = {m: set() for m in group.members}
        topics = sorted({t for m in group.members for t in m.topics})
        for topic in topics:
            members = [m for m in group.members if topic in m.topics]
            n = len(self._logs.get(topic, []))
            for i, member in enumerate(members):
                lo, hi = i * n // len(members), (i + 1) * n // len(members)
                targets[member] |= {(topic, p) for p in range(lo, hi)}
        for member, target in targets.items():
            member.target = target


_FETCH_BYTES = 16 * 1024 * 1024


class _Source:
    """A consumer of the in-memory broker (see RecordSource): callbacks are served from poll()."""

    def __init__(
        self,
        broker: InMemoryBroker,
        group: str,
        on_assign: Callable[[list[TP]], None] | None,
        on_revoke: Callable[[list[TP]], None] | None,
        on_commit: Committed | None = None,
    ) -> None:
        self._broker = broker
        self._group_name = group
        self._on_assign = on_assign
        self._on_revoke = on_revoke
        self._on_commit = on_commit
        self._commits: list[tuple[dict[TP, int], str | None]] = []  # asynchronous outcomes, for the next poll
        self.topics: tuple[str, ...] = ()
        self.target: set[TP] = set()  # what the group wants this member to own
        self._owned: set[TP] = set()
        self._position: dict[TP, int] = {}
        self._paused: set[TP] = set()
        self._closed = False

    def subscribe(self, topics: Sequence[str]) -> None:
        with self._broker._lock:
            self.topics = tuple(topics)
            group = self._broker._group(self._group_name)
            if self not in group.members:
                group.members.append(self)
            self._broker._rebalance(group)

    def assign(self, tps: Iterable[tuple[str, int, int]]) -> None:
        with self._broker._lock:
            for t, p, o in tps:
                self._owned.add((t, p))
                self._position[(t, p)] = o
            self.target = set(self._owned)

    def _serve_rebalance(self) -> None:
        # Revoke first, then assign what no other member still owns (Kafka never gives a partition to two).
        revoked = sorted(self._owned - self.target) if self.topics else []
        if revoked:
            if self._on_revoke:
                self._on_revoke(revoked)
            with self._broker._lock:
                self._owned -= set(revoked)
                for tp in revoked:
                    self._position.pop(tp, None)
                    self._paused.discard(tp)
        with self._broker._lock:
            group = self._broker._group(self._group_name)
            others = set().union(*(m._owned for m in group.members if m is not self))
            added = sorted(self.target - self._owned - others) if self.topics else []
            for tp in added:
                committed = group.committed.get(tp, -1)
                self._position[tp] = committed if committed >= 0 else 0  # auto.offset.reset=earliest
            self._owned |= set(added)
        if added and self._on_assign:
            self._on_assign(added)

    def poll(self, max_records: int, timeout: float) -> list[Record]:
        self._serve_rebalance()
        commits, self._commits = self._commits, []
        for offsets, error in commits:  # as librdkafka serves on_commit: from a poll
            if self._on_commit is not None:
                self._on_commit(offsets, error)
        deadline = time.monotonic() + timeout
        with self._broker._arrived:
            while True:
                out = self._fetch(max_records)
                left = deadline - time.monotonic()
                if out or left <= 0 or self._closed:
                    return out
                self._broker._arrived.wait(left)

    def _fetch(self, max_records: int) -> list[Record]:
        out = self._fetch_some(max_records)
        self._broker.fetched += len(out)
        return out

    def _fetch_some(self, max_records: int) -> list[Record]:
        # At most about 16 MiB a poll, what the real source prefetches (queued.max.messages.kbytes).
        out: list[Record] = []
        size = 0
        live = sorted(tp for tp in self._owned if tp not in self._paused)
        while len(out) < max_records and size < _FETCH_BYTES:
            progressed = False
            for tp in live:
                log = self._broker._logs.get(tp[0], [])[tp[1]]
                pos = self._position[tp]
                if pos < len(log) and len(out) < max_records and size < _FETCH_BYTES:
                    record = log[pos]
                    out.append(record)
                    size += len(record.value or b"") + sum(len(k) + len(v) for k, v in record.headers)
                    self._position[tp] = pos + 1
                    progressed = True
            if not progressed:
                break
        return out

    def pause(self, tps: Iterable[TP]) -> None:
        with self._broker._lock:
            self._paused |= set(tps)

    def resume(self, tps: Iterable[TP]) -> None:
        with self._broker._lock:
            self._paused -= set(tps)

    def seek(self, tp: TP, offset: int) -> None:
        with self._broker._lock:
            if tp not in self._owned:
                raise KafkaUnavailableError(f"seeking {tp[0]}[{tp[1]}] to {offset}: partition not assigned")
            self._position[tp] = offset

    def commit(self, offsets: Mapping[TP, int], *, asynchronous: bool = False) -> None:
        with self._broker._lock:
            stale = [tp for tp in offsets if tp not in self._owned]
            if stale:
                error = f"committing offsets: {stale} are not assigned to this member"
                if not asynchronous:
                    raise KafkaUnavailableError(error)
                self._commits.append(({}, error))
                return
            self._broker._group(self._group_name).committed.update(offsets)
            if asynchronous:
                self._commits.append((dict(offsets), None))

    def committed(self, tps: Iterable[TP], timeout: float = 10.0) -> dict[TP, int]:
        with self._broker._lock:
            group = self._broker._group(self._group_name)
            return {tp: group.committed.get(tp, -1) for tp in tps}

    def lag(self) -> dict[TP, int]:
        with self._broker._lock:
            return {tp: len(self._broker._logs[tp[0]][tp[1]]) - pos for tp, pos in self._position.items()}

    def position(self, tp: TP) -> int:
        with self._broker._lock:
            return self._position.get(tp, -1)

    def high_watermarks(self, tps: Iterable[TP]) -> dict[TP, int]:
        with self._broker._lock:
            return {tp: len(self._broker._logs[tp[0]][tp[1]]) for tp in tps}

    def group_metadata(self) -> object:
        return _Membership(self._group_name, self)

    def assignment(self) -> list[TP]:
        with self._broker._lock:
            return sorted(self._owned)

    def close(self) -> None:
        with self._broker._lock:
            self._closed = True
            group = self._broker._group(self._group_name)
            if self in group.members:
                group.members.remove(self)
                self._broker._rebalance(group)
            self._owned.clear()
            self._broker._arrived.notify_all()


@dataclass(frozen=True)
class _Membership:
    """What a transaction's offsets carry to fence a member that no longer owns its partitions."""

    group: str
    member: _Source


class _Sink:
    """A producer of the in-memory broker (see RecordSink): records land when poll()/flush() serves them,
    as acknowledgements do; a transaction's records and offsets land together at commit."""

    def __init__(self, broker: InMemoryBroker, transactional_id: str | None, max_bytes: int) -> None:
        self._broker = broker
        self._transactional_id = transactional_id
        self._max_bytes = max_bytes
        self._queued: list[
            tuple[str, int | None, bytes | None, bytes | None, Headers, DeliveryCallback | None]
        ]
        self._queued = []
        self._txn: list[tuple[str, bytes | None, bytes | None, Headers]] | None = None
        self._txn_offsets: dict[str, dict[TP, int]] = {}

    def send(
        self,
        topic: str,
        value: bytes | None,
        *,
        key: bytes | None,
        headers: Headers,
        on_delivery: DeliveryCallback | None = None,
        partition: int | None = None,
        on_failure: Callable[[str], None] | None = None,  # never called: every accepted record is kept
    ) -> None:
        size = len(value or b"") + len(key or b"") + sum(len(k) + len(v) for k, v in headers)
        if size > self._max_bytes:  # librdkafka refuses at once, before anything is queued
            raise RecordTooLargeError(f"producing to {topic}: a record of {size} bytes is too large")
        with self._broker._lock:
            self._broker._partitions(topic)  # unknown topic: refused at once
            if self._transactional_id is not None:
                self._fenced()
                if self._txn is None:
                    raise KafkaUnavailableError(f"producing to {topic}: no transaction in progress")
                self._txn.append((topic, key, value, list(headers)))
                return
            self._queued.append((topic, partition, key, value, list(headers), on_delivery))

    def send_many(
        self,
        records: Iterable[OutRecord],
        *,
        on_delivery: BatchCallback | None = None,
        on_failure: Callable[[str, Record], None] | None = None,  # never called, as in send()
    ) -> None:
        for i, (topic, value, key, headers) in enumerate(records):
            self.send(
                topic,
                value,
                key=key,
                headers=headers,
                on_delivery=None if on_delivery is None else partial(on_delivery, i),
            )

    def poll(self, timeout: float = 0.0) -> int:
        with self._broker._lock:
            queued, self._queued = self._queued, []
            delivered = [(cb, self._broker._append(t, p, k, v, h)) for t, p, k, v, h, cb in queued]
        for cb, record in delivered:
            if cb is not None:
                cb(None, record)
        return len(delivered)

    def flush(self, timeout: float | None = None) -> int:
        self.poll()
        return 0

    def __len__(self) -> int:
        return len(self._queued)

    def init_transactions(self, timeout: float = TRANSACTION_TIMEOUT) -> None:
        if self._transactional_id is None:
            raise KafkaUnavailableError("initialising transactions: the producer has no transactional id")
        with self._broker._lock:
            self._broker._producers[self._transactional_id] = self  # fences an older instance of the id

    def _fenced(self) -> None:
        if (
            self._transactional_id is not None
            and self._broker._producers.get(self._transactional_id) is not self
        ):
            raise KafkaUnavailableError("transaction: this producer was fenced by a newer instance of its id")

    def begin(self) -> None:
        with self._broker._lock:
            self._fenced()
            self._txn, self._txn_offsets = [], {}

    def commit_offsets_in_transaction(
        self, source: RecordSource, offsets: Mapping[TP, int], timeout: float = TRANSACTION_TIMEOUT
    ) -> None:
        membership = source.group_metadata()
        if not isinstance(membership, _Membership):
            raise KafkaUnavailableError("adding offsets to the transaction: not a consumer of this broker")
        group, member = membership.group, membership.member
        with self._broker._lock:
            if self._txn is None:
                raise KafkaUnavailableError("adding offsets to the transaction: no transaction in progress")
            stale = [tp for tp in offsets if tp not in member._owned]
            if stale:
                raise KafkaUnavailableError(f"adding offsets to the transaction: {stale} not assigned")
            self._txn_offsets.setdefault(group, {}).update(offsets)

    def commit(self, timeout: float = TRANSACTION_TIMEOUT) -> None:
        with self._broker._lock:
            self._fenced()
            if self._txn is None:
                raise KafkaUnavailableError("committing the transaction: no transaction in progress")
            for topic, key, value, headers in self._txn:
                self._broker._append(topic, None, key, value, headers)
            for group, offsets in self._txn_offsets.items():
                self._broker._group(group).committed.update(offsets)
            self._txn, self._txn_offsets = None, {}

    def abort(self, timeout: float = TRANSACTION_TIMEOUT) -> None:
        with self._broker._lock:
            self._fenced()  # a fenced producer cannot end its transaction (librdkafka: a fatal error)
            self._txn, self._txn_offsets = None, {}


class _Admin:
    """Topic provisioning and offset look-ups of the in-memory broker (see TopicAdmin)."""

    def __init__(self, broker: InMemoryBroker) -> None:
        self._broker = broker

    def create_topics(self, specs: Sequence[TopicSpec]) -> dict[str, bool]:
        with self._broker._lock:
            created = {}
            for s in specs:
                created[s.name] = s.name not in self._broker._logs
                self._broker._logs.setdefault(s.name, [[] for _ in range(s.partitions)])
            return created

    def delete_topics(self, names: Sequence[str]) -> None:
        with self._broker._lock:
            for name in names:
                self._broker._logs.pop(name, None)

    def partitions(self, topics: Sequence[str]) -> dict[str, int]:
        with self._broker._lock:
            return {t: len(self._broker._logs[t]) for t in topics if t in self._broker._logs}

    def end_offsets(self, topics: Sequence[str]) -> dict[TP, int]:
        with self._broker._lock:
            return {(t, p): len(log) for t in topics for p, log in enumerate(self._broker._logs.get(t, []))}

    def start_offsets(self, topics: Sequence[str]) -> dict[TP, int]:
        return dict.fromkeys(self.end_offsets(topics), 0)

    def committed(self, group: str, topics: Sequence[str]) -> dict[TP, int]:
        with self._broker._lock:
            done = self._broker._group(group).committed
            return {tp: done.get(tp, -1) for tp in self.end_offsets(topics)}


# -------------------------------------------------------------------------------------------------- store
@dataclass
class _Row:
    task_id: str
    task_type: str
    state: str
    attempts: int
    lease_owner: str | None
    lease_expires_at: float | None
    last_error: str | None = None
    result: Any = None
    created_at: float = 0.0
    updated_at: float = 0.0
    completed_at: float | None = None
    interruptions: int = 0
    takeovers: int = 0
    started: bool = False


@dataclass
class _Liveness:
    record: WorkerRecord
    heartbeat_at: float
    in_flight: int = 0
    dead_at: float | None = None


@dataclass
class _Slot:
    task_type: str
    key: str
    owner: str
    lease_expires_at: float


@dataclass
class _Bucket:
    rate: float
    capacity: float
    tokens: float
    updated_at: float  # in the future while the bucket is paused


class _NoDatabase:
    """What a transactional handler gets as ctx.db from an InMemoryStore made without `connect`."""

    def __getattr__(self, name: str) -> Any:
        raise TaskqError(
            "a transactional handler needs a database connection: give InMemoryQueue (or InMemoryStore) "
            "connect=..., a function returning a DB-API connection"
        )


class InMemoryStore:
    """The idempotency store's rules in memory: claim with a lease (attempts counted at claim), completion
    and failure only by the lease holder's current attempt, replay resets, purge of old finished keys.

    `rows` holds the records of the store's namespace, by key. Several stores of one namespace (one per
    worker id) share them: `InMemoryStore(owner="b", rows=a.rows)`; a store of another namespace has rows
    of its own, as namespaces sharing a Postgres database keep their records apart. `workers` holds the
    liveness records, by worker id, shared by every store of one database (`workers=a.workers`): a key
    leased by a worker whose heartbeat is older than `stale_after` seconds on `clock`, or that was marked
    dead, is taken over by the next claim as the same attempt: a takeover, and an interruption too if its
    run was marked started (`mark_started`). `slots` (concurrency slots, by idempotency key) and `buckets`
    (shared token buckets, by name) are shared the same way.
    """

    def __init__(
        self,
        *,
        owner: str,
        namespace: str = "taskq",
        clock: Callable[[], float] = time.time,
        rows: dict[str, _Row] | None = None,
        workers: dict[str, _Liveness] | None = None,
        stale_after: float = 10.0,
        connect: Callable[[], Any] | None = None,
        slots: dict[str, _Slot] | None = None,
        buckets: dict[str, _Bucket] | None = None,
        paused: dict[tuple[str, str], datetime] | None = None,
    ) -> None:
        self.owner = owner
        self.namespace = namespace
        self.rows: dict[str, _Row] = {} if rows is None else rows
        self.workers: dict[str, _Liveness] = {} if workers is None else workers
        self.slots: dict[str, _Slot] = {} if slots is None else slots
        self.buckets: dict[str, _Bucket] = {} if buckets is None else buckets
        self.stale_after = stale_after
        self._clock = clock
        self._connect = connect
        self._lock = threading.Lock()
        #: DLQ replays: (topic, offset) -> (when, how many times); one replay at a time, as in Postgres
        self.replays: dict[tuple[str, int], tuple[datetime, int]] = {}
        self._replay_lock = threading.Lock()
        #: What operators paused, (kind, name) -> when; stores of one namespace share it: `paused=a.paused`
        self.paused: dict[tuple[str, str], datetime] = {} if paused is None else paused

    def pause(self, kind: str, name: str) -> bool:
        """Pause a tier or a task type (kind "tier" or "task_type"); False if it was paused already."""
        with self._lock:
            if (kind, name) in self.paused:
                return False
            self.paused[(kind, name)] = datetime.now(UTC)
            return True

    def resume(self, kind: str, name: str) -> bool:
        """Resume a tier or a task type; False if it was not paused."""
        with self._lock:
            return self.paused.pop((kind, name), None) is not None

    def pauses(self) -> Pauses:
        """What is paused, as the worker reads it every few seconds."""
        with self._lock:
            return Pauses(
                tiers=frozenset(n for k, n in self.paused if k == "tier"),
                task_types=frozenset(n for k, n in self.paused if k == "task_type"),
            )

    def claim(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """Claim each key for one attempt; a key twice in one batch: 'duplicate' (as IdempotencyStore)."""
        out: list[Claim] = []
        answered: set[str] = set()
        with self._lock:
            now = self._clock()
            dead = self._dead_workers(now)
            for r in requests:
                row = self.rows.get(r.idempotency_key)
                if r.idempotency_key in answered:
                    out.append(Claim(r.idempotency_key, "duplicate", row.attempts if row else 0))
                    continue
                answered.add(r.idempotency_key)
                running = row is not None and row.state == "running"
                expired = running and row is not None and (row.lease_expires_at or 0) < now
                # Taken over from a dead worker: a takeover (an interruption too if the run was marked
                # started), and the same attempt runs again.
                taken = (
                    running and row is not None and row.lease_owner != self.owner and row.lease_owner in dead
                )
                # A dead key is claimed by a new task of the key, not by the dead-lettered one redelivered.
                again = row is not None and row.state == "dead" and row.task_id != r.task_id
                if row is None or row.state == "failed" or again or expired or taken:
                    attempts = 1 if row is None else row.attempts + (0 if taken else 1)
                    takeovers = 0 if row is None else row.takeovers + (1 if taken else 0)
                    interrupted = taken and row is not None and row.started
                    interruptions = 0 if row is None else row.interruptions + (1 if interrupted else 0)
                    created = now if row is None else row.created_at
                    self.rows[r.idempotency_key] = _Row(
                        r.task_id, r.task_type, "running", attempts, self.owner, now + r.lease_seconds,
                        row.last_error if row else None, None, created, now, None, interruptions, takeovers,
                    )  # fmt: skip
                    out.append(Claim(r.idempotency_key, "claimed", attempts, 0.0, interruptions, takeovers))
                    continue
                counts = row.interruptions, row.takeovers
                if row.state == "completed":
                    out.append(Claim(r.idempotency_key, "completed", row.attempts, 0.0, *counts))
                elif row.state == "dead":
                    out.append(Claim(r.idempotency_key, "dead", row.attempts, 0.0, *counts))
                else:
                    left = (row.lease_expires_at or now) - now
                    out.append(Claim(r.idempotency_key, "running", row.attempts, left, *counts))
        return out

    def enter(self, worker: WorkerRecord, alive: Callable[[int], bool]) -> set[str]:
        """Write the worker's liveness record and mark dead the earlier workers of its host whose process
        is gone; returns their ids (as IdempotencyStore)."""
        with self._lock:
            now = self._clock()
            self.workers[worker.worker_id] = _Liveness(worker, now)
            marked = set()
            for worker_id, w in self.workers.items():
                earlier = w.record.host == worker.host and w.record.started_at <= worker.started_at
                gone = w.dead_at is None and not alive(w.record.pid)
                if earlier and worker_id != worker.worker_id and gone:
                    w.dead_at = now
                    marked.add(worker_id)
            forgotten = [i for i, w in self.workers.items() if w.heartbeat_at < now - FORGET_WORKERS_AFTER]
            for worker_id in forgotten:
                del self.workers[worker_id]
            return marked

    def beat(self, worker: WorkerRecord, in_flight: int) -> None:
        """Write the worker's heartbeat (a record marked dead by mistake comes back to life)."""
        with self._lock:
            now = self._clock()
            known = self.workers.get(worker.worker_id)
            started = known.record if known is not None else worker
            self.workers[worker.worker_id] = _Liveness(started, now, in_flight)

    def leave(self, worker_id: str) -> None:
        """Remove the worker's liveness record (a clean stop)."""
        with self._lock:
            self.workers.pop(worker_id, None)

    def _dead_workers(self, now: float) -> set[str]:
        return {
            worker_id
            for worker_id, w in self.workers.items()
            if w.dead_at is not None or w.heartbeat_at < now - self.stale_after
        }

    def acquire_slots(self, requests: Sequence[SlotRequest]) -> set[str]:
        """Take a slot for each task whose key has fewer live slots than its limit, earlier requests of a key
        first; a slot is live while its lease lasts and its owner's heartbeat is fresh (as in Postgres)."""
        granted: set[str] = set()
        with self._lock:
            now = self._clock()
            dead = self._dead_workers(now)
            asked = {r.idempotency_key for r in requests}
            live: dict[tuple[str, str], int] = {}
            for key, slot in list(self.slots.items()):
                if slot.lease_expires_at <= now or slot.owner in dead:
                    if key not in asked:
                        del self.slots[key]  # dead: freed for the key's next acquirer
                elif key not in asked:
                    live[(slot.task_type, slot.key)] = live.get((slot.task_type, slot.key), 0) + 1
            for r in {r.idempotency_key: r for r in requests}.values():
                held = live.get((r.task_type, r.key), 0)
                if held < r.limit:
                    live[(r.task_type, r.key)] = held + 1
                    expires = now + r.lease_seconds
                    self.slots[r.idempotency_key] = _Slot(r.task_type, r.key, self.owner, expires)
                    granted.add(r.idempotency_key)
        return granted

    def release_slots(self, idempotency_keys: Sequence[str]) -> None:
        """Give back this owner's slots of these tasks."""
        with self._lock:
            for key in idempotency_keys:
                slot = self.slots.get(key)
                if slot is not None and slot.owner == self.owner:
                    del self.slots[key]

    def take_tokens(
        self, bucket: str, *, rate: float, capacity: float, want: float
    ) -> tuple[float, float, float]:
        """Refill a shared bucket and take up to `want` whole tokens: (granted, left, seconds paused)."""
        with self._lock:
            now = self._clock()
            b = self.buckets.get(bucket)
            if b is None:
                granted = min(want, float(int(capacity)))
                self.buckets[bucket] = _Bucket(rate, capacity, capacity - granted, now)
                return granted, capacity - granted, 0.0
            tokens = min(b.capacity, b.tokens + max(0.0, now - b.updated_at) * b.rate)
            granted = min(want, float(int(tokens)))
            b.rate, b.capacity, b.tokens = rate, capacity, tokens - granted
            b.updated_at = max(b.updated_at, now)
            return granted, b.tokens, max(0.0, b.updated_at - now)

    def pause_tokens(self, bucket: str, *, rate: float, capacity: float, seconds: float) -> None:
        """Empty a shared bucket and grant nothing from it for `seconds` (a longer pause set stays)."""
        with self._lock:
            now = self._clock()
            b = self.buckets.setdefault(bucket, _Bucket(rate, capacity, 0.0, now))
            b.tokens, b.updated_at = 0.0, max(b.updated_at, now + seconds)

    def purge_idle(self) -> tuple[int, int]:
        """Delete buckets refilled to the brim and slots whose lease ended: (buckets, slots)."""
        with self._lock:
            now = self._clock()
            full = [
                name
                for name, b in self.buckets.items()
                if b.updated_at <= now and b.tokens + (now - b.updated_at) * b.rate >= b.capacity
            ]
            ended = [key for key, slot in self.slots.items() if slot.lease_expires_at < now]
            for name in full:
                del self.buckets[name]
            for key in ended:
                del self.slots[key]
            return len(full), len(ended)

    def _holds(self, key: str, attempts: int) -> _Row | None:
        row = self.rows.get(key)
        ok = row is not None and row.state == "running" and row.lease_owner == self.owner
        return row if ok and row is not None and row.attempts == attempts else None

    def finish(self, finished: Sequence[Finished]) -> set[str]:
        """Record completions and failures; returns the keys whose lease was lost (nothing recorded)."""
        lost: set[str] = set()
        with self._lock:
            now = self._clock()
            for f in finished:
                row = self._holds(f.idempotency_key, f.attempts)
                if row is None:
                    lost.add(f.idempotency_key)
                    continue
                row.state, row.updated_at, row.lease_owner, row.lease_expires_at = f.state, now, None, None
                if f.state == "completed":
                    row.result, row.completed_at, row.last_error = f.result, now, None
                else:
                    row.last_error = f.error[:4000]
        return lost

    def release(self, claims: Sequence[tuple[str, int]]) -> set[str]:
        """Give back claims whose attempts never started: uncounted, claimable at once (as in Postgres)."""
        released: set[str] = set()
        with self._lock:
            now = self._clock()
            for key, attempts in claims:
                row = self._holds(key, attempts)
                if row is not None:
                    row.attempts -= 1
                    row.lease_owner, row.lease_expires_at, row.updated_at = None, now - 1e-6, now  # expired
                    released.add(key)
        return released

    def renew(self, leases: Sequence[tuple[str, int, float]]) -> set[str]:
        """Extend (key, attempt, seconds from now) leases held by this owner; returns the keys renewed."""
        renewed: set[str] = set()
        with self._lock:
            now = self._clock()
            for key, attempts, seconds in leases:
                row = self._holds(key, attempts)
                if row is not None:
                    row.lease_expires_at, row.updated_at = now + seconds, now
                    renewed.add(key)
        return renewed

    def mark_started(self, runs: Sequence[tuple[str, int]]) -> set[str]:
        """Mark (key, attempt) runs held by this owner started; returns the keys marked (as in Postgres)."""
        marked: set[str] = set()
        with self._lock:
            for key, attempts in runs:
                row = self._holds(key, attempts)
                if row is not None:
                    row.started = True
                    marked.add(key)
        return marked

    @contextmanager
    def _connection(self) -> Iterator[Any]:
        """The handler's connection (from `connect`, or one that says it is missing): rolled back if the
        block raises, closed at its end."""
        conn = self._connect() if self._connect is not None else _NoDatabase()
        try:
            yield conn
        except BaseException:
            if self._connect is not None:
                conn.rollback()
            raise
        finally:
            if self._connect is not None:
                conn.close()

    @contextmanager
    def transaction(self, idempotency_key: str, attempts: int, result: Any = None) -> Iterator[Any]:
        """The handler's connection (from `connect`); the completion is recorded only if it commits."""
        with self._connection() as conn:
            yield conn
            with self._lock:
                row = self._holds(idempotency_key, attempts)
                if row is None:
                    raise LeaseLostError(f"lease of {idempotency_key!r} attempt {attempts} was taken over")
                if self._connect is not None:
                    conn.commit()
                self._complete(row, result)

    def _complete(self, row: _Row, result: Any) -> None:
        now = self._clock()
        row.state, row.result, row.completed_at, row.updated_at = "completed", result, now, now
        row.lease_owner, row.lease_expires_at, row.last_error = None, None, None

    def run_group(self, members: Sequence[Member]) -> None:
        """Run transactional attempts together and record the completions of those that returned, all or
        nothing (as IdempotencyStore; a fake connection from `connect` has no savepoints)."""
        with self._connection() as conn:
            for member in members:
                if member.skip():
                    member.error = NotStarted(f"{member.idempotency_key}: not started")
                    continue
                started = time.monotonic()
                try:
                    member.result = member.call(conn)
                except Exception as exc:
                    member.error = exc
                member.seconds = time.monotonic() - started
            with self._lock:
                done = [m for m in members if m.error is None]
                lost = frozenset(
                    m.idempotency_key for m in done if not self._holds(m.idempotency_key, m.attempts)
                )
                if lost:
                    raise LeaseLostError(f"leases taken over during a group commit: {sorted(lost)}", lost)
                if self._connect is not None:
                    conn.commit()
                for m in done:
                    self._complete(self.rows[m.idempotency_key], None)

    def get(self, idempotency_key: str) -> dict[str, Any] | None:
        """The record of one key, or None."""
        with self._lock:
            row = self.rows.get(idempotency_key)
            if row is None:
                return None

            def at(t: float | None) -> datetime | None:
                return None if t is None else datetime.fromtimestamp(t, UTC)

            return {
                "idempotency_key": idempotency_key,
                "task_id": row.task_id,
                "task_type": row.task_type,
                "state": row.state,
                "attempts": row.attempts,
                "takeovers": row.takeovers,
                "interruptions": row.interruptions,
                "started": row.started,
                "lease_owner": row.lease_owner,
                "lease_expires_at": at(row.lease_expires_at),
                "last_error": row.last_error,
                "result": row.result,
                "created_at": at(row.created_at),
                "updated_at": at(row.updated_at),
                "completed_at": at(row.completed_at),
            }

    def reset_for_replay(self, idempotency_key: str) -> bool:
        """Start a dead key's attempts over (DLQ replay); False if it is not dead."""
        with self._lock:
            row = self.rows.get(idempotency_key)
            if row is None or row.state != "dead":
                return False
            row.state, row.attempts, row.updated_at = "failed", 0, self._clock()
            row.takeovers = row.interruptions = 0
            return True

    def purge(self, ttl_seconds: float, *, batch: int = 10_000, keep: Sequence[str] = ()) -> int:
        """Delete completed and dead records older than the TTL, except the keys in `keep`."""
        with self._lock:
            cutoff = self._clock() - ttl_seconds
            kept = set(keep)
            old = [
                k
                for k, r in self.rows.items()
                if r.state in ("completed", "dead") and r.updated_at < cutoff and k not in kept
            ]
            for k in old:
                del self.rows[k]
            return len(old)

    def counts(self) -> dict[str, int]:
        """Number of records per state."""
        with self._lock:
            out: dict[str, int] = {}
            for r in self.rows.values():
                out[r.state] = out.get(r.state, 0) + 1
            return out

    def retries(self) -> tuple[int, int]:
        """(tasks that needed more than one attempt, attempts beyond the first)."""
        with self._lock:
            again = [r.attempts - 1 for r in self.rows.values() if r.attempts > 1]
            return len(again), sum(again)

    def replayed(self, topic: str) -> dict[int, tuple[datetime, int]]:
        """The replayed offsets of a DLQ topic: when, and how many times."""
        with self._lock:
            return {offset: r for (t, offset), r in self.replays.items() if t == topic}

    def replayed_between(self, topic: str, start: int, end: int) -> int:
        """How many records of an offset range were replayed."""
        return sum(1 for offset in self.replayed(topic) if start <= offset < end)

    @contextmanager
    def replaying(
        self, *, topic: str, offset: int, task_id: str, idempotency_key: str, force: bool
    ) -> Iterator[int | None]:
        """Mark a record replayed for the block (None: replayed before and not forced); the mark stays
        only if the block exits cleanly, and a concurrent replay waits for it (as PostgresReplayLog)."""
        with self._replay_lock:
            before = self.replays.get((topic, offset))
            if before is not None and not force:
                yield None
                return
            count = (before[1] if before else 0) + 1
            yield count  # an exception here (the send failed) leaves no mark
            with self._lock:
                self.replays[(topic, offset)] = (datetime.fromtimestamp(self._clock(), UTC), count)

    def close(self) -> None:
        """Nothing to release."""


# ----------------------------------------------------------------------------------------------- registry
_PROMOTIONS = {
    "int": {"int", "long", "float", "double"},
    "long": {"long", "float", "double"},
    "float": {"float", "double"},
    "string": {"string", "bytes"},
    "bytes": {"bytes", "string"},
}


def _type_name(t: Any) -> str:
    if isinstance(t, str):
        return t
    if isinstance(t, list):
        return "union"
    return str(t.get("type")) if isinstance(t, Mapping) else repr(t)


def _reads(reader: Any, writer: Any, path: str) -> str | None:
    """Why data written with `writer` cannot be read with `reader` (Avro resolution), or None."""
    if isinstance(writer, list):  # every branch the writer may have used must be readable
        for w in writer:
            problem = _reads(reader, w, path)
            if problem:
                return problem
        return None
    if isinstance(reader, list):
        return (
            None if any(_reads(r, writer, path) is None for r in reader) else f"{path}: no union branch fits"
        )
    r, w = _type_name(reader), _type_name(writer)
    if r == "record" and w == "record":
        old = {f["name"]: f for f in writer.get("fields", [])}
        for f in reader.get("fields", []):
            if f["name"] in old:
                problem = _reads(f["type"], old[f["name"]]["type"], f"{path}.{f['name']}")
                if problem:
                    return problem
            elif "default" not in f:
                return f"{path}.{f['name']}: new field without a default"
        return None
    if r in ("array", "map") and r == w:
        key = "items" if r == "array" else "values"
        return _reads(reader[key], writer[key], f"{path}[]")
    if r == "enum" and w == "enum":
        missing = set(writer.get("symbols", [])) - set(reader.get("symbols", []))
        return (
            f"{path}: enum symbols {sorted(missing)} removed" if missing and "default" not in reader else None
        )
    if r == "fixed" and w == "fixed":
        return None if reader.get("size") == writer.get("size") else f"{path}: fixed size changed"
    if r == w or r in _PROMOTIONS.get(w, set()):
        return None
    return f"{path}: {w} cannot be read as {r}"


class InMemoryRegistry:
    """A schema registry in memory: subjects named by the record's full name, versions under BACKWARD
    compatibility (a new version must read data written with the latest one), ids that never change."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subjects: dict[str, list[RegisteredSchema]] = {}
        self._by_id: dict[int, RegisteredSchema] = {}
        self._ids = count(1)

    def register(
        self, schema: Mapping[str, Any], *, compatibility: str | None = "BACKWARD"
    ) -> RegisteredSchema:
        """Register a record schema under its full name; IncompatibleSchemaError if it breaks BACKWARD."""
        subject = avro.full_name(schema)
        parsed = avro.parse(schema, source=f"schema of {subject}")
        text = avro.canonical_json(schema)
        with self._lock:
            versions = self._subjects.setdefault(subject, [])
            for reg in versions:
                if avro.canonical_json(reg.schema) == text:
                    return reg
            if versions and compatibility:
                problem = _reads(dict(schema), versions[-1].schema, subject)
                if problem:
                    raise IncompatibleSchemaError(
                        f"registering {subject}: incompatible with version {versions[-1].version}: {problem}"
                    )
            same = next((r for r in self._by_id.values() if avro.canonical_json(r.schema) == text), None)
            schema_id = same.schema_id if same else next(self._ids)
            reg = RegisteredSchema(subject, schema_id, len(versions) + 1, dict(schema), parsed)
            versions.append(reg)
            self._by_id.setdefault(schema_id, reg)
            return reg

    def check(self, schema: Mapping[str, Any]) -> bool:
        """Whether the schema may become the next version of its subject (True for a new subject)."""
        with self._lock:
            versions = self._subjects.get(avro.full_name(schema))
            return not versions or _reads(dict(schema), versions[-1].schema, "") is None

    def latest(self, subject: str) -> RegisteredSchema:
        """The latest version of a subject; SchemaNotFoundError if unregistered."""
        with self._lock:
            versions = self._subjects.get(subject)
            if not versions:
                raise SchemaNotFoundError(f"looking up task type {subject}: Subject '{subject}' not found")
            return versions[-1]

    def lookup(self, schema: Mapping[str, Any]) -> RegisteredSchema:
        """The registered version identical to this schema; SchemaNotFoundError if never registered."""
        subject, text = avro.full_name(schema), avro.canonical_json(schema)
        with self._lock:
            for reg in self._subjects.get(subject, []):
                if avro.canonical_json(reg.schema) == text:
                    return reg
        raise SchemaNotFoundError(f"looking up {subject}: schema not found")

    def cached(self, schema_id: int) -> avro.ParsedSchema | None:
        """The parsed schema of an id."""
        with self._lock:
            reg = self._by_id.get(schema_id)
            return reg.parsed if reg else None

    def by_id(self, schema_id: int) -> avro.ParsedSchema:
        """The parsed writer schema of an id; SchemaNotFoundError if none."""
        parsed = self.cached(schema_id)
        if parsed is None:
            raise SchemaNotFoundError(f"fetching schema id {schema_id}: Schema {schema_id} not found")
        return parsed

    def subjects(self) -> list[str]:
        """Every subject."""
        with self._lock:
            return sorted(s for s, v in self._subjects.items() if v)

    def versions(self, subject: str) -> list[int]:
        """The version numbers of a subject."""
        with self._lock:
            return [r.version for r in self._subjects.get(subject, [])]

    def delete_subject(self, subject: str) -> None:
        """Forget a subject's versions (ids stay readable, as in a registry)."""
        with self._lock:
            self._subjects.pop(subject, None)

    def close(self) -> None:
        """Nothing to release."""


# -------------------------------------------------------------------------------------------------- queue
class RecordingHook:
    """A worker hook that keeps every event, so a test can assert on them or wait for one."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._cond = threading.Condition()

    def __call__(self, event: Event) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def of(self, kind: type[E]) -> list[E]:
        """Every event of this type so far."""
        with self._cond:
            return [e for e in self.events if isinstance(e, kind)]

    def wait(self, check: Callable[[], bool], *, timeout: float, what: str) -> None:
        """Block until `check()` holds (checked again on every event); AssertionError after `timeout`."""
        with self._cond:
            if not self._cond.wait_for(check, timeout):
                raise AssertionError(
                    f"timed out after {timeout}s waiting for {what}; last events: {self.events[-20:]}"
                )

    def count(self, kind: type[Event], n: int, *, timeout: float = 60.0) -> None:
        """Wait for at least `n` events of this type."""
        self.wait(lambda: len(self.of(kind)) >= n, timeout=timeout, what=f"{n} {kind.__name__} events")


class InMemoryQueue:
    """A producer, a worker and the delay forwarder of `handlers` over the in-memory fakes.

    `run_until_idle()` runs until every task is done: completed, skipped as a duplicate, or dead-lettered,
    retries included; delays and backoff are fast-forwarded on `clock`, so nothing waits for real.
    """

    def __init__(
        self,
        handlers: Handlers,
        *,
        namespace: str = "taskq",
        concurrency: int = 4,
        connect: Callable[[], Any] | None = None,
    ) -> None:
        self.clock = Clock()
        self.settings = Settings(namespace=namespace)
        self.topics = Topics(self.settings.namespace, self.settings.delay_tiers)
        self.broker = InMemoryBroker(clock=self.clock.time)
        self.broker.admin().create_topics(topic_specs(self.settings, partitions=2))
        self.registry = InMemoryRegistry()
        for spec in handlers:
            if spec.schema is not None:
                self.registry.register(spec.schema)
        self.store = InMemoryStore(
            owner="in-memory", namespace=namespace, clock=self.clock.time, connect=connect
        )
        self.producer = TaskProducer(self.settings, registry=self.registry, broker=self.broker)
        self.events = RecordingHook()
        self.worker = Worker(
            handlers,
            self.settings,
            WorkerConfig(
                concurrency=concurrency, forwarder=False, commit_interval=0.001, worker_id="in-memory"
            ),
            broker=self.broker,
            store=self.store,
            registry=self.registry,
            hooks=[self.events],
            clock=self.clock.monotonic,
        )
        self.forwarder = Forwarder(
            self.settings, instance_id="in-memory", broker=self.broker, clock=self.clock.time
        )
        self._started = False

    @property
    def completed(self) -> list[TaskCompleted]:
        """The tasks whose completion was recorded, in order."""
        return self.events.of(TaskCompleted)

    @property
    def dlq(self) -> DeadLetters:
        """The DLQ tools over the fakes: list, show and replay, as `taskq dlq` does."""
        return DeadLetters(self.settings, broker=self.broker, registry=self.registry, store=self.store)

    @property
    def dead_letters(self) -> list[DlqRecord]:
        """The DLQ's records, oldest first, with why each failed."""
        return [parse_record(r) for r in self.broker.records(self.topics.dlq)]

    def run_until_idle(self, *, timeout: float = 60.0) -> None:
        """Run until nothing is left to do; TaskqError if that takes more than `timeout` real seconds."""
        if not self._started:
            self.worker.start()
            self.forwarder.start()
            self._started = True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.producer.flush()
            if self.forwarder.step(wait=0.0):
                continue
            pending = self.broker.uncommitted(self.worker.group, self.topics.priority_topics)
            if pending or not self.worker.idle():
                due = self.worker.waiting_until()
                if due is not None:
                    self.clock.advance(due - self.clock.monotonic())
                self.worker.step()
                continue
            if self.broker.uncommitted(self.forwarder.group, self.topics.delay_topics) == 0:
                return
            due = self.forwarder.next_due()
            if due is not None:
                self.clock.advance(due - self.clock.time())
        raise TaskqError(f"the in-memory queue was still busy after {timeout}s")

    def close(self) -> None:
        """Stop the worker's executor and release everything."""
        if self._started:
            self.worker.close()
            self.forwarder.close()
        self.producer.close()

    def __enter__(self) -> InMemoryQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
