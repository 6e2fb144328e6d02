"""Partitions a worker holds that stand still: records to read and none fetched for a while, or never
fetched since they were assigned, while the worker has nothing to do. Kafka's lag shows that a partition
falls behind; this says which one and in what state, once."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from taskq._core.broker import TP

__all__ = ["Stalls"]


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
