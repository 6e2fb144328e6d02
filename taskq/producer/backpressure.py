"""Depth limits: how many tasks of a tier the worker group has not committed yet, refreshed in background."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from taskq._core.envelope import PRIORITIES, Priority, Topics
from taskq._core.errors import ConfigurationError, QueueFullError, TaskqError
from taskq._core.kafka import TopicAdmin

log = logging.getLogger("taskq.backpressure")


def tier_depths(admin: TopicAdmin, topics: Topics, group: str) -> dict[Priority, int]:
    """Per tier: end offsets minus the group's committed offsets (or the log start if none).

    An estimate of the tasks waiting, a little high: the forwarder's transaction markers take offsets too.
    """
    names = topics.priority_topics
    end = admin.end_offsets(names)
    committed = admin.committed(group, names)
    start = admin.start_offsets(names) if any(o < 0 for o in committed.values()) or not committed else {}
    depths: dict[Priority, int] = dict.fromkeys(PRIORITIES, 0)
    for tp, hw in end.items():
        done = committed.get(tp, -1)
        if done < 0:
            done = start.get(tp, 0)
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
