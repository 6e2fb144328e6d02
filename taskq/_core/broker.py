"""What the rest of the code needs of Kafka: records, and a `Broker` that hands out sources, sinks and an
admin. `taskq._core.kafka_clients.KafkaBroker` gives the real clients; `taskq.testing` gives in-memory ones
with the same semantics (partitions, offsets, commits, pause, transactions)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from taskq._core.envelope import Headers

TP = tuple[str, int]
#: Seconds a transactional call (adding offsets, commit, abort, init) may take before the transaction is given
#: up; the broker aborts an open transaction after TRANSACTION_ABORT_MS anyway.
TRANSACTION_TIMEOUT = 10.0
#: Called once per produced record with None or an error text, from the producer's poll.
DeliveryCallback = Callable[[str | None, "Record | None"], None]
#: A batch's delivery report: (index of the record in the batch, error or None, the record if acknowledged).
BatchCallback = Callable[[int, str | None, "Record | None"], None]
#: A record to send: topic, value, key, headers.
OutRecord = tuple[str, bytes | None, bytes | None, Headers]


@dataclass(slots=True)
class Record:
    """One Kafka record as the rest of the code sees it."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Headers
    timestamp_ms: int
    #: Why the headers could not be read (they are then empty): the record is input that never becomes a
    #: task, dead-lettered with this as its reason.
    header_error: str | None = None
    #: How many times a share group has handed this record out, this time included (None outside share
    #: groups): the broker counts lock expiries and releases alike.
    delivery_count: int | None = None

    @property
    def tp(self) -> TP:
        """(topic, partition)."""
        return (self.topic, self.partition)

    def header(self, name: str) -> bytes | None:
        """The last value of a header, or None."""
        for k, v in reversed(self.headers):
            if k == name:
                return v
        return None


#: The outcome of an asynchronous commit: the offsets the broker committed, and why the others were not.
Committed = Callable[[dict[TP, int], str | None], None]


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """A topic to provision."""

    name: str
    partitions: int
    replication: int | None = None  # None: the broker's default.replication.factor
    config: Mapping[str, str] | None = None


class RecordSource(Protocol):
    """A consumer in a group (or reading assigned partitions), with manual commits."""

    def subscribe(self, topics: Sequence[str]) -> None: ...
    def assign(self, tps: Iterable[tuple[str, int, int]]) -> None: ...
    def poll(self, max_records: int, timeout: float) -> list[Record]: ...
    def pause(self, tps: Iterable[TP]) -> None: ...
    def resume(self, tps: Iterable[TP]) -> None: ...
    def seek(self, tp: TP, offset: int) -> None: ...
    def commit(self, offsets: Mapping[TP, int], *, asynchronous: bool = False) -> None: ...
    def committed(self, tps: Iterable[TP], timeout: float = 10.0) -> dict[TP, int]: ...
    def lag(self) -> dict[TP, int]: ...
    def high_watermarks(self, tps: Iterable[TP]) -> dict[TP, int]: ...
    def position(self, tp: TP) -> int: ...
    def group_metadata(self) -> object: ...
    def assignment(self) -> list[TP]: ...
    def close(self) -> None: ...


#: The outcome of a share group's acknowledgement commit: the offsets acknowledged per partition, and the
#: broker's refusal of them (None: taken). A refusal means they were not this member's any more, as when
#: their lock expired: the broker will hand them (or has handed them) out again.
Acknowledged = Callable[[dict[TP, set[int]], str | None], None]


class ShareRecordSource(Protocol):
    """A member of a share group (KIP-932): records handed out under a lock, each acknowledged on its own."""

    def poll(self, max_records: int, timeout: float) -> list[Record]: ...
    def accept(self, record: Record) -> bool: ...
    def release(self, record: Record) -> bool: ...
    def reject(self, record: Record) -> bool: ...
    def in_flight(self) -> int: ...
    def commit(self) -> None: ...
    def close(self) -> None: ...


class RecordSink(Protocol):
    """A producer with acks=all and idempotence; transactional when it was made with an id."""

    def send(
        self,
        topic: str,
        value: bytes | None,
        *,
        key: bytes | None,
        headers: Headers,
        on_delivery: DeliveryCallback | None = None,
        partition: int | None = None,
        on_failure: Callable[[str], None] | None = None,
    ) -> None: ...
    def send_many(
        self,
        records: Iterable[OutRecord],
        *,
        on_delivery: BatchCallback | None = None,
        on_failure: Callable[[str, Record], None] | None = None,
    ) -> None: ...
    def poll(self, timeout: float = 0.0) -> int: ...
    def flush(self, timeout: float | None = None) -> int: ...
    def __len__(self) -> int: ...
    def init_transactions(self, timeout: float = TRANSACTION_TIMEOUT) -> None: ...
    def begin(self) -> None: ...
    def commit_offsets_in_transaction(
        self, source: RecordSource, offsets: Mapping[TP, int], timeout: float = TRANSACTION_TIMEOUT
    ) -> None: ...
    def commit(self, timeout: float = TRANSACTION_TIMEOUT) -> None: ...
    def abort(self, timeout: float = TRANSACTION_TIMEOUT) -> None: ...


class TopicAdmin(Protocol):
    """Topic provisioning and offset look-ups."""

    def create_topics(self, specs: Sequence[TopicSpec]) -> dict[str, bool]: ...
    def delete_topics(self, names: Sequence[str]) -> None: ...
    def partitions(self, topics: Sequence[str]) -> dict[str, int]: ...
    def end_offsets(self, topics: Sequence[str]) -> dict[TP, int]: ...
    def start_offsets(self, topics: Sequence[str]) -> dict[TP, int]: ...
    def committed(self, group: str, topics: Sequence[str]) -> dict[TP, int]: ...


class Broker(Protocol):
    """Where sources, sinks and the admin come from: Kafka itself, or an in-memory broker in tests."""

    def source(
        self,
        *,
        group: str,
        on_assign: Callable[[list[TP]], None] | None = None,
        on_revoke: Callable[[list[TP]], None] | None = None,
        on_commit: Committed | None = None,
        raise_when_stuck: bool = False,
    ) -> RecordSource: ...
    def sink(self, *, transactional_id: str | None = None, **overrides: Any) -> RecordSink: ...
    def admin(self) -> TopicAdmin: ...
