"""`InMemoryBroker`: Kafka's topics, partitions, consumer groups and transactions in memory."""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import count
from typing import Any

from taskq._core.broker import (
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
from taskq._core.envelope import Headers
from taskq._core.errors import KafkaUnavailableError, RecordTooLargeError


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

