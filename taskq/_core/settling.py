"""When a member of a KIP-848 consumer group heartbeats sooner than the broker asks: as its group settles."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

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
