"""Depth limits: how many tasks of a tier the worker group has not committed yet, refreshed in background."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence

from taskq._core.broker import TP, TopicAdmin
from taskq._core.envelope import PRIORITIES, Priority, Topics
from taskq._core.errors import ConfigurationError, QueueFullError, TaskqError

log = logging.getLogger("taskq.backpressure")


def backlog(admin: TopicAdmin, topics: Sequence[str], group: str) -> dict[TP, tuple[int, int]]:
    """Per partition of `topics`: (the group's committed offset, or the log start if none; the end offset).

    What lies between is what the group has not consumed yet: records, and transaction markers (the
    forwarder's transactions leave one in each partition they wrote to).
    """
    end = admin.end_offsets(topics)
    committed = admin.committed(group, topics)
    start = admin.start_offsets(topics) if any(o < 0 for o in committed.values()) or not committed else {}
    out: dict[TP, tuple[int, int]] = {}
    for tp, hw in end.items():
        done = committed.get(tp, -1)
        out[tp] = (done if done >= 0 else start.get(tp, 0), hw)
    return out


def tier_depths(admin: TopicAdmin, topics: Topics, group: str) -> dict[Priority, int]:
    """Per tier: end offsets minus the group's committed offsets (or the log start if none).

    An estimate of the tasks waiting, a little high: the forwarder's transaction markers take offsets too.
    """
    return depths_of(backlog(admin, topics.priority_topics, group), topics)


def depths_of(partitions: Mapping[TP, tuple[int, int]], topics: Topics) -> dict[Priority, int]:
    """Per tier, the sum of its partitions' backlogs (from `backlog`)."""
    depths: dict[Priority, int] = dict.fromkeys(PRIORITIES, 0)
    for tp, (done, hw) in partitions.items():
        priority = topics.priority_of(tp[0])
        if priority is not None:
            depths[priority] += max(0, hw - done)
    return depths


class DepthMonitor:
    """Keeps each tier's depth fresh from a background thread, so enqueue() never waits on the broker."""

    def __init__(
        self,
        admin: TopicAdmin,
        group: str,
        topics: Topics,
        limits: Mapping[str, int],
        *,
        refresh: float = 2.0,
    ) -> None:
        for priority, limit in limits.items():
            if not isinstance(limit, int) or limit < 0:
                raise ConfigurationError(
                    f"depth limit of tier {priority!r} must be an integer >= 0, got {limit!r}"
                )
        self._limits = dict(limits)
        self._admin = admin
        self._topics = topics
        self._group = group
        self._refresh = refresh
        self._depths: dict[Priority, int] = dict.fromkeys(PRIORITIES, 0)
        self._stop = threading.Event()
        self.refresh()  # the first check must already know the depth
        self._thread = threading.Thread(target=self._run, name="taskq-depth", daemon=True)
        self._thread.start()

    def refresh(self) -> dict[Priority, int]:
        """Measure now."""
        depths = tier_depths(self._admin, self._topics, self._group)
        self._depths = depths
        return depths

    def _run(self) -> None:
        while not self._stop.wait(self._refresh):
            try:
                self.refresh()
            except TaskqError as exc:  # keep the last known depths; enqueue goes on meanwhile
                log.warning("cannot refresh tier depths: %s", exc)

    def depths(self) -> dict[str, int]:
        """The last measured depth of each tier."""
        return {str(k): v for k, v in self._depths.items()}

    def check(self, priority: Priority, *, incoming: int = 1) -> None:
        """QueueFullError if `incoming` more tasks would take the tier over its limit."""
        limit = self._limits.get(priority)
        if limit is None:
            return
        depth = self._depths.get(priority, 0)
        if depth + incoming > limit:
            raise QueueFullError(priority, depth, limit)

    def close(self) -> None:
        """Stop the background refresh."""
        self._stop.set()
        self._thread.join(timeout=5)
