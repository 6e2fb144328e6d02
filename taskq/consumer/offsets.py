"""Contiguous commit watermarks for partitions whose tasks finish out of order."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeAlias

__all__ = ["OffsetTracker", "TopicPartition"]

#: (topic, partition)
TopicPartition: TypeAlias = tuple[str, int]


@dataclass
class _Partition:
    # Offsets tracked and not yet released, ascending; the head is always still pending.
    order: deque[int] = field(default_factory=deque)
    # Tracked offsets whose outcome is not yet durable.
    pending: set[int] = field(default_factory=set)
    last_tracked: int = -1
    committed: int = -1

    def watermark(self) -> int:
        return self.order[0] if self.order else self.last_tracked + 1


class OffsetTracker:
    """Per-partition commit offsets: the next offset below which every tracked record is done.

    Offsets a partition never tracked (gaps left by compaction or transaction markers) never hold the
    watermark back. Every operation is amortised O(1).
    """

    def __init__(self) -> None:
        self._partitions: dict[TopicPartition, _Partition] = {}
        self._in_flight = 0

    def track(self, tp: TopicPartition, offset: int) -> None:
        """Record that the record at `offset` was fetched and its task is now pending."""
        part = self._partitions.get(tp)
        if part is None:
            # Nothing before the first fetched offset is ours to commit.
            part = self._partitions[tp] = _Partition(committed=offset)
        elif offset <= part.last_tracked:
            raise ValueError(
                f"offset {offset} of {tp[0]}[{tp[1]}] tracked after {part.last_tracked}: "
                "offsets must increase per partition (forget() the partition before seeking back)"
            )
        part.order.append(offset)
        part.pending.add(offset)
        part.last_tracked = offset
        self._in_flight += 1

    def done(self, tp: TopicPartition, offset: int) -> None:
        """Record that the task at `offset` has a durable outcome; ignored for forgotten partitions."""
        part = self._partitions.get(tp)
        if part is None:
            return  # revoked: the partition's new owner commits it
        if offset not in part.pending:
            raise ValueError(
                f"offset {offset} of {tp[0]}[{tp[1]}] is not pending (never tracked, or done twice)"
            )
        part.pending.remove(offset)
        self._in_flight -= 1
        order = part.order
        while order and order[0] not in part.pending:
            order.popleft()

    def committable(self) -> dict[TopicPartition, int]:
        """Commit offsets (next offset to consume) of partitions whose watermark moved since last commit."""
        result: dict[TopicPartition, int] = {}
        for tp, part in self._partitions.items():
            watermark = part.watermark()
            if watermark > part.committed:
                result[tp] = watermark
        return result

    def mark_committed(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Record offsets the broker acknowledged as committed; forgotten partitions are skipped.

        The last acknowledgement is what the broker holds, even if it names an older offset: a client
        retries a commit refused while the group coordinator loads (a broker restart), and the retried older
        commit can be applied after a newer one. A committed offset that so moves back is committed again.
        """
        for tp, offset in offsets.items():
            part = self._partitions.get(tp)
            if part is not None:
                # Delivery guarantee: never assume more committed than the broker's last word, or records
                # past it stay uncommitted for good (and lag never reaches zero).
                part.committed = offset

    def forget(self, tps: Iterable[TopicPartition]) -> None:
        """Drop revoked partitions; later done() calls for them are ignored."""
        for tp in tps:
            part = self._partitions.pop(tp, None)
            if part is not None:
                self._in_flight -= len(part.pending)

    def pending(self, tp: TopicPartition) -> int:
        """Number of tracked records of `tp` whose outcome is not yet durable."""
        part = self._partitions.get(tp)
        return 0 if part is None else len(part.pending)

    def in_flight(self) -> int:
        """Number of tracked records, over all partitions, whose outcome is not yet durable."""
        return self._in_flight
