"""Share mode (experimental): a worker reads its tiers through share groups (KIP-932) instead of partitions
assigned in a consumer group.

Every member of a share group fetches from every partition: the broker hands records out under a lock
and counts their deliveries, and each record is accepted, released or rejected on its own. So workers are
not capped by partitions per tier, and a slow task holds back no other record.

`TierShares` gives the worker's loop what it asks of its source, over one share group per tier topic
(`<namespace>.workers.<tier>`), so that the weighted scheduler decides which tier is fetched, as it pauses
and resumes partitions in the partition mode. A record is acknowledged when the worker would have marked
its offset done: accepted once its outcome is durable, rejected once its DLQ record is, released when it
will not run here. The idempotency record in Postgres keeps one effect per key whatever the broker
redelivers: a record whose lock expires under a long task goes to another member, whose claim finds the
key leased by a live worker and holds it until the key completes, then skips it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from taskq._core.broker import TP, Record
from taskq._core.kafka_admin import Admin
from taskq._core.kafka_clients import KafkaBroker
from taskq._core.share import ShareSource

log = logging.getLogger("taskq.worker")

#: Deliveries after which a share group archives a record it is not acknowledged for, unrun and
#: unrecorded: Kafka's default (group.share.delivery.count.limit), used where the cluster's is unreadable.
#: Each worker death counts one for every record its share consumers held, run or not, so TierShares sets
#: its groups' limit to the most the cluster allows (group.share.max.delivery.count.limit, 10 by
#: default): poison pills are judged by the deaths recorded in Postgres (invariant 10), not by it.
DELIVERY_LIMIT = 5
#: A record is sent again as a new record (same key: it still takes effect once) and accepted this many
#: deliveries before its group's limit, so that a worker dying while it sends the copy (its own run, or
#: another task's) cannot let the group archive the task.
SEND_AGAIN_BEFORE = 2
#: Seconds one tier's share consumers wait for records before the next tier's are asked.
_SLICE = 0.01
#: Seconds a joining worker reads its groups' configs back until they show the delivery limit it set: a
#: broker applies an alteration when it replays the metadata log, after the alter has answered.
_CONFIG_SETTLE = 10.0


def share_group(topic: str) -> str:
    """The share group of a tier topic (`<namespace>.<tier>` reads as `<namespace>.workers.<tier>`)."""
    namespace, _, tier = topic.rpartition(".")
    return f"{namespace}.workers.{tier}"


class TierShares:
    """One share group's member per tier topic, read as the worker reads its assigned partitions."""

    def __init__(
        self,
        broker: KafkaBroker,
        *,
        consumers: int,
        max_poll_records: int,
        on_assign: Callable[[list[TP]], None],
        lock_duration_ms: int | None = None,
    ) -> None:
        """`consumers` ShareConsumers per tier, each acquiring about `max_poll_records` records a poll;
        `on_assign` is told every partition of the tiers once, at subscribe (nothing is ever revoked)."""
        self._broker = broker
        self._consumers = consumers
        self._max_poll_records = max_poll_records
        self._on_assign = on_assign
        self._lock_duration_ms = lock_duration_ms
        self._sources: dict[str, ShareSource] = {}
        #: The groups' delivery limit, as read back at subscribe.
        self.delivery_limit = DELIVERY_LIMIT
        self._paused: set[str] = set()
        self._turn = 0

    def subscribe(self, topics: Sequence[str]) -> None:
        """Configure each tier's share group (read from the start, committed records only) and join it."""
        admin = self._broker.admin()
        most = admin.broker_configs().get("group.share.max.delivery.count.limit")
        limit = int(most) if most else None
        for topic in topics:
            admin.configure_share_group(
                share_group(topic), lock_duration_ms=self._lock_duration_ms, delivery_count_limit=limit
            )
        self.delivery_limit = self._read_limit(admin, [share_group(t) for t in topics], limit)
        partitions = admin.partitions(topics)
        for topic in topics:
            self._sources[topic] = self._broker.share_source(
                group=share_group(topic),
                topics=[topic],
                consumers=self._consumers,
                max_poll_records=self._max_poll_records,
            )
        self._on_assign([(t, p) for t in topics for p in range(partitions.get(t, 0))])

    @staticmethod
    def _read_limit(admin: Admin, groups: list[str], wanted: int | None) -> int:
        """The groups' delivery limit as the broker applies it: read again (for `_CONFIG_SETTLE` seconds at
        most) until it is the `wanted` one set. A limit read lower than the group's only sends records again
        early; one higher than the broker applies could let the group archive a task, so the value set is
        never assumed."""
        deadline = time.monotonic() + _CONFIG_SETTLE
        pause = 0.02
        while True:
            configs = admin.share_group_configs(groups)
            limit = min(int(c.get("share.delivery.count.limit") or DELIVERY_LIMIT) for c in configs.values())
            if wanted is None or limit >= wanted:
                return limit
            if time.monotonic() + pause > deadline:
                log.warning(
                    "share groups %s: still reads share.delivery.count.limit %d, not the %d set; going by %d",
                    ", ".join(groups),
                    limit,
                    wanted,
                    limit,
                )
                return limit
            time.sleep(pause)
            pause = min(pause * 2, 0.5)

    @property
    def send_again_at(self) -> int:
        """The delivery at which a record is sent again as a new record."""
        return max(2, self.delivery_limit - SEND_AGAIN_BEFORE)

    def poll(self, max_records: int, timeout: float) -> list[Record]:
        """Up to `max_records` records of the tiers not paused, each tier asked in turn."""
        out: list[Record] = []
        deadline = time.monotonic() + timeout
        while True:
            topics = [t for t in self._sources if t not in self._paused]
            if not topics:
                if timeout > 0:
                    time.sleep(max(0.0, deadline - time.monotonic()))
                return out
            self._turn += 1
            for i in range(len(topics)):
                if len(out) >= max_records:
                    return out
                out += self._sources[topics[(self._turn + i) % len(topics)]].poll(max_records - len(out), 0.0)
            left = deadline - time.monotonic()
            if out or left <= 0:
                return out
            # Nothing fetched yet: one tier waits a slice, then all are asked again.
            out += self._sources[topics[self._turn % len(topics)]].poll(max_records, min(left, _SLICE))
            if out:
                return out

    def pause(self, tps: Iterable[TP]) -> None:
        """Fetch no more of these partitions' tiers (what is held stays held)."""
        self._paused |= {t for t, _ in tps}

    def resume(self, tps: Iterable[TP]) -> None:
        """Fetch these partitions' tiers again."""
        self._paused -= {t for t, _ in tps}

    def accept(self, record: Record) -> None:
        """Its outcome is durable: the group never hands it out again."""
        self._sources[record.topic].accept(record)

    def reject(self, record: Record) -> None:
        """Its DLQ record is durable: the group archives it."""
        self._sources[record.topic].reject(record)

    def release(self, record: Record) -> None:
        """It will not run here: the group hands it out again at once."""
        self._sources[record.topic].release(record)

    def shed(self, older_than: float) -> None:
        """Release what each tier acquired and could not hand out for `older_than` seconds."""
        for source in self._sources.values():
            source.shed(older_than)

    def commit(self, offsets: Mapping[TP, int], *, asynchronous: bool = False) -> None:
        """Send the acknowledgements made so far (a share group has no offsets to commit)."""
        for source in self._sources.values():
            if asynchronous:
                source.send_acknowledgements()
            else:
                source.commit()

    def high_watermarks(self, tps: Iterable[TP]) -> dict[TP, int]:
        """No partition's first record is waited for: any member may be handed any partition's records."""
        return dict.fromkeys(tps, 0)

    def position(self, tp: TP) -> int:
        """Unknown (-1): a share group's members read no partition from a position of their own."""
        return -1

    def lag(self) -> dict[TP, int]:
        """Unknown here: a share group's backlog is not a consumer's lag (see `in_flight`)."""
        return {}

    def in_flight(self) -> int:
        """Records handed to the worker and not acknowledged yet."""
        return sum(source.in_flight() for source in self._sources.values())

    def close(self) -> None:
        """Release what is held (other members get it at once), send the acknowledgements, leave."""
        errors: list[BaseException] = []

        def leave(source: ShareSource) -> None:
            try:
                source.close()
            except Exception as exc:  # every tier's member leaves; the first error is reported
                errors.append(exc)

        leaving = [threading.Thread(target=leave, args=(s,), daemon=True) for s in self._sources.values()]
        for thread in leaving:
            thread.start()
        for thread in leaving:
            thread.join()
        self._sources.clear()
        if errors:
            raise errors[0]
