"""Offsets, the worker's last stage: contiguous commit watermarks for partitions whose tasks finish out of
order (`OffsetTracker`, pure), and the stage that keeps them per partition assignment (`Offsets`).

A fetched record is admitted (its offset tracked) before intake decodes it, and its offset is done once
its outcome is durable; the committed offset per partition is the highest below which everything is done
(invariant 3). In share mode there are no offsets: a record is accepted, or rejected once its DLQ record
is durable, and a commit sends those acknowledgements.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

from taskq._core.broker import Record, RecordSource
from taskq._core.errors import TaskqError
from taskq.consumer.events import Event, OffsetsCommitted, ShareRedelivered

if TYPE_CHECKING:
    from taskq.consumer.shares import TierShares

__all__ = ["OffsetTracker", "Offsets", "TopicPartition"]

log = logging.getLogger("taskq.worker")

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
    # The head as `held_back` last saw it, since when, and whether it was reported.
    head: int = -1
    head_since: float = 0.0
    told: bool = False

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

    def held_back(self, now: float, after: float) -> list[tuple[TopicPartition, int, int]]:
        """Partitions whose commits one pending record has held back for `after` seconds or more (clock
        time `now`, as sampled by earlier calls) while records behind it finished: each as (partition, the
        record's offset, finished records behind it). A record is reported once."""
        stuck = []
        for tp, part in self._partitions.items():
            if not part.order:
                continue
            head = part.order[0]
            if head != part.head:
                part.head, part.head_since, part.told = head, now, False
            elif not part.told and now - part.head_since >= after:
                behind = len(part.order) - len(part.pending)
                if behind:
                    part.told = True
                    stuck.append((tp, head, behind))
        return stuck

    def pending(self, tp: TopicPartition) -> int:
        """Number of tracked records of `tp` whose outcome is not yet durable."""
        part = self._partitions.get(tp)
        return 0 if part is None else len(part.pending)

    def in_flight(self) -> int:
        """Number of tracked records, over all partitions, whose outcome is not yet durable."""
        return self._in_flight


class Offsets:
    """The offsets of the partitions assigned to a worker, kept per assignment (a generation), and their
    commits; in share mode, the records' acknowledgements instead."""

    def __init__(self, emit: Callable[[Event], None]) -> None:
        self.tracker = OffsetTracker()
        #: Per partition, its assignment's number: a task carries the one it was fetched in, and its outcome
        #: moves the offset only if the partition is still in that assignment.
        self.generation: dict[TopicPartition, int] = {}
        self.assigned: set[TopicPartition] = set()
        #: Counts the changes to `assigned`: what is derived from it is derived again when this moves.
        self.changes = 0
        #: The share groups' member, in share mode (set when the worker starts).
        self.shares: TierShares | None = None
        self._emit = emit

    def admit(self, records: Sequence[Record], *, tracked: bool = False) -> tuple[list[Record], list[Record]]:
        """Of a fetched batch: the records to decode (offsets tracked, unless `tracked` already), and in
        share mode the records to send again as new ones. The rest are dropped."""
        admitted: list[Record] = []
        again: list[Record] = []
        assigned, shares, tracker = self.assigned, self.shares, self.tracker
        for record in records:
            if record.tp not in assigned:
                # Fetched before its partition was revoked (one consume() can return records of a partition
                # whose revocation it also served): its new owner reads it from the committed offset.
                # Tracking it here would leave a stale entry that swallows the partition's records if it
                # comes back.
                continue
            if shares is not None:
                if record.delivery_count is not None and record.delivery_count > 1:
                    last = record.delivery_count >= shares.send_again_at
                    self._emit(ShareRedelivered(record.topic, record.delivery_count, last))
                    if last:
                        again.append(record)
                        continue
            elif not tracked:
                try:
                    tracker.track(record.tp, record.offset)
                except ValueError:
                    continue  # a redelivery of an offset this assignment already holds
            admitted.append(record)
        return admitted, again

    def current(self, tp: TopicPartition, generation: int) -> bool:
        """Whether the partition is still in the assignment `generation`."""
        return tp in self.assigned and self.generation.get(tp) == generation

    def done(self, record: Record, generation: int, *, dead: bool = False) -> None:
        """The record's outcome is durable (`dead`: in the DLQ): its offset may be committed, or in share
        mode, the record is acknowledged."""
        if self.shares is not None:
            (self.shares.reject if dead else self.shares.accept)(record)
        elif self.generation.get(record.tp) == generation and record.tp in self.assigned:
            self.tracker.done(record.tp, record.offset)

    def assign(self, tps: Iterable[TopicPartition]) -> None:
        """Newly assigned partitions start a new assignment, read again from their committed offsets."""
        tps = list(tps)
        self.tracker.forget(tps)
        self.changes += 1
        for tp in tps:
            self.generation[tp] = self.generation.get(tp, 0) + 1
            self.assigned.add(tp)

    def revoke(self, tps: Iterable[TopicPartition]) -> None:
        """Revoked partitions' offsets are forgotten; outcomes that arrive later move nothing."""
        tps = list(tps)
        self.tracker.forget(tps)
        self.changes += 1
        for tp in tps:
            self.assigned.discard(tp)
            self.generation[tp] = self.generation.get(tp, 0) + 1

    def abandon(self) -> None:
        """Shutdown: every partition's assignment ends here, so a late outcome moves no offset."""
        for tp in self.assigned:
            self.generation[tp] = self.generation.get(tp, 0) + 1

    def pending(self) -> bool:
        """Offsets tracked and not yet durable, or durable and not yet committed."""
        return bool(self.tracker.in_flight() or self.tracker.committable())

    def commit(
        self,
        source: RecordSource | TierShares,
        tps: set[TopicPartition] | None = None,
        *,
        asynchronous: bool = False,
    ) -> bool:
        """Commit what is committable (of `tps`, if given); False if the commit failed.

        `asynchronous` (the periodic commit): the loop goes on at once, and the outcome comes to
        `committed` from a later poll. Revoke and shutdown commit synchronously: they must know.
        """
        if self.shares is not None:
            # Acknowledgements instead of offsets: sent as they are made, waited for when stopping.
            try:
                self.shares.commit({}, asynchronous=asynchronous)
            except TaskqError as exc:
                log.warning("sending acknowledgements failed, will retry: %s", exc)
                return False
            return True
        offsets = self.tracker.committable()
        if tps is not None:
            offsets = {tp: o for tp, o in offsets.items() if tp in tps}
        if not offsets:
            return True
        try:
            source.commit(offsets, asynchronous=asynchronous)
        except TaskqError as exc:
            log.warning("commit failed, will retry: %s", exc)
            return False
        if not asynchronous:
            self.tracker.mark_committed(offsets)
            self._emit(OffsetsCommitted(offsets))
        return True

    def committed(self, offsets: dict[TopicPartition, int], error: str | None) -> None:
        """An asynchronous commit's outcome: what the broker committed is marked so."""
        if error is not None:
            # Delivery guarantee: offsets not committed stay committable, and the next commit sends them.
            log.warning("commit failed, will retry: %s", error)
        if offsets:
            self.tracker.mark_committed(offsets)
            self._emit(OffsetsCommitted(offsets))
