"""What stands still in a worker, said once in its log: a record holding back its partition's commits
(with where it is in the stages), and a partition with records to read and none fetched for a while, or
never fetched since it was assigned. Kafka's lag shows that a partition falls behind; this says which one
and why, so an operator (or a failed test) need not guess.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from taskq._core.broker import TP, Record, RecordSource
from taskq._core.envelope import Topics

if TYPE_CHECKING:
    from taskq.consumer.claims import Claims
    from taskq.consumer.dispatch import Dispatch
    from taskq.consumer.intake import Task
    from taskq.consumer.offsets import Offsets

__all__ = ["HELD_BACK_AFTER", "Stalls", "Watch"]

log = logging.getLogger("taskq.worker")

#: A record whose outcome is still not durable after this long (seconds), while records fetched after it
#: have finished, holds its partition's commits back: a line says where it is (once a record). So does a
#: partition with records to read and none fetched that long while the worker held none of its records.
HELD_BACK_AFTER = 60.0


@dataclass(slots=True)
class _Seen:
    position: int  # where the partition was read next when first seen there (-1: unknown, never fetched)
    since: float
    told: bool = False


class Stalls:
    """Partitions whose position has not moved for `after` seconds although they have records to read
    (or whose position is still unknown), during which the worker held none of their records. Each is
    reported once, until its position moves."""

    def __init__(self, after: float) -> None:
        self.after = after
        self._seen: dict[TP, _Seen] = {}

    def check(
        self, now: float, positions: Mapping[TP, tuple[int, int]], holding: Collection[TP]
    ) -> list[tuple[TP, int, int]]:
        """`positions`: per assigned partition, (next offset to read, end offset last seen), -1 when unknown;
        `holding`: partitions with records in the worker (their reading waits for them, rightly). Returns
        the stalls found now, as (partition, position, end)."""
        stalled = []
        seen = self._seen
        for tp in [tp for tp in seen if tp not in positions]:
            del seen[tp]  # revoked: a partition assigned again starts over
        for tp, (position, end) in positions.items():
            entry = seen.get(tp)
            if entry is None or entry.position != position or tp in holding:
                # Moved on, or waiting for the worker to run what it holds of it: watched from now.
                seen[tp] = _Seen(position, now)
                continue
            behind = position < 0 or end > position
            if not entry.told and behind and now - entry.since >= self.after:
                entry.told = True
                stalled.append((tp, position, end))
        return stalled


class Watch:
    """Looks, when asked (every few seconds), for what stands still in the worker's stages, and logs it."""

    def __init__(
        self,
        offsets: Offsets,
        dispatcher: Dispatch,
        claims: Claims,
        topics: Topics,
        *,
        paused: Collection[TP],
        undecoded: Callable[[], Sequence[Record]],
        arrived: Callable[[], Sequence[Task]],
    ) -> None:
        """`paused`: the partitions flow control paused (the worker's own set, read as it changes);
        `undecoded` and `arrived`: the records waiting for the registry, the tasks waiting to be claimed."""
        self._offsets = offsets
        self._dispatcher = dispatcher
        self._claims = claims
        self._topics = topics
        self._paused = paused
        self._undecoded = undecoded
        self._arrived = arrived
        self._stalls = Stalls(HELD_BACK_AFTER)

    def look(self, now: float, source: RecordSource | None) -> None:
        """Log the records holding back their partitions' commits and, given a `source` (not in share mode,
        which has no positions), the partitions that stand still."""
        for tp, offset, behind in self._offsets.tracker.held_back(now, HELD_BACK_AFTER):
            # A long task holds its partition's commits back by design (its timeout allows it): said at
            # info. Anything else standing that long is a warning.
            running = any(
                t.record.offset == offset and t.record.tp == tp for t in self._dispatcher.running.values()
            )
            log.log(
                logging.INFO if running else logging.WARNING,
                "%s[%d] offset %d has held back the commit of %d finished record(s) for over %.0f s: %s",
                *tp,
                offset,
                behind,
                HELD_BACK_AFTER,
                self.where(tp, offset),
            )
        if source is not None:
            self._look_at_partitions(now, source)

    def _look_at_partitions(self, now: float, source: RecordSource) -> None:
        tps = [tp for tp in self._offsets.assigned if self._topics.priority_of(tp[0]) is not None]
        ends = source.high_watermarks(tps)
        positions = {tp: (source.position(tp), ends.get(tp, -1)) for tp in tps}
        # Partitions whose records wait in the worker, and those of tiers an operator paused, rightly stand.
        paused_tiers = self._dispatcher.pauses.tiers
        holding = {
            tp
            for tp in tps
            if self._offsets.tracker.pending(tp) or self._topics.priority_of(tp[0]) in paused_tiers
        }
        for tp, position, end in self._stalls.check(now, positions, holding):
            paused = "paused by flow control" if tp in self._paused else "not paused"
            if position < 0:
                log.warning(
                    "%s[%d] has not been fetched for over %.0f s since it was assigned (%s)",
                    *tp,
                    HELD_BACK_AFTER,
                    paused,
                )
            else:
                log.warning(
                    "%s[%d] has %d record(s) to read from offset %d and none fetched for over %.0f s (%s)",
                    *tp,
                    end - position,
                    position,
                    HELD_BACK_AFTER,
                    paused,
                )

    def where(self, tp: TP, offset: int) -> str:
        """Where the record at `offset` of `tp` is in the worker's stages, in words (for a warning)."""

        def match(task: Task) -> bool:
            return task.record.offset == offset and task.record.tp == tp

        where = self._dispatcher.where(match) or self._claims.where(match)
        if where is None and any(r.offset == offset and r.tp == tp for r in self._undecoded()):
            where = "its record waits for the schema registry to decode it"
        if where is None and any(match(t) for t in self._arrived()):
            where = "its task waits to be claimed"
        # Otherwise it is past the stages that hold tasks: its outcome (completion, retry or DLQ record) is
        # on its way to Postgres or the broker.
        return where or "its outcome is being recorded, or its retry or DLQ record acknowledged"
