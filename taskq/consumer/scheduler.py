"""The worker's priority buffers: bounded per-tier FIFOs and a smooth weighted round-robin over tiers."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Generic, TypeVar

from taskq._core.envelope import DEFAULT_WEIGHTS, PRIORITIES, Priority
from taskq._core.errors import ConfigurationError

__all__ = ["PriorityScheduler"]

T = TypeVar("T")


class PriorityScheduler(Generic[T]):
    """Per-tier FIFO buffers drained by smooth weighted round-robin, with a pause rule bounding memory.

    Dispatch (nginx's smooth weighted round-robin): on each pop every non-empty tier earns its weight in
    credit, the tier with most credit (ties to the higher priority) is picked and pays the sum of the
    weights of the non-empty tiers. With all tiers non-empty the picks repeat with period sum(weights),
    in exact proportion to the weights and interleaved (8:4:2:1 gives c h c n c h c l c h c n c h c ...
    spread evenly). An empty tier is skipped and its credit reset to zero, so it banks nothing while
    idle and cannot burst ahead when work returns.

    Pause rule: each tier has a *reserve*, one task plus its weight's share of (roughly) half the capacity;
    the other half is a pool any tier may borrow. A tier's *claim* is max(depth, reserve). A tier is
    saturated (its partitions should be paused) when its depth is at or above its reserve and the
    claims of all tiers add up to the capacity. Hence:

    - a tier below its reserve, in particular an empty tier, is never saturated, whatever the others
      hold, so every tier keeps being fetched and none starves;
    - pushing to an unsaturated tier never lifts the total claim above capacity, and depth <= claim,
      so a caller that pauses saturated tiers buffers at most `capacity` tasks (plus whatever one poll
      already returned);
    - a lone busy tier can buffer its reserve plus the whole pool.
    """

    def __init__(self, *, weights: Mapping[Priority, int] = DEFAULT_WEIGHTS, capacity: int) -> None:
        for tier in PRIORITIES:
            if tier not in weights:
                raise ConfigurationError(f"weight of tier {tier!r} missing")
            weight = weights[tier]
            if not isinstance(weight, int) or isinstance(weight, bool) or weight < 1:
                raise ConfigurationError(f"weight of tier {tier!r} must be an int >= 1, got {weight!r}")
        unknown = set(weights) - set(PRIORITIES)
        if unknown:
            raise ConfigurationError(
                f"unknown tiers in weights: {sorted(unknown)}; tiers are {list(PRIORITIES)}"
            )
        self._weights: dict[Priority, int] = {tier: weights[tier] for tier in PRIORITIES}
        self._capacity = 0
        self._reserves: dict[Priority, int] = {}
        self.resize(capacity)
        self._buffers: dict[Priority, deque[T]] = {tier: deque() for tier in PRIORITIES}
        self._credit: dict[Priority, int] = dict.fromkeys(PRIORITIES, 0)
        self._len = 0

    @property
    def capacity(self) -> int:
        """Most tasks buffered at once across tiers, given that saturated tiers are paused."""
        return self._capacity

    def resize(self, capacity: int) -> None:
        """Bound the buffers at `capacity` from now on, the reserves with it; buffered items stay."""
        # One task per tier at least, or an empty tier could not be fetched without exceeding capacity.
        if not isinstance(capacity, int) or capacity < len(PRIORITIES):
            raise ConfigurationError(
                f"capacity must be an int >= {len(PRIORITIES)} (one task per tier), got {capacity!r}"
            )
        self._capacity = capacity
        total_weight = sum(self._weights.values())
        # Reserves split half the capacity (or one task per tier, if more) by weight, one task each at
        # least: the floors sum to at most budget - len(PRIORITIES), so sum(reserves) <= budget <= capacity.
        budget = max(len(PRIORITIES), capacity // 2)
        self._reserves = {
            tier: 1 + (budget - len(PRIORITIES)) * weight // total_weight
            for tier, weight in self._weights.items()
        }

    def reserve(self, tier: Priority) -> int:
        """Tasks of `tier` that may always be buffered, whatever the other tiers hold."""
        return self._reserves[tier]

    def push(self, tier: Priority, item: T) -> None:
        """Append `item` to the FIFO of `tier`."""
        self._buffers[tier].append(item)
        self._len += 1

    def push_front(self, tier: Priority, item: T) -> None:
        """Put `item` back at the head of `tier`'s FIFO (popped, then not taken after all).

        Its pick is refunded: `tier` gets back what it paid and the tiers with work give back what they
        earned, so weights count the tasks that started, not the pops. Without it a dispatch that pops more
        than will start (a group commit stopped by its window) skews the shares by where it stops.
        """
        self._buffers[tier].appendleft(item)
        self._len += 1
        active = [t for t in PRIORITIES if self._buffers[t]]
        total = sum(self._weights[t] for t in active)
        for t in active:
            self._credit[t] -= self._weights[t]
        # At most a full round's credit: a pop made while fewer tiers had work paid less than `total`, and
        # refunding it in full would let the tier burst ahead.
        self._credit[tier] = min(self._credit[tier] + total, total)

    def pop(self, skip: Collection[str] = ()) -> T | None:
        """Remove and return the next item by weighted round-robin over tiers, or None when all are empty.

        Tiers in `skip` (paused by an operator) are passed over as if empty: their items stay buffered.
        """
        if self._len == 0:
            return None
        best: Priority | None = None
        active_weight = 0
        for tier in PRIORITIES:
            if not self._buffers[tier] or tier in skip:
                # An idle tier banks no credit: it rejoins on equal terms instead of bursting.
                self._credit[tier] = 0
                continue
            self._credit[tier] += self._weights[tier]
            active_weight += self._weights[tier]
            # Strict > keeps ties with the higher priority, as PRIORITIES is highest first.
            if best is None or self._credit[tier] > self._credit[best]:
                best = tier
        if best is None:  # every non-empty tier is skipped
            return None
        self._credit[best] -= active_weight
        self._len -= 1
        return self._buffers[best].popleft()

    def __len__(self) -> int:
        """Total items buffered across tiers."""
        return self._len

    def __iter__(self) -> Iterator[T]:
        """Every buffered item, tier by tier (not the dispatch order)."""
        for buffer in self._buffers.values():
            yield from buffer

    def depth(self, tier: Priority) -> int:
        """Items buffered in `tier`."""
        return len(self._buffers[tier])

    def saturated(self, tier: Priority, incoming: Mapping[Priority, int] | None = None) -> bool:
        """Whether `tier`'s partitions should be paused (see the class docstring for the rule).

        `incoming`: tasks per tier taken from Kafka and about to be pushed, counted as buffered already.
        """
        extra = incoming or {}
        if len(self._buffers[tier]) + extra.get(tier, 0) < self._reserves[tier]:
            return False
        return self.headroom(incoming) <= 0

    def headroom(self, incoming: Mapping[Priority, int] | None = None) -> int:
        """Tasks of any tier that may still be taken before some tier is saturated: the capacity less
        every tier's claim, max(depth, reserve), with `incoming` counted as buffered."""
        extra = incoming or {}
        claimed = sum(max(len(self._buffers[t]) + extra.get(t, 0), self._reserves[t]) for t in PRIORITIES)
        return self._capacity - claimed

    def remove_if(self, pred: Callable[[T], bool]) -> list[T]:
        """Drop buffered items matching `pred` (e.g. of revoked partitions), returning them in tier order."""
        removed: list[T] = []
        for tier in PRIORITIES:
            buffer = self._buffers[tier]
            kept: deque[T] = deque()
            for item in buffer:
                (removed if pred(item) else kept).append(item)
            self._buffers[tier] = kept
        self._len -= len(removed)
        return removed
