"""The one module that talks to Kafka (confluent-kafka / librdkafka). Everything else speaks in records."""

from __future__ import annotations

import logging
import math
import operator
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, TypeVar

from confluent_kafka import (
    OFFSET_INVALID,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec  # type: ignore[attr-defined]

from taskq._core.errors import (
    ConfigurationError,
    KafkaAuthenticationError,
    KafkaUnavailableError,
    RecordTooLargeError,
)
from taskq._core.settings import Settings, redact

log = logging.getLogger("taskq.kafka")

#: Answers after which the client's own metadata of new topics may be what is behind: it asks for more.
_STALE_METADATA = frozenset(
    {KafkaError._NOENT, KafkaError.UNKNOWN_LEADER_EPOCH, KafkaError.FENCED_LEADER_EPOCH}
)
#: Errors meaning a partition's leader or a group's coordinator is not (yet) ready where asked: retried
#: until the admin timeout.
_NOT_READY = frozenset(
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

TP = tuple[str, int]
#: Seconds a transactional call (adding offsets, commit, abort, init) may take before the transaction is given
#: up; the broker aborts an open transaction after TRANSACTION_ABORT_MS anyway.
TRANSACTION_TIMEOUT = 10.0
#: How much longer than its own timeout a transactional call is waited for before it is left behind.
_TRANSACTION_GRACE = 5.0
#: transaction.timeout.ms: the broker aborts a transaction open this long. One left open by a producer killed
#: mid-way holds back every read_committed reader of its partitions until then (unless a new producer of its
#: transactional id fences it first), so it is short; yet longer than a transaction's two bounded calls
#: (its offsets, then its commit), so the broker never aborts one its forwarder is still waiting for.
TRANSACTION_ABORT_MS = 35_000
Headers = list[tuple[str, bytes]]
#: Called once per produced record with None or an error text, from the producer's poll.
DeliveryCallback = Callable[[str | None, "Record | None"], None]
#: A batch's delivery report: (index of the record in the batch, error or None, the record if acknowledged).
BatchCallback = Callable[[int, str | None, "Record | None"], None]
#: A record to send: topic, value, key, headers.
OutRecord = tuple[str, bytes | None, bytes | None, Headers]


@dataclass(frozen=True, slots=True)
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


def _record(msg: Message) -> Record:
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


#: librdkafka's own log lines go through Python logging under this name (the CLI quiets it; a worker
#: shows warnings), instead of straight to stderr.
LIBRDKAFKA_LOG = logging.getLogger("taskq.librdkafka")

_DIGITS = re.compile(r"\d+")


class RepeatFilter(logging.Filter):
    """Collapses a flood of one kind of log line: the first is logged, then at most one every `window`
    seconds, saying how many like it were held back since the last one shown.

    A kind is the level and the line with its numbers blanked out: while a broker is away librdkafka
    reports "Connect to ... failed (after 0ms in state CONNECT)" about every 50 ms per client.
    """

    def __init__(self, window: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window = window
        self._clock = clock
        self._lock = threading.Lock()
        self._kinds: dict[tuple[int, str], tuple[float, int]] = {}  # kind -> (last shown, held back since)

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether to log this record; the one that ends a held-back run says how many it stood for."""
        text = record.getMessage()
        kind = (record.levelno, _DIGITS.sub("#", text))
        now = self._clock()
        with self._lock:
            shown, held = self._kinds.get(kind, (-math.inf, 0))
            if now - shown < self.window:
                self._kinds[kind] = (shown, held + 1)
                return False
            if len(self._kinds) >= 1000:  # bounded: forget the kinds that are quiet
                self._kinds = {k: v for k, v in self._kinds.items() if now - v[0] < self.window}
            self._kinds[kind] = (now, 0)
        if held:
            record.msg, record.args = f"{text} [repeated {held} times in the last {now - shown:.0f} s]", None
        return True


_REPEATS = RepeatFilter()

#: librdkafka's lines about a transient condition it is retrying: a group or transaction coordinator still
#: loading (a freshly started broker) while a producer acquires its idempotence or transactional PID.
_TRANSIENT = re.compile(
    r"(Failed to acquire .*PID|coordinator load in progress|coordinator not available|not coordinator)"
    r".*retrying",
    re.IGNORECASE,
)


class TransientFilter(logging.Filter):
    """Keeps librdkafka's lines about transient conditions it retries (`_TRANSIENT`) out of the log unless
    it is verbose (DEBUG, as `-v` sets): a newcomer's first commands otherwise print them as warnings."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether to log this record."""
        return LIBRDKAFKA_LOG.isEnabledFor(logging.DEBUG) or not _TRANSIENT.search(record.getMessage())


_TRANSIENTS = TransientFilter()


#: Errors that retrying cannot fix: the broker refused the credentials (SASL), or the TLS handshake failed
#: (for example the broker's certificate does not verify against ssl.ca.location).
_REFUSED = frozenset({KafkaError._AUTHENTICATION, KafkaError._SSL})


def _on_error(err: KafkaError) -> None:
    """librdkafka's error callback, run inside the client call that serves it (poll, consume, flush).

    Refused credentials raise there, so a command or a worker stops at once with one line instead of
    retrying for ever. Other errors (a broker down, a timeout) are the client's to retry, and its log
    lines already tell them.
    """
    if err.code() in _REFUSED:
        raise KafkaAuthenticationError(
            redact(f"Kafka refused the connection (check the TASKQ_KAFKA_* settings): {err.str()}")
        )
    LIBRDKAFKA_LOG.debug("error %s", err.str())


def base_config(settings: Settings, tuning: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """librdkafka settings common to every client: brokers, then a client kind's `tuning` defaults, then the
    TASKQ_KAFKA_* settings (security, and whatever tuning the user chose instead)."""
    LIBRDKAFKA_LOG.addFilter(_TRANSIENTS)  # once each: addFilter ignores a filter it has
    LIBRDKAFKA_LOG.addFilter(_REPEATS)
    return {
        "bootstrap.servers": settings.bootstrap_servers,
        "logger": LIBRDKAFKA_LOG,
        "error_cb": _on_error,
        **(tuning or {}),
        **settings.kafka,
    }


def producer_config(settings: Settings) -> dict[str, Any]:
    """librdkafka settings of every taskq producer (a transactional one adds its id)."""
    tuning = {
        "compression.type": "lz4",
        "linger.ms": 5,
        "batch.num.messages": 10000,
        "message.timeout.ms": 120000,
    }
    return base_config(settings, tuning) | {
        # Delivery guarantee: a send is acknowledged only once every in-sync replica has it, and
        # retries never duplicate or reorder (idempotent producer).
        "acks": "all",
        "enable.idempotence": True,
    }


def consumer_config(settings: Settings, *, group: str) -> dict[str, Any]:
    """librdkafka settings of every taskq consumer in `group`: manual commits, read_committed."""
    tuning: dict[str, Any] = {
        "max.poll.interval.ms": 300000,
        "queued.max.messages.kbytes": 16384,
        # A resumed partition joins the next fetch request, which waits for the one in flight: by default
        # up to 500 ms when the other partitions have nothing new. A short wait keeps the worker's buffer
        # from running dry after flow control resumes a tier.
        "fetch.wait.max.ms": 10,
    }
    if settings.group_protocol == "classic":  # with KIP-848 the session timeout is the broker's
        tuning |= {"session.timeout.ms": 15000, "heartbeat.interval.ms": 1000}
    conf = base_config(settings, tuning) | {
        "group.id": group,
        # Delivery guarantee: offsets are committed by taskq only after each task's outcome is durable.
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
    }
    # Every tier's partitions are spread over the members, topic by topic (range), so a second worker
    # takes half of a busy tier instead of the idle ones: a count-balancing assignor (sticky, uniform)
    # can leave one member every partition of the loaded tier. With KIP-848 the broker assigns and
    # rebalances are incremental (members keep what does not move); the session timeout is the
    # broker's (group.consumer.session.timeout.ms). Classic range rebalances revoke everything.
    if settings.group_protocol == "consumer":
        conf |= {"group.protocol": "consumer", "group.remote.assignor": "range"}
    else:
        conf |= {"group.protocol": "classic", "partition.assignment.strategy": "range"}
    return conf


C = TypeVar("C")
R = TypeVar("R")


def _client(factory: Callable[[dict[str, Any]], C], conf: dict[str, Any]) -> C:
    """A librdkafka client; a setting it refuses (TASKQ_KAFKA_* included) is one line naming it."""
    try:
        return factory(conf)
    except (KafkaException, ValueError, TypeError) as exc:
        err = exc.args[0] if exc.args else exc
        text = err.str() if isinstance(err, KafkaError) else str(err)
        raise ConfigurationError(redact(f"Kafka client settings: {text}")) from exc


@contextmanager
def _errors(what: str) -> Iterator[None]:
    """Turn the client's errors into the project's, keeping the original as __cause__."""
    try:
        yield
    except KafkaException as exc:
        raise _wrap(what, exc) from exc


#: Errors meaning no broker answered in time: the message says where it asked and how long it waited.
_UNREACHABLE = frozenset(
    {KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError._ALL_BROKERS_DOWN, KafkaError._RESOLVE}
)


def _wrap(
    what: str, exc: KafkaException, *, servers: str = "", timeout: float = 0.0
) -> KafkaUnavailableError:
    err = exc.args[0] if exc.args else exc
    if not isinstance(err, KafkaError):
        return KafkaUnavailableError(f"{what}: {err}")
    if servers and err.code() in _UNREACHABLE:
        return KafkaUnavailableError(
            f"{what}: no answer from the Kafka broker at {servers} within {timeout:g} s ({err.str()})"
        )
    return KafkaUnavailableError(f"{what}: {err.str()} ({err.name()})")


class Sink:
    """A Kafka producer with acks=all and idempotence; optionally transactional."""

    def __init__(self, settings: Settings, *, transactional_id: str | None = None, **overrides: Any) -> None:
        conf = producer_config(settings)
        if transactional_id:
            conf["transactional.id"] = transactional_id
            conf["transaction.timeout.ms"] = TRANSACTION_ABORT_MS
            conf["message.timeout.ms"] = TRANSACTION_ABORT_MS  # librdkafka requires it <= the above
        conf.update(overrides)
        self._p = _client(Producer, conf)
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
                    on_delivery(None, _record(msg))
                else:
                    on_delivery(self._failure(err), None)

        elif on_failure is not None:

            def cb(err: KafkaError | None, msg: Message) -> None:
                if err is not None:
                    on_failure(self._failure(err))

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
        shared: Callable[[KafkaError | None, Message], None] | None = None
        if on_delivery is not None:

            def report(i: int, err: KafkaError | None, msg: Message) -> None:
                if err is None:
                    on_delivery(i, None, _record(msg))
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
            on_failure(self._failure(err), _record(msg))

    def _refused(
        self, topic: str, value: bytes | None, key: bytes | None, headers: Headers, exc: KafkaException
    ) -> KafkaUnavailableError:
        err = exc.args[0] if exc.args else None
        if isinstance(err, KafkaError) and err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
            size = len(value or b"") + len(key or b"") + sum(len(k) + len(v) for k, v in headers)
            return RecordTooLargeError(f"producing to {topic}: a record of {size} bytes is too large")
        return _wrap(f"producing to {topic}", exc)

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
            with _errors("flushing"):  # a fenced transactional producer raises its fatal error here
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
                    raise _wrap("initialising transactions", exc) from exc
            # The call itself serves no callbacks: this poll lets refused credentials raise (_on_error).
            self._p.poll(0)

    def begin(self) -> None:
        """Begin a transaction."""
        self._usable("beginning a transaction")
        with _errors("beginning a transaction"):
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
            raise _wrap(what, exc) from exc
        if exc is not None:
            raise exc


#: The outcome of an asynchronous commit: the offsets the broker committed, and why the others were not.
Committed = Callable[[dict[TP, int], str | None], None]


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
        self._c = _client(Consumer, conf)
        self._on_assign = on_assign
        self._on_revoke = on_revoke
        self._raise_when_stuck = raise_when_stuck

    def subscribe(self, topics: Sequence[str]) -> None:
        """Join the group for these topics."""

        def assigned(c: Consumer, parts: list[TopicPartition]) -> None:
            if self._on_assign:
                self._on_assign([(p.topic, p.partition) for p in parts])

        def revoked(c: Consumer, parts: list[TopicPartition]) -> None:
            if self._on_revoke:
                self._on_revoke([(p.topic, p.partition) for p in parts])

        with _errors("subscribing"):
            self._c.subscribe(list(topics), on_assign=assigned, on_revoke=revoked, on_lost=revoked)

    def assign(self, tps: Iterable[tuple[str, int, int]]) -> None:
        """Read partitions directly (no group membership) from the given offsets."""
        with _errors("assigning partitions"):
            self._c.assign([TopicPartition(t, p, o) for t, p, o in tps])

    def poll(self, max_records: int, timeout: float) -> list[Record]:
        """Up to max_records records; partition EOFs and transient errors are logged, fatal ones raised."""
        try:
            msgs = self._c.consume(max_records, timeout)
        except KafkaException as exc:
            raise _wrap("polling", exc) from exc
        out = []
        for m in msgs:
            err = m.error()
            if err is None:
                out.append(_record(m))
            elif err.code() == KafkaError._PARTITION_EOF:
                continue
            elif err.fatal():
                raise KafkaUnavailableError(f"fatal consumer error: {err}")
            elif self._raise_when_stuck and err.code() in _NOT_READY and "committed offsets" in err.str():
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
            with _errors("pausing partitions"):
                self._c.pause(parts)

    def resume(self, tps: Iterable[TP]) -> None:
        """Fetch these partitions again, from where this consumer left them."""
        parts = [TopicPartition(t, p) for t, p in tps]
        if parts:
            with _errors("resuming partitions"):
                self._c.resume(parts)
                # With every partition paused librdkafka's fetcher sleeps for about a second, and a resume
                # does not wake it: a seek to the position does (the records come in milliseconds).
                for tp in self._c.position(parts):
                    if tp.offset >= 0:
                        self._c.seek(tp)

    def seek(self, tp: TP, offset: int) -> None:
        """Fetch a partition from this offset next."""
        with _errors(f"seeking {tp[0]}[{tp[1]}] to {offset}"):
            self._c.seek(TopicPartition(tp[0], tp[1], offset))

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
            raise _wrap("committing offsets", exc) from exc

    def committed(self, tps: Iterable[TP], timeout: float = 10.0) -> dict[TP, int]:
        """The group's committed offsets (-1 where none)."""
        with _errors("reading committed offsets"):
            parts = self._c.committed([TopicPartition(t, p) for t, p in tps], timeout=timeout)
        return {(p.topic, p.partition): (p.offset if p.offset != OFFSET_INVALID else -1) for p in parts}

    def lag(self) -> dict[TP, int]:
        """Per assigned partition: the log end offset last seen in fetches minus this member's position."""
        out: dict[TP, int] = {}
        with _errors("measuring lag"):
            parts = self._c.assignment()
            for p in self._c.position(parts) if parts else []:
                _, high = self._c.get_watermark_offsets(p, cached=True)
                if high >= 0 and p.offset >= 0:
                    out[(p.topic, p.partition)] = max(0, high - p.offset)
        return out

    def high_watermarks(self, tps: Iterable[TP]) -> dict[TP, int]:
        """The end offset of each of `tps` as last seen by this consumer, without a request (-1: unknown)."""
        with _errors("reading watermarks"):
            return {
                tp: max(-1, self._c.get_watermark_offsets(TopicPartition(tp[0], tp[1]), cached=True)[1])
                for tp in tps
            }

    def position(self, tp: TP) -> int:
        """The offset this consumer reads next in `tp` (past transaction markers), or -1 if unknown."""
        with _errors("reading the position"):
            (p,) = self._c.position([TopicPartition(tp[0], tp[1])])
        return int(p.offset) if p.offset >= 0 else -1

    def group_metadata(self) -> object:
        """This member's group metadata, which a transaction's offsets carry (fences zombie members)."""
        with _errors("reading the group metadata"):
            return self._c.consumer_group_metadata()

    def assignment(self) -> list[TP]:
        """The partitions this member owns."""
        return [(p.topic, p.partition) for p in self._c.assignment()]

    def member_id(self) -> str:
        """This consumer's group member id (empty before it joined)."""
        return str(self._c.memberid() or "")

    def close(self) -> None:
        """Leave the group and release the client."""
        with _errors("closing the consumer"):
            self._c.close()


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """A topic to provision."""

    name: str
    partitions: int
    replication: int | None = None  # None: the broker's default.replication.factor
    config: Mapping[str, str] | None = None


class Admin:
    """Topic provisioning and offset look-ups."""

    def __init__(self, settings: Settings, *, timeout: float | None = None) -> None:
        self._a = _client(AdminClient, base_config(settings))
        self._timeout = settings.kafka_timeout if timeout is None else timeout
        self._servers = redact(settings.bootstrap_servers)
        self._settings = settings
        self._readers: dict[str, Consumer] = {}  # group -> a consumer that reads its offsets

    def _wrap(self, what: str, exc: KafkaException) -> KafkaUnavailableError:
        return _wrap(what, exc, servers=self._servers, timeout=self._timeout)

    def create_topics(self, specs: Sequence[TopicSpec]) -> dict[str, bool]:
        """Create topics that do not exist; returns name -> created (False: it existed already)."""
        if not specs:
            return {}
        futures = self._a.create_topics(
            [
                NewTopic(
                    s.name,
                    num_partitions=s.partitions,
                    replication_factor=-1 if s.replication is None else s.replication,
                    config=dict(s.config or {}),
                )
                for s in specs
            ],
            operation_timeout=self._timeout,
            request_timeout=self._timeout,
        )
        created: dict[str, bool] = {}
        for name, fut in futures.items():
            try:
                fut.result()
                created[name] = True
            except KafkaException as exc:
                err = exc.args[0]
                if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    created[name] = False
                else:
                    raise self._wrap(f"creating topic {name}", exc) from exc
        # Delivery guarantee: the broker answers CreateTopics before it has created each partition's log
        # (seconds later for dozens of partitions on a busy broker). A record produced in between is refused
        # (NOT_LEADER_FOR_PARTITION), and librdkafka's idempotent producer (2.16) then reported it delivered
        # once a later batch of that partition succeeded ("implicitly acked"): acknowledged, never in the
        # log. Topics are handed out only once every partition has its leader, which ListOffsets tells.
        # A topic that existed already is waited for with the partitions it has (another process may have
        # created it a moment ago, with other counts).
        counts = {s.name: s.partitions for s in specs if created[s.name]}
        counts.update(self.partitions([name for name, new in created.items() if not new]))
        req = {TopicPartition(t, p): OffsetSpec.latest() for t, n in counts.items() for p in range(n)}  # type: ignore[no-untyped-call]

        def leaders(left: float) -> None:
            try:
                for future in self._a.list_offsets(req, request_timeout=left).values():
                    future.result()
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if isinstance(err, KafkaError) and err.code() in _STALE_METADATA:
                    # The client's metadata has no leader for them yet, and it may keep that answer: a
                    # metadata request of its own brings the leaders the broker knows by now.
                    self._a.list_topics(timeout=max(0.1, min(left, 5.0)))
                raise

        # Right after CreateTopics no partition may have a leader in the client's metadata yet: the whole
        # request then fails with "No leaders found", a state to wait out like the others.
        self._answered(
            "waiting for the partitions of new topics", leaders, not_ready=_NOT_READY | {KafkaError._NOENT}
        )
        return created

    def delete_topics(self, names: Sequence[str]) -> None:
        """Delete topics (missing ones are ignored)."""
        if not names:
            return
        futures = self._a.delete_topics(
            list(names), operation_timeout=self._timeout, request_timeout=self._timeout
        )
        for name, fut in futures.items():
            try:
                fut.result()
            except KafkaException as exc:
                err = exc.args[0]
                if not (isinstance(err, KafkaError) and err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART):
                    raise self._wrap(f"deleting topic {name}", exc) from exc

    def delete_groups(self, groups: Sequence[str]) -> None:
        """Delete consumer groups that have no members left (missing ones are ignored)."""
        if not groups:
            return
        futures = self._a.delete_consumer_groups(list(groups), request_timeout=self._timeout)
        for group, fut in futures.items():
            try:
                fut.result()
            except KafkaException as exc:
                err = exc.args[0]
                if not (isinstance(err, KafkaError) and err.code() == KafkaError.GROUP_ID_NOT_FOUND):
                    raise self._wrap(f"deleting group {group}", exc) from exc

    def partitions(self, topics: Sequence[str]) -> dict[str, int]:
        """Partition counts of existing topics (missing topics are left out)."""
        try:
            md = self._a.list_topics(timeout=self._timeout)
        except KafkaException as exc:
            raise self._wrap("listing topics", exc) from exc
        return {
            t: len(md.topics[t].partitions) for t in topics if t in md.topics and md.topics[t].error is None
        }

    def end_offsets(self, topics: Sequence[str]) -> dict[TP, int]:
        """The log end offset (high watermark) of every partition of these topics."""
        return self._list_offsets(topics, OffsetSpec.latest())  # type: ignore[no-untyped-call]

    def start_offsets(self, topics: Sequence[str]) -> dict[TP, int]:
        """The earliest offset still in the log of every partition."""
        return self._list_offsets(topics, OffsetSpec.earliest())  # type: ignore[no-untyped-call]

    def _list_offsets(self, topics: Sequence[str], spec: OffsetSpec) -> dict[TP, int]:
        counts = self.partitions(topics)
        req = {TopicPartition(t, p): spec for t, n in counts.items() for p in range(n)}
        if not req:
            return {}

        def list_offsets(left: float) -> dict[TP, int]:
            futures = self._a.list_offsets(req, request_timeout=left)
            return {(tp.topic, tp.partition): f.result().offset for tp, f in futures.items()}

        return self._answered("listing offsets", list_offsets)

    def committed(self, group: str, topics: Sequence[str]) -> dict[TP, int]:
        """A group's committed offsets on these topics (-1 where it committed nothing)."""
        counts = self.partitions(topics)
        parts = [TopicPartition(t, p) for t, n in counts.items() for p in range(n)]
        if not parts:
            return {}
        # Read by a consumer of the group (which does not join it), not by list_consumer_group_offsets:
        # librdkafka (2.13 to 2.16 at least) kills the process with SIGSEGV when that admin request meets a
        # coordinator still loading, as on a broker's first seconds: its OffsetFetch error path calls into
        # a consumer group the admin client does not have (rd_kafka_handle_OffsetFetch -> rd_kafka_cgrp_op).
        reader = self._readers.get(group)
        if reader is None:
            conf = base_config(self._settings) | {"group.id": group, "enable.auto.commit": False}
            reader = self._readers[group] = _client(Consumer, conf)
        found = self._answered(
            f"reading offsets of group {group}", lambda left: reader.committed(parts, timeout=left)
        )
        return {(p.topic, p.partition): (p.offset if p.offset >= 0 else -1) for p in found}

    def _answered(
        self, what: str, call: Callable[[float], R], *, not_ready: frozenset[int] = _NOT_READY
    ) -> R:
        """`call(seconds left)`, again while the broker answers that it is not ready yet (a leader or a
        group coordinator being elected or loading, as right after a topic or the broker starts), until
        the admin timeout; that is a state to wait out, not a failure to report."""
        deadline = time.monotonic() + self._timeout
        backoff = 0.05
        while True:
            try:
                return call(max(0.1, deadline - time.monotonic()))
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                transient = isinstance(err, KafkaError) and (err.retriable() or err.code() in not_ready)
                if not transient or time.monotonic() + backoff > deadline:
                    raise self._wrap(what, exc) from exc
            time.sleep(backoff)
            backoff = min(1.0, backoff * 2)


# ------------------------------------------------------------------------------------------------ the seam
# What the rest of the code needs of Kafka. `KafkaBroker` gives the real clients above; `taskq.testing`
# gives in-memory ones with the same semantics (partitions, offsets, commits, pause, transactions).


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

    def sink(self, *, transactional_id: str | None = None, **overrides: Any) -> Sink:
        """A producer (transactional with an id)."""
        return Sink(self.settings, transactional_id=transactional_id, **overrides)

    def admin(self) -> Admin:
        """The admin client."""
        return Admin(self.settings)
