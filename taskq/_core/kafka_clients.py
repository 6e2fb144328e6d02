"""The librdkafka clients: `Sink` (a producer), `Source` (a consumer) and `KafkaBroker`, which makes them,
a share group's member (`taskq._core.share`) and the admin from one Settings. Their errors become the
project's here, with the client's as __cause__."""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_END,
    OFFSET_INVALID,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from taskq._core.broker import (
    TP,
    TRANSACTION_TIMEOUT,
    Acknowledged,
    BatchCallback,
    Committed,
    DeliveryCallback,
    OutRecord,
    Record,
    RecordSource,
)
from taskq._core.envelope import Headers
from taskq._core.errors import ConfigurationError, KafkaUnavailableError, RecordTooLargeError
from taskq._core.kafka import consumer_config, producer_config
from taskq._core.settings import Settings, redact
from taskq._core.settling import Settling, kept_through, reading_positions

if TYPE_CHECKING:
    from taskq._core.kafka_admin import Admin
    from taskq._core.share import ShareSource

log = logging.getLogger("taskq.kafka")

#: Errors meaning a partition's leader or a group's coordinator is not (yet) ready where asked: retried
#: until the admin timeout.
NOT_READY = frozenset(
    {
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        # A broker and a client whose metadata of a new topic's leader are at different epochs, as on a
        # broker's first seconds: either catches up within moments (seen in CI: "Leader epoch is newer than
        # broker epoch" on the first topics of a freshly started broker).
        KafkaError.UNKNOWN_LEADER_EPOCH,
        KafkaError.FENCED_LEADER_EPOCH,
    }
)
#: How much longer than its own timeout a transactional call is waited for before it is left behind.
_TRANSACTION_GRACE = 5.0
#: transaction.timeout.ms: the broker aborts a transaction open this long. One left open by a producer killed
#: mid-way holds back every read_committed reader of its partitions until then (unless a new producer of its
#: transactional id fences it first), so it is short; yet longer than a transaction's two bounded calls
#: (its offsets, then its commit), so the broker never aborts one its forwarder is still waiting for.
TRANSACTION_ABORT_MS = 35_000


#: Where auto.offset.reset starts a partition that has no committed offset (librdkafka's names for it).
_RESET_TO = {
    "earliest": OFFSET_BEGINNING,
    "smallest": OFFSET_BEGINNING,
    "beginning": OFFSET_BEGINNING,
    "latest": OFFSET_END,
    "largest": OFFSET_END,
    "end": OFFSET_END,
}
#: How long a newly assigned partition's committed offset is waited for before librdkafka is left to read it.
_COMMITTED_TIMEOUT = 5.0


def start_positions(committed: list[TopicPartition], reset: int | None) -> list[TopicPartition]:
    """The partitions to assign, from their committed offsets (`Consumer.committed`): a partition with one
    starts there (its leader epoch kept); one without starts at `reset` (OFFSET_BEGINNING or OFFSET_END),
    or is left for librdkafka to decide (auto.offset.reset=error, `reset` None); so is one whose offset
    could not be read (an error on it, e.g. a transaction's offsets not yet stable)."""
    out = []
    for p in committed:
        if p.error is None and p.offset == OFFSET_INVALID and reset is not None:
            p = TopicPartition(p.topic, p.partition, reset)
        elif p.error is not None:
            p = TopicPartition(p.topic, p.partition)
        out.append(p)
    return out


def record_of(msg: Message, delivery_count: int | None = None) -> Record:
    headers, error = _headers(msg)
    return Record(
        topic=msg.topic() or "",
        partition=msg.partition() or 0,
        offset=msg.offset() or 0,
        key=msg.key(),
        value=msg.value(),
        headers=headers,
        timestamp_ms=msg.timestamp()[1],
        header_error=error,
        delivery_count=delivery_count,
    )


#: Message.headers(), called so that its result is always checked. The client decodes each header key as
#: UTF-8; on a key that is not, it returns a list holding a tuple with a missing key *and* sets the
#: exception. A plain `msg.headers()` that the interpreter has specialised (a hot call site) skips the
#: check: the list comes back, and unpacking the broken tuple kills the process with SIGSEGV. Called this
#: way the call always raises SystemError (from the UnicodeDecodeError) and the list is never seen.
_read_headers = operator.methodcaller("headers")


def _headers(msg: Message) -> tuple[Headers, str | None]:
    """The record's headers, or none and why they could not be read."""
    try:
        raw: Any = _read_headers(msg) or []
    except (UnicodeError, SystemError) as exc:
        cause = exc if isinstance(exc, UnicodeError) else exc.__cause__ or exc.__context__
        if isinstance(cause, UnicodeError):
            return [], f"unreadable headers: a header key is not valid UTF-8 ({cause})"
        return [], f"unreadable headers: {str(exc)[:200]}"
    # Values come as bytes: those tuples are kept as they are (a conversion per header cost 2 us a record).
    return [kv if type(kv[1]) is bytes else (str(kv[0]), _bytes(kv[1])) for kv in raw], None


def _bytes(value: str | bytes | None) -> bytes:
    return value.encode() if isinstance(value, str) else (value or b"")


C = TypeVar("C")


def new_client(factory: Callable[[dict[str, Any]], C], conf: dict[str, Any]) -> C:
    """A librdkafka client; a setting it refuses (TASKQ_KAFKA_* included) is one line naming it."""
    try:
        return factory(conf)
    except (KafkaException, ValueError, TypeError) as exc:
        err = exc.args[0] if exc.args else exc
        text = err.str() if isinstance(err, KafkaError) else str(err)
        raise ConfigurationError(redact(f"Kafka client settings: {text}")) from exc


@contextmanager
def client_errors(what: str) -> Iterator[None]:
    """Turn the client's errors into the project's, keeping the original as __cause__."""
    try:
        yield
    except KafkaException as exc:
        raise unavailable(what, exc) from exc
    except SystemError as exc:
        # A client call that raises its error (a fenced producer's flush) and then serves a callback in
        # the same call (a log line) surfaces as SystemError, the client's error as its cause.
        if isinstance(exc.__cause__, KafkaException):
            raise unavailable(what, exc.__cause__) from exc
        raise


#: Errors meaning no broker answered in time: the message says where it asked and how long it waited.
_UNREACHABLE = frozenset(
    {KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError._ALL_BROKERS_DOWN, KafkaError._RESOLVE}
)


def unavailable(
    what: str, exc: KafkaException, *, servers: str = "", timeout: float = 0.0
) -> KafkaUnavailableError:
    """The project's error for the client's error while doing `what`; given the `servers` asked and the
    `timeout`, one meaning that no broker answered says where it asked and how long it waited."""
    err = exc.args[0] if exc.args else exc
    if not isinstance(err, KafkaError):
        return KafkaUnavailableError(f"{what}: {err}")
    if servers and err.code() in _UNREACHABLE:
        return KafkaUnavailableError(
            f"{what}: no answer from the Kafka broker at {servers} within {timeout:g} s ({err.str()})"
        )
    return KafkaUnavailableError(f"{what}: {err.str()} ({err.name()})")


#: Seconds each of a new producer's early metadata requests waits for an answer (`_ask_for_metadata_early`).
_EARLY_METADATA_TIMEOUT = 10.0


def _ask_for_metadata_early(producer: Producer, topic: str | None) -> None:
    """Ask for `topic`'s metadata (the whole cluster's if None) twice, in a thread of its own, so that a new
    producer has its producer id as soon as a broker can give it (`Sink._ask_early`: at its first send or
    registration).

    librdkafka (2.10 on) drops the bootstrap broker once the first metadata names the cluster's brokers. An
    idempotent producer asks for its id at that moment, finds no broker up, and asks again after the next
    metadata answer or when its 500 ms timer fires. A record sent as the producer was made had its topic's
    metadata in that first answer, so nothing came before the timer: it waited half a second (as a script's
    or a test's first record did; 506 ms from the Sink's making to the record's acknowledgement, now 20),
    and a transactional producer's registration waited for it too (508-512 ms in most, now 20-30).
    Here the first request is answered by the bootstrap broker, the second by a learned one, and the id
    follows at once. A send names the topic it sends to, whose metadata the send asks for anyway (so the
    broker's auto-creation, if on, creates nothing the send would not): the whole cluster's metadata is a
    few MB on a cluster of thousands of topics. A registration has no topic to name, and the client cannot
    ask for none without naming one: it asks for all. A broker that does not answer leaves it to the timer,
    and the sends report it as before."""

    def ask() -> None:
        for _ in range(2):
            try:
                if topic is None:
                    producer.list_topics(timeout=_EARLY_METADATA_TIMEOUT)
                else:
                    producer.list_topics(topic, timeout=_EARLY_METADATA_TIMEOUT)
            except KafkaException:
                return

    threading.Thread(target=ask, name="taskq-producer-id", daemon=True).start()


class Sink:
    """A Kafka producer with acks=all and idempotence; optionally transactional."""

    def __init__(self, settings: Settings, *, transactional_id: str | None = None, **overrides: Any) -> None:
        conf = producer_config(settings)
        if transactional_id:
            conf["transactional.id"] = transactional_id
            conf["transaction.timeout.ms"] = TRANSACTION_ABORT_MS
            conf["message.timeout.ms"] = TRANSACTION_ABORT_MS  # librdkafka requires it <= the above
        conf.update(overrides)
        self._p = new_client(Producer, conf)
        self._asked = False  # whether `_ask_for_metadata_early` ran: at the first send or registration
        self._servers = redact(settings.bootstrap_servers)
        self._message_timeout = float(conf["message.timeout.ms"]) / 1000
        self._stuck = ""  # why the producer was given up: a transactional call never returned

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
    ) -> None:
        """Queue one record; `on_delivery` runs from poll()/flush() with None on success or the error.
        `on_failure` instead hears only of a failure, without the record: the cheaper report when the
        partition and offset of a success are not wanted."""
        cb = None
        if on_delivery is not None:

            def cb(err: KafkaError | None, msg: Message) -> None:
                if err is None:
                    on_delivery(None, record_of(msg))
                else:
                    on_delivery(self._failure(err), None)

        elif on_failure is not None:

            def cb(err: KafkaError | None, msg: Message) -> None:
                if err is not None:
                    on_failure(self._failure(err))

        if not self._asked:
            self._ask_early(topic)
        kw: dict[str, Any] = {"key": key, "value": value, "headers": headers, "on_delivery": cb}
        if partition is not None:
            kw["partition"] = partition
        while True:
            try:
                self._p.produce(topic, **kw)
                return
            except BufferError:
                # The local queue is full: serve delivery reports to make room, never drop the record.
                self._p.poll(0.05)
            except KafkaException as exc:
                raise self._refused(topic, value, key, headers, exc) from exc

    def send_many(
        self,
        records: Iterable[OutRecord],
        *,
        on_delivery: BatchCallback | None = None,
        on_failure: Callable[[str, Record], None] | None = None,
    ) -> None:
        """Queue records in order, with the least work per record: `on_delivery(i, error, record)` hears of
        the i-th record's acknowledgement or failure; `on_failure(error, record)` instead only of failures
        (one callback shared by the whole batch)."""
        if not self._asked:
            records = list(records)
            self._ask_early(records[0][0] if records else None)
        shared: Callable[[KafkaError | None, Message], None] | None = None
        if on_delivery is not None:

            def report(i: int, err: KafkaError | None, msg: Message) -> None:
                if err is None:
                    on_delivery(i, None, record_of(msg))
                else:
                    on_delivery(i, self._failure(err), None)

        elif on_failure is not None:
            # One small object per batch: in-flight records keep their callback alive until their report,
            # and the fewer objects they keep, the less the garbage collector has to walk meanwhile.
            shared = partial(self._failed, on_failure)

        produce = self._p.produce
        for i, (topic, value, key, headers) in enumerate(records):
            cb = shared if on_delivery is None else partial(report, i)
            while True:
                try:
                    # The client's stubs want a list of str | bytes | None values; bytes are what it sends.
                    produce(topic, value, key, on_delivery=cb, headers=headers)  # type: ignore[arg-type]
                    break
                except BufferError:
                    # The local queue is full: serve delivery reports to make room, never drop the record.
                    self._p.poll(0.05)
                except KafkaException as exc:
                    raise self._refused(topic, value, key, headers, exc) from exc

    def _failed(
        self, on_failure: Callable[[str, Record], None], err: KafkaError | None, msg: Message
    ) -> None:
        if err is not None:
            on_failure(self._failure(err), record_of(msg))

    def _refused(
        self, topic: str, value: bytes | None, key: bytes | None, headers: Headers, exc: KafkaException
    ) -> KafkaUnavailableError:
        err = exc.args[0] if exc.args else None
        if isinstance(err, KafkaError) and err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
            size = len(value or b"") + len(key or b"") + sum(len(k) + len(v) for k, v in headers)
            return RecordTooLargeError(f"producing to {topic}: a record of {size} bytes is too large")
        return unavailable(f"producing to {topic}", exc)

    def _ask_early(self, topic: str | None = None) -> None:
        """At the first send or registration, not as the Sink is made: a worker makes its Sinks as it starts
        and most send nothing for a while (the requests there cost its start some 8 ms: 2 cores)."""
        self._asked = True
        _ask_for_metadata_early(self._p, topic)

    def _failure(self, err: KafkaError) -> str:
        if err.code() == KafkaError._MSG_TIMED_OUT:
            return (
                f"no answer from the Kafka broker at {self._servers} within {self._message_timeout:g} s "
                f"({err.str()})"
            )
        return f"{err.str()} ({err.name()})"

    def poll(self, timeout: float = 0.0) -> int:
        """Serve delivery callbacks."""
        return int(self._p.poll(timeout))

    def flush(self, timeout: float | None = None) -> int:
        """Wait until every queued record is delivered or failed; returns how many are still queued."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # In slices: an exception raised by a callback (refused credentials, see _on_error) surfaces
            # only when the call returns, and one flush call returns only once the queue is empty.
            left = deadline - time.monotonic() if deadline is not None else 0.5
            with client_errors("flushing"):  # a fenced transactional producer raises its fatal error here
                queued = int(self._p.flush(max(0.0, min(0.5, left))))
            if not queued or (deadline is not None and time.monotonic() >= deadline):
                return queued

    def __len__(self) -> int:
        return len(self._p)

    # Transactions, for the delay forwarder. Every client error is wrapped: a failed transaction surfaces
    # as KafkaUnavailableError (with the client's error as __cause__), never as confluent's exception.
    def init_transactions(self, timeout: float = TRANSACTION_TIMEOUT) -> None:
        """Register the transactional id, fencing any older instance that used it (and ending its
        transaction: a commit it had asked for completes, anything else is aborted)."""
        if not self._asked:
            self._ask_early()
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._p.init_transactions(min(1.0, max(0.0, deadline - time.monotonic())))
                return
            except KafkaException as exc:
                # librdkafka: a timeout is retriable, the next call resumes where this one stopped; so is a
                # coordinator still loading or moving, as in a broker's first seconds.
                err = exc.args[0] if exc.args else None
                code = err.code() if isinstance(err, KafkaError) else None
                again = code == KafkaError._TIMED_OUT or (isinstance(err, KafkaError) and err.retriable())
                if not again or time.monotonic() >= deadline:
                    raise unavailable("initialising transactions", exc) from exc
            # The call itself serves no callbacks: this poll lets refused credentials raise (_on_error).
            self._p.poll(0)

    def begin(self) -> None:
        """Begin a transaction."""
        self._usable("beginning a transaction")
        with client_errors("beginning a transaction"):
            self._p.begin_transaction()

    def commit_offsets_in_transaction(
        self, source: RecordSource, offsets: Mapping[TP, int], timeout: float = TRANSACTION_TIMEOUT
    ) -> None:
        """Add consumed offsets to the open transaction (atomic with the records sent in it)."""
        tps = [TopicPartition(t, p, o) for (t, p), o in offsets.items()]
        metadata = source.group_metadata()
        self._bounded(
            "adding offsets to the transaction",
            lambda left: self._p.send_offsets_to_transaction(tps, metadata, left),
            timeout,
        )

    def commit(self, timeout: float = TRANSACTION_TIMEOUT) -> None:
        """Commit the open transaction."""
        self._bounded("committing the transaction", self._p.commit_transaction, timeout)

    def abort(self, timeout: float = TRANSACTION_TIMEOUT) -> None:
        """Abort the open transaction."""
        self._bounded("aborting the transaction", self._p.abort_transaction, timeout)

    def _usable(self, what: str) -> None:
        if self._stuck:
            raise KafkaUnavailableError(f"{what}: this producer was given up ({self._stuck})")

    def _bounded(self, what: str, call: Callable[[float], object], timeout: float) -> None:
        """`call(timeout)`, given up when it has not returned `timeout` seconds (and a grace) later.

        librdkafka does not always keep the timeout it is given: send_offsets_to_transaction can wait for
        ever on a group coordinator that went away (librdkafka issues 5456 and 5511). So the call runs on a
        thread of its own and is waited for here; one that overstays is left behind, and this producer
        with it: every later call raises, and its owner makes a new one (whose init_transactions fences
        this one and ends its transaction).
        """
        self._usable(what)
        outcome: list[BaseException | None] = []
        done = threading.Event()

        def run() -> None:
            try:
                call(timeout)
                outcome.append(None)
            except BaseException as exc:  # handed to the caller's thread below
                outcome.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, name="taskq-transaction", daemon=True).start()
        if not done.wait(timeout + _TRANSACTION_GRACE):
            self._stuck = f"{what} had no answer within {timeout:g} s"
            raise KafkaUnavailableError(f"{what}: no answer within {timeout:g} s; the producer is given up")
        exc = outcome[0]
        if isinstance(exc, KafkaException):
            raise unavailable(what, exc) from exc
        if exc is not None:
            raise exc


def _commit_outcome(err: KafkaError | None, parts: list[TopicPartition]) -> tuple[dict[TP, int], str | None]:
    if err is not None:
        # Nothing to commit (offsets already committed) is no failure: there is nothing to send again.
        return {}, None if err.code() == KafkaError._NO_OFFSET else f"{err.str()} ({err.name()})"
    done = {(p.topic, p.partition): p.offset for p in parts if p.error is None and p.offset >= 0}
    failed = [p.error for p in parts if p.error is not None]
    return done, f"{failed[0].str()} ({failed[0].name()})" if failed else None


class Source:
    """A Kafka consumer in a group, with manual commits; callbacks get (topic, partition) tuples."""

    def __init__(
        self,
        settings: Settings,
        *,
        group: str,
        on_assign: Callable[[list[TP]], None] | None = None,
        on_revoke: Callable[[list[TP]], None] | None = None,
        on_commit: Committed | None = None,
        raise_when_stuck: bool = False,
        **overrides: Any,
    ) -> None:
        """`raise_when_stuck`: poll raises when the client reports partitions it will never fetch (below).
        `on_commit`: called from poll with the outcome of each asynchronous commit."""
        conf = consumer_config(settings, group=group)
        if on_commit is not None:
            conf["on_commit"] = lambda err, parts: on_commit(*_commit_outcome(err, parts))
        conf.update(overrides)
        self._c = new_client(Consumer, conf)
        self._on_assign = on_assign
        self._on_revoke = on_revoke
        self._raise_when_stuck = raise_when_stuck
        self._incremental = conf.get("group.protocol") == "consumer" or "cooperative" in str(
            conf.get("partition.assignment.strategy", "")
        )
        self._reset = _RESET_TO.get(str(conf.get("auto.offset.reset", "latest")))
        self._closing = False
        self._unreported: set[TP] = set()
        #: KIP-848 only: re-subscribing a classic member would make its group rebalance.
        self._settling = Settling() if conf.get("group.protocol") == "consumer" else None
        self._subscription: tuple[list[str], dict[str, Any]] | None = None
        #: Where this consumer last set each assigned partition's reading (its start at assignment, or a
        #: seek): librdkafka's position is unknown after either until a record of the partition is taken.
        self._sought: dict[TP, int] = {}
        #: Partitions kept through an incremental rebalance: their fetcher is woken at the next poll.
        self._to_wake: set[TP] = set()

    def subscribe(self, topics: Sequence[str]) -> None:
        """Join the group for these topics."""

        # Each callback answers its rebalance itself. Left unanswered, the client's fallback first asks
        # librdkafka for the rebalance protocol, a request to the group's thread that can wait forever when
        # the group is closing (librdkafka issue 4041).
        def assigned(c: Consumer, parts: list[TopicPartition]) -> None:
            tps = [(p.topic, p.partition) for p in parts]
            if self._closing:
                # Partitions another member left can reach this one as it leaves. Its owner is not told, and
                # their committed offsets are not read: the close cannot answer that read and waited out its
                # timeout. The close gives them back (librdkafka turns the assignment into an unassignment).
                self._unreported.update(tps)
                if tps:
                    log.info(
                        "leaving the group: %d partition(s) assigned while leaving are given back", len(tps)
                    )
                self._answer(c, parts, assign=True)
                return
            if self._on_assign:
                self._on_assign(tps)
            starts = self._start_positions(parts) if parts else parts
            self._answer(c, starts, assign=True)
            self._sought.update(
                {(p.topic, p.partition): p.offset for p in starts if p.offset != OFFSET_INVALID}
            )
            self._rebalanced(c, tps)

        def revoked(c: Consumer, parts: list[TopicPartition]) -> None:
            tps = [(p.topic, p.partition) for p in parts]
            told = [tp for tp in tps if tp not in self._unreported]
            if self._on_revoke and (told or not tps):
                self._on_revoke(told)
            self._answer(c, parts, assign=False)
            for tp in tps:
                self._sought.pop(tp, None)
            self._rebalanced(c, tps)

        callbacks = {"on_assign": assigned, "on_revoke": revoked, "on_lost": revoked}
        self._subscription = (list(topics), callbacks)
        with client_errors("subscribing"):
            self._c.subscribe(self._subscription[0], **callbacks)
        if self._settling is not None:
            self._settling.changed()

    def _rebalanced(self, c: Consumer, tps: list[TP]) -> None:
        """After a rebalance gave this member `tps` or took them away: the partitions it kept have their
        fetchers woken at the next poll (incremental rebalances), and the group settles again. Not while it
        closes: nothing to wake, and asking for the assignment in its close's revocation can wait for ever."""
        if not tps or self._closing:
            return
        if self._incremental:
            self._to_wake = kept_through(c, tps)  # held, less what moved: the same before the answer or after
        if self._settling is not None:
            self._settling.changed()

    def _nudge(self) -> None:
        """Send the subscription again: a heartbeat now (`taskq._core.settling`)."""
        if self._closing or self._subscription is None:
            return
        topics, callbacks = self._subscription
        try:
            self._c.subscribe(topics, **callbacks)
        except (KafkaException, RuntimeError) as exc:  # only a heartbeat sooner was lost
            log.debug("re-sending the subscription: %s", exc)

    def _answer(self, c: Consumer, parts: list[TopicPartition], *, assign: bool) -> None:
        """Take up (`assign`) or give back a rebalance's partitions, as its protocol does."""
        if self._incremental:
            (c.incremental_assign if assign else c.incremental_unassign)(parts)
        elif assign:
            c.assign(parts)
        else:
            c.unassign()

    def _start_positions(self, parts: list[TopicPartition]) -> list[TopicPartition]:
        """Newly assigned partitions with the offsets to start at: the group's committed offset, or where
        auto.offset.reset points for a partition the group never committed.

        librdkafka left to itself reads the committed offsets too, but for a partition without one it waits
        100 ms before it asks for the log's start (its offset-reset back-off), so every partition of a new
        group, or one new to it, came 100 ms late: a tenth of a worker's start. Asked here in one round trip,
        the reset goes out at once. If that read fails, librdkafka is left to read them as before."""
        try:
            committed = self._c.committed(parts, timeout=_COMMITTED_TIMEOUT)
        except (KafkaException, RuntimeError):
            return parts
        return start_positions(committed, self._reset)

    def assign(self, tps: Iterable[tuple[str, int, int]]) -> None:
        """Read partitions directly (no group membership) from the given offsets."""
        with client_errors("assigning partitions"):
            self._c.assign([TopicPartition(t, p, o) for t, p, o in tps])

    def poll(self, max_records: int, timeout: float) -> list[Record]:
        """Up to max_records records; partition EOFs and transient errors are logged, fatal ones raised."""
        if self._to_wake:
            tps, self._to_wake = self._to_wake, set()
            self._wake(tps)
        settling = self._settling
        if settling is not None and settling.next is not None:
            if settling.due():
                self._nudge()
            timeout = settling.wait(timeout)
        try:
            msgs = self._c.consume(max_records, timeout)
        except KafkaException as exc:
            raise unavailable("polling", exc) from exc
        out = []
        for m in msgs:
            err = m.error()
            if err is None:
                out.append(record_of(m))
            elif err.code() == KafkaError._PARTITION_EOF:
                continue
            elif err.fatal():
                raise KafkaUnavailableError(f"fatal consumer error: {err}")
            elif self._raise_when_stuck and err.code() in NOT_READY and "committed offsets" in err.str():
                # librdkafka (issue 5586): a coordinator that refuses the whole committed-offsets fetch of
                # newly assigned partitions (after a broker restart) leaves them assigned and never fetched,
                # and it never asks again; only a new consumer reads them.
                raise KafkaUnavailableError(f"reading the committed offsets: {err.str()}")
            else:
                log.warning("consumer error: %s", err)
        return out

    def pause(self, tps: Iterable[TP]) -> None:
        """Stop fetching these partitions (the group keeps them)."""
        parts = [TopicPartition(t, p) for t, p in tps]
        if parts:
            with client_errors("pausing partitions"):
                self._c.pause(parts)

    def resume(self, tps: Iterable[TP]) -> None:
        """Fetch these partitions again, from where this consumer left them."""
        parts = [TopicPartition(t, p) for t, p in tps]
        if parts:
            with client_errors("resuming partitions"):
                self._c.resume(parts)
            # With every partition paused librdkafka's fetcher sleeps for about a second, and a resume does
            # not wake it: a seek to where its reading is does (the records come in milliseconds).
            self._wake(tps)

    def _wake(self, tps: Iterable[TP]) -> None:
        """Seek each of `tps` to where this consumer reads it next (`reading_positions`), to wake it."""
        try:
            for tp in reading_positions(self._c, tps, self._sought):
                self._c.seek(tp)
                self._sought[(tp.topic, tp.partition)] = tp.offset
        except KafkaException as exc:  # only the wake-up was lost: the fetcher wakes by itself
            log.debug("waking the fetchers: %s", exc)

    def seek(self, tp: TP, offset: int) -> None:
        """Fetch a partition from this offset next."""
        with client_errors(f"seeking {tp[0]}[{tp[1]}] to {offset}"):
            self._c.seek(TopicPartition(tp[0], tp[1], offset))
        self._sought[tp] = offset

    def commit(self, offsets: Mapping[TP, int], *, asynchronous: bool = False) -> None:
        """Commit offsets (each is the next offset to consume); `asynchronous`: return at once, the outcome
        goes to `on_commit` from a later poll."""
        if not offsets:
            return
        parts = [TopicPartition(t, p, o) for (t, p), o in offsets.items()]
        try:
            if asynchronous:
                self._c.commit(offsets=parts, asynchronous=True)
            else:
                self._c.commit(offsets=parts, asynchronous=False)
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if isinstance(err, KafkaError) and err.code() == KafkaError._NO_OFFSET:
                return
            raise unavailable("committing offsets", exc) from exc

    def committed(self, tps: Iterable[TP], timeout: float = 10.0) -> dict[TP, int]:
        """The group's committed offsets (-1 where none)."""
        with client_errors("reading committed offsets"):
            parts = self._c.committed([TopicPartition(t, p) for t, p in tps], timeout=timeout)
        return {(p.topic, p.partition): (p.offset if p.offset != OFFSET_INVALID else -1) for p in parts}

    def lag(self) -> dict[TP, int]:
        """Per assigned partition: the log end offset last seen in fetches minus this member's position."""
        out: dict[TP, int] = {}
        with client_errors("measuring lag"):
            parts = self._c.assignment()
            for p in self._c.position(parts) if parts else []:
                _, high = self._c.get_watermark_offsets(p, cached=True)
                if high >= 0 and p.offset >= 0:
                    out[(p.topic, p.partition)] = max(0, high - p.offset)
        return out

    def high_watermarks(self, tps: Iterable[TP]) -> dict[TP, int]:
        """The end offset of each of `tps` as last seen by this consumer, without a request (-1: unknown)."""
        with client_errors("reading watermarks"):
            return {
                tp: max(-1, self._c.get_watermark_offsets(TopicPartition(tp[0], tp[1]), cached=True)[1])
                for tp in tps
            }

    def position(self, tp: TP) -> int:
        """The offset this consumer reads next in `tp` (past transaction markers), or -1 if unknown."""
        with client_errors("reading the position"):
            (p,) = self._c.position([TopicPartition(tp[0], tp[1])])
        if p.offset >= 0:
            return int(p.offset)
        # Unknown to librdkafka after an assignment or a seek until a record is taken: where it was set.
        return max(-1, self._sought.get(tp, -1))

    def group_metadata(self) -> object:
        """This member's group metadata, which a transaction's offsets carry (fences zombie members)."""
        with client_errors("reading the group metadata"):
            return self._c.consumer_group_metadata()

    def assignment(self) -> list[TP]:
        """The partitions this member owns."""
        return [(p.topic, p.partition) for p in self._c.assignment()]

    def member_id(self) -> str:
        """This consumer's group member id (empty before it joined)."""
        return str(self._c.memberid() or "")

    def close(self) -> None:
        """Leave the group and release the client."""
        self._closing = True
        with client_errors("closing the consumer"):
            self._c.close()


class KafkaBroker:
    """The real broker: librdkafka clients configured from one Settings."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def source(
        self,
        *,
        group: str,
        on_assign: Callable[[list[TP]], None] | None = None,
        on_revoke: Callable[[list[TP]], None] | None = None,
        on_commit: Committed | None = None,
        raise_when_stuck: bool = False,
    ) -> Source:
        """A consumer in `group`; with `raise_when_stuck`, its poll raises when the client reports
        partitions it will never fetch (its owner then starts a new consumer)."""
        return Source(
            self.settings,
            group=group,
            on_assign=on_assign,
            on_revoke=on_revoke,
            on_commit=on_commit,
            raise_when_stuck=raise_when_stuck,
        )

    def share_source(
        self,
        *,
        group: str,
        topics: Sequence[str],
        consumers: int = 2,
        max_poll_records: int = 1,
        on_commit: Acknowledged | None = None,
        **overrides: Any,
    ) -> ShareSource:
        """A member of share group `group` on `topics`, made of `consumers` ShareConsumers (see
        ShareSource); the group reads from its topics' start once `Admin.configure_share_group` ran."""
        from taskq._core.share import ShareSource  # here: that module builds on this one's helpers

        return ShareSource(
            self.settings,
            group=group,
            topics=topics,
            consumers=consumers,
            max_poll_records=max_poll_records,
            on_commit=on_commit,
            **overrides,
        )

    def sink(self, *, transactional_id: str | None = None, **overrides: Any) -> Sink:
        """A producer (transactional with an id)."""
        return Sink(self.settings, transactional_id=transactional_id, **overrides)

    def admin(self) -> Admin:
        """The admin client."""
        from taskq._core.kafka_admin import Admin  # here: that module builds on this one's helpers

        return Admin(self.settings)
