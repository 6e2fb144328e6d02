"""The delay forwarder: releases tasks from the delay tiers to their priority topics when they are due.

Each delay-tier partition is held at its head task until that task is due (pause, seek back, resume at the
due time) while other partitions keep flowing. A head never holds back a task due before it: when one behind
it is due sooner, the head moves to the end of the tier that fits its remaining delay, and a held partition
is looked at again every PEEK seconds for such tasks. Forwarding is a Kafka transaction that carries both the
forwarded records and the consumed offsets, so a forwarder crash neither loses nor doubles a task.

A transaction that fails or overstays its timeout (a broker restarting, a coordinator moving) is aborted, or,
when even that fails, its producer is replaced by a new one of the same transactional id, which fences the
old one and ends its transaction. Then the batch's partitions are read again from the group's committed
offsets, the truth whichever way the transaction ended, and forwarding goes on in the same group membership.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

from taskq._core.broker import TP, TRANSACTION_TIMEOUT, Broker, Record, RecordSink, RecordSource
from taskq._core.durations import pick_delay_tier
from taskq._core.envelope import Envelope, EnvelopeError, Topics
from taskq._core.errors import KafkaAuthenticationError, RecordTooLargeError, TaskqError
from taskq._core.kafka_clients import KafkaBroker
from taskq._core.settings import Settings
from taskq.consumer.routing import Outgoing, bounded, dead_letter_record, default_worker_id

log = logging.getLogger("taskq.forwarder")

#: A held partition is read again this often (seconds) for tasks behind its head that are due sooner.
PEEK = 1.0


class Forwarder:
    """Consumes the delay-tier topics in its own group and forwards due tasks, transactionally."""

    def __init__(
        self,
        settings: Settings,
        *,
        instance_id: str | None = None,
        broker: Broker | None = None,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
        clock: Callable[[], float] = time.time,
        transaction_timeout: float = TRANSACTION_TIMEOUT,
        predecessors: Iterable[str] = (),
    ) -> None:
        """`transaction_timeout`: seconds each transactional call may take before the transaction is given
        up (aborted, or its producer replaced) and the batch read again. `predecessors`: instance ids of
        forwarders known dead (a killed worker of this host), whose open transactions the first start ends."""
        self.settings = settings
        self.broker: Broker = broker or KafkaBroker(settings)
        self.topics = Topics(settings.namespace, settings.delay_tiers)
        self._tier_seconds = {self.topics.delay(t): t.total_seconds() for t in settings.delay_tiers}
        self.group = f"{settings.namespace}.forwarder"
        self.instance_id = instance_id or default_worker_id()
        self._on_event = on_event
        self._clock = clock
        self._transaction_timeout = transaction_timeout
        self._stop = threading.Event()
        self._held: dict[TP, float] = {}  # partition -> epoch seconds it is read again (head due, or a peek)
        self._due: dict[TP, float] = {}  # partition -> epoch seconds its held head is due (or hops)
        # Assigned since the last resume. librdkafka keeps a partition's pause across revoke and re-assign
        # while a revoke forgets its hold, so a partition held before a rebalance comes back paused.
        self._fresh: set[TP] = set()
        self._clients: tuple[RecordSink, RecordSource] | None = None
        self._predecessors = sorted(predecessors)

    def stop(self) -> None:
        """Finish the current transaction and stop."""
        self._stop.set()

    def run(self) -> None:
        """Forward until stop(); a failed transaction restarts from the last committed offsets.

        Raises KafkaAuthenticationError when the broker refuses the settings: starting over cannot help.
        """
        while not self._stop.is_set():
            try:
                self.start()
                while not self._stop.is_set():
                    self.step()
            except KafkaAuthenticationError:
                raise
            # Whatever failed, the committed offsets are the truth: start over from them.
            except TaskqError as exc:  # the broker away or refusing: one line, no traceback
                log.warning("forwarder restarting: %s", exc)
                self._stop.wait(1.0)
            except Exception:
                log.exception("forwarder restarting")
                self._stop.wait(1.0)
            finally:
                self.close()

    def start(self) -> None:
        """Open the transactional producer and join the group (`run` does it; tests may step by hand)."""
        self._fence_predecessors()
        sink = self._new_sink()
        self._held.clear()
        self._due.clear()
        self._fresh.clear()
        # A consumer left with partitions it will never fetch (a broker restart can do that) raises from its
        # poll, and `run` starts over with a new one: delayed tasks never stall behind it.
        source = self.broker.source(
            group=self.group, on_revoke=self._revoked, on_assign=self._fresh.update, raise_when_stuck=True
        )
        self._clients = (sink, source)
        source.subscribe(self.topics.delay_topics)

    def step(self, wait: float = 0.2) -> int:
        """Release what is due and forward one batch; returns how many records it forwarded."""
        assert self._clients is not None, "start() first"
        sink, source = self._clients
        self._resume_due(source)
        if self._held:
            wait = max(0.0, min(wait, min(self._held.values()) - self._clock()))
        records = source.poll(500, wait)
        return self._forward(sink, source, records) if records else 0

    def next_due(self) -> float | None:
        """When the earliest held task is due (the clock's time), or None when nothing is held."""
        return min(self._due.values(), default=None)

    def close(self) -> None:
        """Leave the group and release the producer."""
        if self._clients is not None:
            sink, source = self._clients
            self._clients = None
            # Never raises: `run` calls it on its way to starting over, and the thread must live on.
            for release in (source.close, lambda: sink.flush(10)):
                try:
                    release()
                except TaskqError as exc:  # a fenced or given-up producer: its transaction ends elsewhere
                    log.warning("forwarder closing: %s", exc)
                except Exception:  # whatever a client raises here, forwarding must start over
                    log.exception("forwarder closing")

    def _fence_predecessors(self) -> None:
        """End the transactions a killed predecessor left open: at once, not after transaction.timeout.ms.

        A transaction open on a tier topic holds back every read_committed reader of its partitions (the
        workers), and one open on the group's offsets holds back the forwarder's own start. Registering the
        dead instance's transactional id fences it, and the broker aborts what it had open.
        """
        while self._predecessors:
            dead = self._predecessors[0]
            try:
                self.broker.sink(transactional_id=self._transactional_id(dead)).init_transactions(
                    self._transaction_timeout
                )
            except KafkaAuthenticationError:
                raise
            except TaskqError as exc:  # the broker aborts it after transaction.timeout.ms anyway
                log.warning("could not end the transaction of dead forwarder %s: %s", dead, exc)
            self._predecessors.pop(0)

    def _transactional_id(self, instance_id: str) -> str:
        return f"{self.group}.{instance_id}"

    def _new_sink(self) -> RecordSink:
        # A transactional id per instance; the group metadata sent with the offsets fences zombie instances.
        sink = self.broker.sink(transactional_id=self._transactional_id(self.instance_id))
        sink.init_transactions(self._transaction_timeout)
        return sink

    def _revoked(self, tps: list[TP]) -> None:
        for tp in tps:
            self._held.pop(tp, None)
            self._due.pop(tp, None)

    def _resume_due(self, source: RecordSource) -> None:
        now = self._clock()
        due = [tp for tp, at in self._held.items() if at <= now]
        for tp in due:
            del self._held[tp]
            self._due.pop(tp, None)
        fresh = [tp for tp in self._fresh if tp not in self._held]
        self._fresh.clear()
        source.resume(due + fresh)

    def _dead_letter(self, record: Record, reason: str) -> Outgoing:
        return dead_letter_record(
            record,
            reason=reason,
            error_type="taskq.EnvelopeError",
            traceback="",
            attempts=0,
            worker_id=self.instance_id,
            topics=self.topics,
        )

    def _forward(self, sink: RecordSink, source: RecordSource, records: list[Record]) -> int:
        now = self._clock()
        offsets: dict[TP, int] = {}
        out: list[tuple[str, Record, list[tuple[str, bytes]]]] = []
        # The earliest due time among each record's successors in its partition, in this batch.
        sooner_behind: dict[int, float] = {}
        earliest: dict[TP, float] = {}
        for i in range(len(records) - 1, -1, -1):
            record = records[i]
            sooner_behind[i] = earliest.get(record.tp, float("inf"))
            earliest[record.tp] = min(earliest.get(record.tp, float("inf")), _due_of(record))
        for i, record in enumerate(records):
            if record.tp in self._held:
                continue  # fetched behind a held head: it is read again after the resume
            try:
                env = Envelope.of(record)
            except EnvelopeError as exc:
                dl = self._dead_letter(record, f"bad envelope on a delay topic: {exc}")
                out.append((dl.topic, record, dl.headers))
                offsets[record.tp] = record.offset + 1
                continue
            due = env.not_before.timestamp() if env.not_before else 0.0
            if due > now:
                # A head holds its partition at most one tier's length from when it arrived, and never
                # while a task behind it is due sooner: then it hops to the end of the tier that fits what
                # is left, so no task waits behind one due later than itself, whatever the delay.
                hop_at = record.timestamp_ms / 1000 + self._tier_seconds.get(record.topic, 0.0)
                if hop_at <= now or sooner_behind[i] < due:
                    rest = timedelta(seconds=due - now)
                    hop = self.topics.delay(pick_delay_tier(rest, self.settings.delay_tiers))
                    out.append((hop, record, record.headers))
                    offsets[record.tp] = record.offset + 1
                    continue
                source.pause([record.tp])
                source.seek(record.tp, record.offset)
                self._held[record.tp] = min(due, hop_at, now + PEEK)
                self._due[record.tp] = min(due, hop_at)
                continue
            target = env.origin_topic or self.topics.tier(env.priority)
            if target not in self.topics.priority_topics:
                # Forward only to this namespace's tiers: a missing topic would abort every transaction,
                # another namespace's tier would get a record that is not its own.
                dl = self._dead_letter(record, f"origin topic {target!r} is not a tier of this namespace")
                out.append((dl.topic, record, dl.headers))
            else:
                out.append((target, record, record.headers))
            offsets[record.tp] = record.offset + 1
        if not offsets:
            return 0
        timeout = self._transaction_timeout
        # Delivery guarantee: the forwarded records and the consumed offsets commit atomically.
        try:
            sink.begin()
            for topic, record, headers in out:
                try:
                    sink.send(topic, record.value, key=record.key, headers=headers)
                except RecordTooLargeError as exc:
                    # Accepted by the broker at a size this producer refuses: a bounded DLQ record instead.
                    dl = bounded(self._dead_letter(record, f"too large to forward: {exc}"))
                    sink.send(dl.topic, dl.value, key=dl.key, headers=dl.headers)
            sink.commit_offsets_in_transaction(source, offsets, timeout)
            sink.commit(timeout)
        except KafkaAuthenticationError:
            raise
        except TaskqError as exc:
            first: dict[TP, int] = {}
            for record in records:
                first.setdefault(record.tp, record.offset)
            self._recover(sink, source, {tp: first[tp] for tp in offsets}, exc)
            self._stop.wait(1.0)  # a backoff: what failed may fail again at once (a broker still away)
            return 0
        if self._on_event is not None:
            self._on_event("forwarded", {"count": len(out), "offsets": offsets})
        return len(out)

    def _recover(self, sink: RecordSink, source: RecordSource, first: dict[TP, int], exc: Exception) -> None:
        """End a failed transaction and read its partitions again from the committed offsets.

        `first` holds each partition's first offset in the failed batch, where it is read again when the
        group has committed nothing there. Raises when the partitions cannot be rewound (`run` starts over).
        """
        if self._on_event is not None:
            self._on_event("transaction_failed", {"error": str(exc), "partitions": dict(first)})
        how = "aborted"
        try:
            sink.abort(self._transaction_timeout)
        except KafkaAuthenticationError:
            raise
        except TaskqError as abort_exc:
            # Fatal, fenced, or stuck: a new producer of the same id fences this one and ends its transaction
            # (a commit it had asked for completes; anything else is aborted) before the offsets are read.
            how = f"producer replaced (abort failed: {abort_exc})"
            assert self._clients is not None
            self._clients = (self._new_sink(), source)
        # Delivery guarantee: read again from what the group committed, which is final once the transaction
        # has ended either way (read_committed readers wait for a pending transaction's offsets), so a
        # transaction that did commit is not forwarded twice and one that did not is not lost.
        committed = source.committed(list(first), self._transaction_timeout)
        # A partition held after its forwarded records is let go first: a resume seeks to the position.
        held = [tp for tp in first if self._held.pop(tp, None) is not None]
        for tp in held:
            self._due.pop(tp, None)
        source.resume(held)
        for tp, offset in first.items():
            at = committed.get(tp, -1)
            source.seek(tp, at if at >= 0 else offset)
        log.warning(
            "forwarding transaction failed (%s); %s, %d partition(s) read again from their committed offsets",
            exc,
            how,
            len(first),
        )


def _due_of(record: Record) -> float:
    """When a delayed record is due (epoch seconds); 0 when it is due now or its envelope is unreadable."""
    try:
        env = Envelope.from_headers(record.headers)
    except EnvelopeError:
        return 0.0
    return env.not_before.timestamp() if env.not_before else 0.0
