"""Where a failed attempt goes: back through a delay tier for another try, or to the dead-letter topic."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from hashlib import sha256

from taskq._core.broker import Record
from taskq._core.durations import pick_delay_tier
from taskq._core.envelope import MAX_HEADER_BYTES, WORKFLOW_HEADER, Envelope, H, Headers, Topics

#: Bound on the traceback a DLQ record carries (Kafka records should stay small).
MAX_TRACEBACK = 8 * 1024

#: DLQ headers, beside the original envelope.
DLQ_REASON = H + "dlq-reason"
DLQ_ERROR_TYPE = H + "dlq-error-type"
DLQ_TRACEBACK = H + "dlq-traceback"
DLQ_ATTEMPTS = H + "dlq-attempts"
DLQ_FAILED_AT = H + "dlq-failed-at"
DLQ_WORKER = H + "dlq-worker"
DLQ_TOPIC = H + "dlq-topic"
DLQ_PARTITION = H + "dlq-partition"
DLQ_OFFSET = H + "dlq-offset"
DLQ_VALUE_BYTES = H + "dlq-value-bytes"
DLQ_VALUE_SHA256 = H + "dlq-value-sha256"


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A record to publish before the consumed record's offset may be committed."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: Headers


def retry_record(
    record: Record,
    envelope: Envelope,
    delay: timedelta,
    topics: Topics,
    tiers: tuple[timedelta, ...],
    now: datetime,
) -> Outgoing:
    """The next attempt of a task: same key and value, attempt + 1, due `delay` from now, via a delay tier."""
    nxt = replace(
        envelope,
        attempt=envelope.attempt + 1,
        not_before=now + delay,
        origin_topic=envelope.origin_topic or topics.tier(envelope.priority),
    )
    # The envelope is written anew; a workflow's step stays one across its attempts.
    extra = [
        (k, v)
        for k, v in record.headers
        if (not k.startswith(H) or k == WORKFLOW_HEADER) and k != "traceparent"
    ]
    return Outgoing(
        topics.delay(pick_delay_tier(delay, tiers)), record.key, record.value, nxt.to_headers() + extra
    )


def dead_letter_record(
    record: Record,
    *,
    reason: str,
    error_type: str,
    traceback: str,
    attempts: int,
    worker_id: str,
    topics: Topics,
    now: datetime | None = None,
) -> Outgoing:
    """A DLQ record: the original value bytes untouched, the original headers, and why it failed."""
    failed_at = now or datetime.now(UTC)
    headers: Headers = [(k, v) for k, v in record.headers if not k.startswith(H + "dlq-")]
    headers += [
        (DLQ_REASON, reason.encode()[:4096]),
        (DLQ_ERROR_TYPE, error_type.encode()),
        (DLQ_TRACEBACK, traceback.encode()[-MAX_TRACEBACK:]),
        (DLQ_ATTEMPTS, str(attempts).encode()),
        (DLQ_FAILED_AT, str(int(failed_at.timestamp() * 1000)).encode()),
        (DLQ_WORKER, worker_id.encode()),
        (DLQ_TOPIC, record.topic.encode()),
        (DLQ_PARTITION, str(record.partition).encode()),
        (DLQ_OFFSET, str(record.offset).encode()),
    ]
    return Outgoing(topics.dlq, record.key, record.value, headers)


def bounded(out: Outgoing) -> Outgoing:
    """A DLQ record whose original is too large to republish whole: the value is left out (its size and
    SHA-256 digest are kept), as are headers other than the envelope's; the record stays in its topic."""
    value = out.value or b""
    headers = [(k, v[:MAX_HEADER_BYTES]) for k, v in out.headers if k.startswith(H) or k == "traceparent"]
    headers = [
        (
            k,
            (v.decode(errors="replace") + f" (too large to republish whole: {len(value)} bytes)").encode()[
                :4096
            ],
        )
        if k == DLQ_REASON
        else (k, v)
        for k, v in headers
    ]
    headers += [
        (DLQ_VALUE_BYTES, str(len(value)).encode()),
        (DLQ_VALUE_SHA256, sha256(value).hexdigest().encode()),
    ]
    return Outgoing(out.topic, out.key, None, headers)


def default_worker_id() -> str:
    """host:pid:random, unique among live workers (leases name their owner with it)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
