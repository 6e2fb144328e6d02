"""What a member of a KIP-848 consumer group does as its group settles: it heartbeats sooner than the broker
asks (`Settling`), and wakes its fetchers after a rebalance (`wake_fetchers`)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping

from confluent_kafka import Consumer, KafkaException, TopicPartition

from taskq._core.broker import TP

log = logging.getLogger("taskq.kafka")

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


def wake_fetchers(consumer: Consumer, tps: Iterable[TP], starts: Mapping[TP, int]) -> None:
    """Seek the partitions kept through an incremental rebalance to where they are. librdkafka pauses
    every partition while a rebalance is in progress and resumes the kept ones after, and the resume
    does not wake a fetcher that went idle in between: it sleeps out its idle wait (up to a second) with
    a backlog waiting. In a burn-down the member that gave partitions to a newcomer started its first
    task 0.5-1.1 s after launch, the newcomer 0.1-0.2 s. A seek wakes it (from the next poll: sought
    from the callback, before the kept partitions are resumed, they slept all the same). Fetched records
    not yet taken are fetched again; none taken is delivered again: a partition the loop has read from
    is sought to its position, one it has not to where it started."""
    try:
        held = [TopicPartition(t, p) for t, p in tps]
        for tp in consumer.position(held) if held else []:
            if tp.offset >= 0:
                consumer.seek(tp)
            elif (start := starts.get((tp.topic, tp.partition))) is not None:
                consumer.seek(TopicPartition(tp.topic, tp.partition, start))
    except KafkaException as exc:  # only the wake-up was lost: the fetcher wakes by itself
        log.debug("waking the fetchers after a rebalance: %s", exc)
