"""What a member of a KIP-848 consumer group does as its group settles: it heartbeats sooner than the broker
asks (`Settling`), and wakes its fetchers after a rebalance (at `reading_positions`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping

from confluent_kafka import Consumer, KafkaException, TopicPartition

from taskq._core.broker import TP

#: A member of a KIP-848 group learns of a rebalance only from the answer to a heartbeat, sent at the interval
#: the broker sets (Kafka's default is 5 s). A worker that joins a group therefore waits for its peers' next
#: heartbeats to give partitions up, then for its own to take them: seconds in which it does nothing, and
#: the workers it came to relieve do all the work. While its group settles (its first SETTLE_FOR seconds in
#: the group and those after each change of its assignment), a member sends its subscription again every
#: SETTLE_NUDGE seconds. librdkafka heartbeats at once for a new subscription, and the same subscription
#: again changes nothing in the group (no new epoch, no rebalance): each nudge is a heartbeat sooner, no
#: more. The broker's own batching of assignments (group.consumer.assignment.interval.ms, 1 s by default
#: since Kafka 4.3) still applies.
SETTLE_NUDGE = 0.1
SETTLE_FOR = 5.0


class Settling:
    """When a member of a KIP-848 group re-sends its subscription: every `nudge` seconds until `window`
    seconds after it subscribed or its assignment last changed."""

    def __init__(
        self,
        *,
        nudge: float = SETTLE_NUDGE,
        window: float = SETTLE_FOR,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._nudge, self._window, self._clock = nudge, window, clock
        self._until = -math.inf
        #: When the next nudge is due; None while the group is settled (poll's test is this one attribute).
        self.next: float | None = None

    def changed(self) -> None:
        """The member subscribed or its assignment changed: settle for the next `window` seconds."""
        now = self._clock()
        self._until = now + self._window
        if self.next is None:
            self.next = now + self._nudge

    def wait(self, timeout: float) -> float:
        """`timeout` cut to the next nudge (a poll blocking longer would delay it)."""
        if self.next is None:
            return timeout
        return max(0.0, min(timeout, self.next - self._clock()))

    def due(self) -> bool:
        """Whether a nudge is due now (then the next is scheduled, or settling ends)."""
        if self.next is None:
            return False
        now = self._clock()
        if now < self.next:
            return False
        if now >= self._until:
            self.next = None
            return False
        self.next = now + self._nudge
        return True


def reading_positions(
    consumer: Consumer, tps: Iterable[TP], sought: Mapping[TP, int]
) -> list[TopicPartition]:
    """Where `consumer` reads each of `tps` next: its position, or where it was last set (its start at the
    assignment, or a seek) if it has taken no record of it since. Seeking a partition there wakes its
    fetcher without a record delivered again or skipped.

    Why: librdkafka pauses every partition while a rebalance is in progress and resumes the
    kept ones after, and a resume (the library's, or flow control's) does not wake a broker thread that went
    idle meanwhile: it sleeps out its idle wait (up to a second) with a backlog waiting. In a burn-down the
    member that gave partitions to a newcomer started its first task 0.5-1.1 s after launch, the newcomer
    0.1-0.2 s. Sought from the rebalance callback, before librdkafka resumed them, they slept all the same:
    `Source` seeks the kept ones at its next poll."""
    held = [TopicPartition(t, p) for t, p in tps]
    out = []
    for tp in consumer.position(held) if held else []:
        if tp.offset >= 0:
            out.append(tp)
        elif (at := sought.get((tp.topic, tp.partition))) is not None:
            out.append(TopicPartition(tp.topic, tp.partition, at))
    return out


def kept_through(consumer: Consumer, changed: list[TP]) -> set[TP]:
    """The partitions `consumer` holds through a rebalance that assigns or revokes `changed`."""
    try:
        held = {(p.topic, p.partition) for p in consumer.assignment()}
    except (KafkaException, RuntimeError):
        return set()
    return held - set(changed)
