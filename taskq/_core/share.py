"""A share group's member (KIP-932): `ShareSource`, the share-group counterpart of `Source`, over
librdkafka's preview ShareConsumer. What the client was seen to do (confluent-kafka 2.16.1, librdkafka
2.16.0, Kafka 4.3.1) is written where the code depends on it; tests/acceptance/test_share_groups.py
shows it."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from confluent_kafka import AcknowledgeType, KafkaError, KafkaException, ShareConsumer, TopicPartition

from taskq._core.broker import Acknowledged, Record
from taskq._core.errors import ConfigurationError
from taskq._core.kafka import share_consumer_config
from taskq._core.kafka_clients import client_errors, new_client, record_of, unavailable
from taskq._core.settings import Settings

log = logging.getLogger("taskq.kafka")

#: How long one consumer of a ShareSource waits for records before the next free one has its turn.
_SHARE_SLICE = 0.05


class _Member:
    """One ShareConsumer of a ShareSource, and how much of its last poll it still holds."""

    __slots__ = ("consumer", "held", "pending", "unsent")

    def __init__(self, consumer: ShareConsumer) -> None:
        self.consumer = consumer
        self.held = 0  # records of its last poll not acknowledged yet: it may poll again at 0
        self.unsent = False  # it has acknowledgements not yet sent to the broker
        # Its last poll returned nothing: the fetch that poll started may still acquire records, which wait
        # in the client's queue, locked from the other members, until its next poll (seen with
        # confluent-kafka 2.16.1: a consumer's poll(0) returned nothing, and its next one, seconds later,
        # a record no other member had been handed meanwhile).
        self.pending = False


class ShareSource:
    """A member of a share group (KIP-932) made of several ShareConsumers, so that records held by a slow
    task keep only their own consumer from fetching.

    In explicit acknowledgement mode a ShareConsumer must acknowledge every record of a poll before it may
    poll again; so each record remembers the consumer that acquired it, and only consumers holding nothing
    poll. The client rounds `max_poll_records` up to whole record batches (a producer's batch is acquired
    whole), so a poll can bring more than was asked: the rest stays here, acquired, and is handed out first.

    Not thread-safe (neither is a ShareConsumer): one thread polls and acknowledges.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        group: str,
        topics: Sequence[str],
        consumers: int = 2,
        max_poll_records: int = 1,
        on_commit: Acknowledged | None = None,
        **overrides: Any,
    ) -> None:
        """`consumers` ShareConsumers in `group`, each subscribed to `topics` and acquiring about
        `max_poll_records` records a poll (librdkafka reads it once, at creation); `on_commit` hears of
        every acknowledgement commit from poll, commit and close."""
        if consumers < 1 or max_poll_records < 1:
            raise ConfigurationError(
                f"a share source needs consumers >= 1 and max_poll_records >= 1, "
                f"got {consumers} and {max_poll_records}"
            )
        conf = share_consumer_config(settings, group=group, max_poll_records=max_poll_records) | overrides
        self._on_commit = on_commit
        self._timeout = settings.kafka_timeout
        self._members: list[_Member] = []
        self._owner: dict[tuple[str, int, int], _Member] = {}  # handed out, not acknowledged -> its consumer
        # Acquired and not handed out yet, oldest first, with when each was acquired.
        self._waiting: deque[tuple[Record, _Member, float]] = deque()
        self._drained_at = 0.0  # when pending consumers were last drained by `shed`
        self._turn = 0
        self._closed = False
        try:
            for _ in range(consumers):
                member = _Member(new_client(ShareConsumer, dict(conf)))
                self._members.append(member)
                with client_errors("subscribing to the share group"):
                    member.consumer.set_acknowledgement_commit_callback(self._committed)
                    member.consumer.subscribe(list(topics))
        except BaseException:
            for member in self._members:
                member.consumer.close()
            raise

    def _committed(self, offsets: dict[TopicPartition, set[int]], exc: KafkaException | None) -> None:
        done = {(tp.topic, tp.partition): set(acked) for tp, acked in offsets.items()}
        error = None
        if exc is not None:
            err = exc.args[0] if exc.args else exc
            error = f"{err.str()} ({err.name()})" if isinstance(err, KafkaError) else str(err)
        if self._on_commit is not None:
            self._on_commit(done, error)
        elif error is not None:
            log.warning("the share group refused acknowledgements of %s: %s", sorted(done), error)

    def poll(self, max_records: int, timeout: float) -> list[Record]:
        """Up to max_records records, those acquired earlier first; waits up to `timeout` when none come.
        Sends the acknowledgements made since the last call first. With every consumer holding records it
        waits out `timeout` and returns none: nothing can be fetched until some are acknowledged."""
        self.send_acknowledgements()
        out = self._hand_out(max_records)
        deadline = time.monotonic() + timeout
        while len(out) < max_records and not self._waiting:
            free = [m for m in self._members if not m.held]
            left = deadline - time.monotonic()
            if not free:
                if not out and left > 0:
                    time.sleep(left)
                break
            # The consumers whose last poll came back empty may have records by now (their fetch went on):
            # they are asked first, without waiting, and one more starts a fetch. Then, if none had any, one
            # waits for a slice, in turn. Free consumers are not all polled at once: each empty poll starts a
            # fetch whose records wait, acquired, in that consumer's queue until it is polled again (all of
            # them polled every pass took records from the other members and counted deliveries on them).
            fetching = False
            for member in free:
                if len(self._waiting) >= max_records - len(out):
                    break
                if member.pending or not fetching:
                    fetching = fetching or not member.pending
                    self._fetch(member, 0.0)
            if not self._waiting and left > 0:
                self._turn += 1
                self._fetch(free[self._turn % len(free)], min(left, _SHARE_SLICE))
            out += self._hand_out(max_records - len(out))
            if out or time.monotonic() >= deadline:
                break
        return out

    def _hand_out(self, n: int) -> list[Record]:
        out = []
        for _ in range(min(n, len(self._waiting))):
            record, member, _ = self._waiting.popleft()
            key = (record.topic, record.partition, record.offset)
            earlier = self._owner.get(key)
            if earlier is not None:
                # Handed out again while an earlier delivery is still held here: that one's lock expired,
                # and the broker refuses any acknowledgement of it. Its consumer lets it go (or could never
                # poll again); the new delivery is the one acknowledged from now on.
                self._let_go(earlier, key)
            self._owner[key] = member
            out.append(record)
        return out

    def _let_go(self, member: _Member, key: tuple[str, int, int]) -> None:
        with client_errors(f"releasing {key[0]}[{key[1]}]@{key[2]}"):
            member.consumer.acknowledge_offset(*key, AcknowledgeType.RELEASE)
        member.held -= 1
        member.unsent = True

    def _fetch(self, member: _Member, timeout: float) -> None:
        try:
            msgs = member.consumer.poll(timeout)
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if isinstance(err, KafkaError) and err.code() == KafkaError._MAX_POLL_EXCEEDED:
                # It held records past max.poll.interval.ms and left the group; its acknowledgements
                # still count (seen on Kafka 4.3), and this poll rejoins it.
                log.warning("a share consumer rejoins its group: %s", err.str())
                return
            raise unavailable("polling the share group", exc) from exc
        member.pending = not msgs
        for msg in msgs:
            err = msg.error()
            if err is not None:
                # librdkafka acknowledged it itself (RELEASE on a decompression failure, REJECT on a corrupt
                # batch): it is not held.
                where = f"{msg.topic()}[{msg.partition()}]@{msg.offset()}"
                log.warning("share consumer error at %s: %s", where, err)
                continue
            member.held += 1
            self._waiting.append((record_of(msg, msg.delivery_count()), member, time.monotonic()))

    def accept(self, record: Record) -> bool:
        """Done with: the group never hands it out again. False if not held here (acknowledged already)."""
        return self._acknowledge(record, AcknowledgeType.ACCEPT)

    def release(self, record: Record) -> bool:
        """Not done: the group hands it out again at once, counting one more delivery. False if not held
        here (acknowledged already)."""
        return self._acknowledge(record, AcknowledgeType.RELEASE)

    def reject(self, record: Record) -> bool:
        """Never to be done: the group archives it. False if not held here (acknowledged already)."""
        return self._acknowledge(record, AcknowledgeType.REJECT)

    def _acknowledge(self, record: Record, kind: AcknowledgeType) -> bool:
        key = (record.topic, record.partition, record.offset)
        member = self._owner.get(key)
        if member is None:
            return False  # acknowledged already, through another copy of it handed out later
        with client_errors(f"acknowledging {record.topic}[{record.partition}]@{record.offset}"):
            member.consumer.acknowledge_offset(record.topic, record.partition, record.offset, kind)
        del self._owner[key]
        member.held -= 1
        member.unsent = True
        return True

    def send_acknowledgements(self) -> None:
        """Send the acknowledgements made since the last call, without waiting (one request a consumer)."""
        # In batches: one request per consumer for everything acknowledged since the last poll.
        for member in self._members:
            if member.unsent:
                with client_errors("committing acknowledgements"):
                    member.consumer.commit_async()
                member.unsent = False

    def shed(self, older_than: float) -> int:
        """Release the records acquired and not handed out that waited `older_than` seconds: a member whose
        slots are all busy leaves them to the others (each counts one more delivery). Returns how many."""
        now = time.monotonic()
        if now - self._drained_at >= older_than:
            # What the last empty polls acquired meanwhile is taken out of the client's queue, to be let go.
            self._drained_at = now
            for member in self._members:
                if member.pending and not member.held:
                    self._fetch(member, 0.0)
        released = 0
        while self._waiting and now - self._waiting[0][2] >= older_than:
            record, member, _ = self._waiting.popleft()
            self._let_go(member, (record.topic, record.partition, record.offset))
            released += 1
        return released

    def in_flight(self) -> int:
        """Records handed out and not acknowledged yet."""
        return len(self._owner)

    def commit(self) -> None:
        """Send the acknowledgements made so far and wait for the broker's answer (to `on_commit`)."""
        for member in self._members:
            if member.unsent:
                with client_errors("committing acknowledgements"):
                    member.consumer.commit_sync(self._timeout)
                member.unsent = False

    def close(self) -> None:
        """Release every record still held, so other members get them at once, commit, and leave."""
        if self._closed:
            return
        self._closed = True
        try:
            held = [(*key, member) for key, member in self._owner.items()]
            held += [(r.topic, r.partition, r.offset, member) for r, member, _ in self._waiting]
            for topic, partition, offset, member in held:
                with client_errors("releasing records"):
                    member.consumer.acknowledge_offset(topic, partition, offset, AcknowledgeType.RELEASE)
                member.unsent = True
            self._owner.clear()
            self._waiting.clear()
            self.commit()
        finally:
            # Every consumer is closed, whatever the others raise (refused credentials raise from each);
            # the first error is the one reported. Side by side: leaving takes each about 0.25 s, and a
            # worker in share mode holds several per tier.
            errors: list[BaseException] = []

            def leave(member: _Member) -> None:
                try:
                    with client_errors("closing the share consumer"):
                        member.consumer.close()
                except Exception as exc:
                    errors.append(exc)

            leaving = [threading.Thread(target=leave, args=(m,), daemon=True) for m in self._members]
            for thread in leaving:
                thread.start()
            for thread in leaving:
                thread.join()
            if errors:
                raise errors[0]
