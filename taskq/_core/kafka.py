"""What every Kafka client of taskq is configured with: librdkafka's settings, and where its log lines and
errors go. The clients are in `kafka_clients` and `kafka_admin`, the records and protocols the rest of the
code sees in `broker`; their names stay importable from here."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaError

from taskq._core.errors import KafkaAuthenticationError
from taskq._core.lazy import lazy_exports
from taskq._core.logs import RepeatFilter
from taskq._core.settings import Settings, redact

#: The names that moved to modules of their own -> that module; importing them from here still works.
_MOVED = {
    "TP": "taskq._core.broker",
    "TRANSACTION_TIMEOUT": "taskq._core.broker",
    "BatchCallback": "taskq._core.broker",
    "Broker": "taskq._core.broker",
    "Acknowledged": "taskq._core.broker",
    "Committed": "taskq._core.broker",
    "DeliveryCallback": "taskq._core.broker",
    "OutRecord": "taskq._core.broker",
    "Record": "taskq._core.broker",
    "RecordSink": "taskq._core.broker",
    "RecordSource": "taskq._core.broker",
    "ShareRecordSource": "taskq._core.broker",
    "TopicAdmin": "taskq._core.broker",
    "TopicSpec": "taskq._core.broker",
    "Headers": "taskq._core.envelope",
    "Admin": "taskq._core.kafka_admin",
    "TRANSACTION_ABORT_MS": "taskq._core.kafka_clients",
    "KafkaBroker": "taskq._core.kafka_clients",
    "Sink": "taskq._core.kafka_clients",
    "ShareSource": "taskq._core.share",
    "Source": "taskq._core.kafka_clients",
}

__all__ = [
    "LIBRDKAFKA_LOG",
    "SHARE_REFUSED",
    "TP",
    "TRANSACTION_ABORT_MS",
    "TRANSACTION_TIMEOUT",
    "Acknowledged",
    "Admin",
    "BatchCallback",
    "Broker",
    "Committed",
    "DeliveryCallback",
    "Headers",
    "KafkaBroker",
    "OutRecord",
    "Record",
    "RecordSink",
    "RecordSource",
    "RepeatFilter",
    "ShareRecordSource",
    "ShareSource",
    "Sink",
    "Source",
    "TopicAdmin",
    "TopicSpec",
    "TransientFilter",
    "base_config",
    "consumer_config",
    "producer_config",
    "share_consumer_config",
]

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ imports on demand (no import cycle)
    from taskq._core.broker import (
        TP,
        TRANSACTION_TIMEOUT,
        Acknowledged,
        BatchCallback,
        Broker,
        Committed,
        DeliveryCallback,
        OutRecord,
        Record,
        RecordSink,
        RecordSource,
        ShareRecordSource,
        TopicAdmin,
        TopicSpec,
    )
    from taskq._core.envelope import Headers
    from taskq._core.kafka_admin import Admin
    from taskq._core.kafka_clients import TRANSACTION_ABORT_MS, KafkaBroker, Sink, Source
    from taskq._core.share import ShareSource


#: librdkafka's own log lines go through Python logging under this name (the CLI quiets it; a worker
#: shows warnings), instead of straight to stderr.
LIBRDKAFKA_LOG = logging.getLogger("taskq.librdkafka")

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
        # librdkafka (2.10 on) drops the bootstrap broker once the first metadata names the cluster's
        # brokers, and connects to a learned one only when its cluster connections are no longer
        # suppressed: half this back-off (at least 11 ms) after the last. At the default 100 ms a new
        # consumer found its group's coordinator 50 ms late in one start of two (57 ms against 6 to its
        # assignment; now 6-22), and an app's first enqueue was acknowledged 55 ms after its producer was
        # made (now 15). A broker that keeps refusing is still tried less and less often, up to
        # reconnect.backoff.max.ms.
        "reconnect.backoff.ms": 20,
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
        # Flow control pauses a tier whose share is buffered, and a pause drops every record librdkafka
        # fetched ahead for its partitions; the resume fetches them again. By default librdkafka fetches
        # ahead up to 100,000 records a partition (queued.min.messages), 1 MB at a time, and waits a second
        # once it has: a worker on a backlog of 100,000 no-op tasks fetched each record several times, and
        # spent half its CPU on it. So it fetches ahead about a buffer's worth (the count is the consumer's,
        # over its partitions), 64 KB a partition at a time, and tops that up within milliseconds.
        "queued.min.messages": 500,
        "max.partition.fetch.bytes": 65536,
        "fetch.queue.backoff.ms": 5,
        # A fetch is answered once it holds 4 KB (some sixteen tasks' records) or has waited 5 ms. At a
        # steady rate the broker so gathers what would otherwise come a record or two a fetch, each waking
        # librdkafka's threads, the loop and a claim's round trip: at 1,400 tasks/s the worker's CPU a task
        # fell by a third, for 1-2 ms of enqueue->start (3 ms at 100 tasks/s). A backlog fills every fetch at
        # once. The wait is short for flow control too: a resumed partition joins the next fetch request,
        # which waits for the one in flight (by default up to 500 ms when the others have nothing new), and
        # the worker's buffer must not run dry meanwhile.
        "fetch.min.bytes": 4096,
        "fetch.wait.max.ms": 5,
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


#: Consumer properties librdkafka's share consumer refuses at creation (2.16: "`x` is not applicable for
#: share consumer"), dropped when a TASKQ_KAFKA_* setting meant for the group consumers carries them. A share
#: group keeps their counterparts on the broker, as group configs (`Admin.configure_share_group`):
#: auto.offset.reset -> share.auto.offset.reset, isolation.level -> share.isolation.level, and
#: session.timeout.ms, heartbeat.interval.ms -> share.session.timeout.ms, share.heartbeat.interval.ms. The
#: broker assigns (group.protocol, group.remote.assignor, partition.assignment.strategy have no meaning);
#: acknowledgements replace offsets (enable.auto.commit); and the per-partition fetch queue they tune is not
#: the share consumer's (queued.*, fetch.queue.backoff.ms, fetch.error.backoff.ms, enable.partition.eof).
#: group.instance.id and allow.auto.create.topics are not supported yet.
SHARE_REFUSED = frozenset(
    {
        "enable.auto.commit",
        "auto.offset.reset",
        "isolation.level",
        "group.protocol",
        "group.remote.assignor",
        "partition.assignment.strategy",
        "session.timeout.ms",
        "heartbeat.interval.ms",
        "queued.max.messages.kbytes",
        "queued.min.messages",
        "fetch.queue.backoff.ms",
        "fetch.error.backoff.ms",
        "enable.partition.eof",
        "group.instance.id",
        "allow.auto.create.topics",
    }
)


def share_consumer_config(settings: Settings, *, group: str, max_poll_records: int) -> dict[str, Any]:
    """librdkafka settings of a share consumer in `group`: explicit acknowledgements, and
    `max_poll_records` a poll (the broker rounds it up to whole record batches)."""
    # max.poll.interval.ms: a consumer still holding records of its last poll cannot poll (explicit mode),
    # and one that has not polled this long leaves the group. 300 s outlasts the longest record lock a
    # broker allows (group.share.max.record.lock.duration.ms, 60 s by default).
    conf = base_config(settings, {"max.poll.interval.ms": 300000})
    return {k: v for k, v in conf.items() if k not in SHARE_REFUSED} | {
        "group.id": group,
        # Delivery guarantee: a record is acknowledged by taskq only once its outcome is durable; nothing is
        # accepted on the client's own initiative (the implicit mode accepts a poll's records on the next).
        "share.acknowledgement.mode": "explicit",
        "max.poll.records": max_poll_records,
    }


__getattr__, __dir__ = lazy_exports(__name__, _MOVED)
