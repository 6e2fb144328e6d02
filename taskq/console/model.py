"""What the console shows and does, over the library's own parts: no web framework in this module.

Every figure comes from where the CLI takes it: tier depths counted as `tier_depths` counts them (what
`taskq stats` prints), the DLQ from `DeadLetters`, task records and liveness records from the Postgres store.
One lock serialises the calls, as the Kafka clients and the store's connection serve one thread at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from taskq._core.broker import TP
from taskq._core.db import Database
from taskq._core.envelope import PRIORITIES, Topics
from taskq._core.errors import ConfigurationError
from taskq._core.kafka_admin import Admin
from taskq._core.kafka_clients import Source
from taskq._core.settings import Settings
from taskq._core.store import Store, pause_target
from taskq.consumer.dlq import DeadLetters, DlqRecord, ReplayResult
from taskq.producer.backpressure import backlog, depths_of
from taskq.producer.status import status_of

#: The most nodes of a workflow's tree the console shows (a group of 10,000 is shown by its first ones).
TREE_LIMIT = 500

#: A worker whose heartbeat is older than this (seconds) is not shown as alive (the workers' default).
STALE_AFTER = 10.0
#: How long the overview waits for the oldest waiting record of each partition.
OLDEST_WAIT = 2.0
#: The most DLQ records a listing shows.
LIST_LIMIT = 500


@dataclass(frozen=True, kw_only=True, slots=True)
class DlqFilter:
    """Which DLQ records a listing (or a replay of all matching) takes; empty fields match anything."""

    task_type: str = ""
    reason: str = ""
    error_type: str = ""
    since: timedelta | None = None
    include_replayed: bool = False

    def matches(self, rec: DlqRecord) -> bool:
        """Whether `rec` passes the reason (a substring, any case) and error type (exact) filters."""
        if self.reason and self.reason.lower() not in rec.reason.lower():
            return False
        return not self.error_type or rec.error_type == self.error_type


#: What the overview shows for a namespace whose topics do not exist yet.
NO_TOPICS = "no topics yet: run `taskq topics create`"


class Console:
    """The data behind the console's pages, for one namespace."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.topics = Topics(settings.namespace, settings.delay_tiers)
        self._lock = threading.Lock()
        self._admin = Admin(settings)
        self._database = Database(settings.database_url, schema=settings.database_schema)
        self._store = Store(self._database)
        self._dlq: DeadLetters | None = None
        self._reader: Source | None = None
        self._last_done: tuple[float, dict[TP, int]] | None = None

    def start(self) -> None:
        """Bring the store's tables up to date (the pauses table may be new) and check Kafka answers."""
        self._database.migrate(namespace=self.settings.namespace)
        with self._locked():
            if not self._missing_topics():  # a namespace with no topics yet is shown with a hint
                self._dead_letters().depth()

    def _missing_topics(self) -> list[str]:
        """The namespace's tier and DLQ topics that do not exist (yet)."""
        wanted = [*self.topics.priority_topics, self.topics.dlq]
        found = self._admin.partitions(wanted)
        return [t for t in wanted if t not in found]

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            yield

    def _dead_letters(self) -> DeadLetters:
        if self._dlq is None:
            self._dlq = DeadLetters(self.settings)
        return self._dlq

    # -------------------------------------------------------------------------------------------- overview
    def overview(self) -> dict[str, Any]:
        """Each tier's depth (as `taskq stats` counts it), lag, oldest waiting age and completion rate; the
        delay tiers' contents, the DLQ depth, the workers alive and what is paused."""
        with self._locked():
            s = self.settings
            missing = self._missing_topics()
            if missing:
                return {
                    "namespace": s.namespace,
                    "group": s.worker_group,
                    "missing_topics": missing,
                    "hint": NO_TOPICS,
                    "at": datetime.now(UTC).isoformat(timespec="seconds"),
                }
            # The figures `taskq stats` prints, from the same offsets (tier_depths is depths_of(backlog)).
            tiers_backlog = backlog(self._admin, self.topics.priority_topics, s.worker_group)
            depths = depths_of(tiers_backlog, self.topics)
            oldest = self._oldest_waiting({tp: b for tp, b in tiers_backlog.items() if b[1] > b[0]})
            done = {tp: b[0] for tp, b in tiers_backlog.items()}
            now = time.monotonic()
            rates: dict[str, float | None] = dict.fromkeys(PRIORITIES, None)
            if self._last_done is not None and now > self._last_done[0]:
                then, before = self._last_done
                for tier in PRIORITIES:
                    moved = sum(
                        max(0, o - before.get(tp, o)) for tp, o in done.items() if self._tier(tp) == tier
                    )
                    rates[tier] = moved / (now - then)
            self._last_done = (now, done)
            wall = datetime.now(UTC)
            tiers = []
            for tier in PRIORITIES:
                mine = {tp: b for tp, b in tiers_backlog.items() if self._tier(tp) == tier}
                ages = [wall - oldest[tp] for tp in mine if tp in oldest]
                tiers.append(
                    {
                        "tier": tier,
                        "topic": self.topics.tier(tier),
                        "depth": depths[tier],
                        "lag": max((max(0, hw - first) for first, hw in mine.values()), default=0),
                        "partitions": len(mine),
                        "oldest_seconds": max(ages).total_seconds() if ages else None,
                        "completed_per_s": rates[tier],
                    }
                )
            # The delay forwarder commits a delayed task once it forwarded it: its backlog is what waits.
            delayed = backlog(self._admin, self.topics.delay_topics, f"{s.namespace}.forwarder")
            delays = [
                {
                    "topic": self.topics.delay(d),
                    "delay_seconds": d.total_seconds(),
                    "waiting": sum(
                        max(0, hw - first)
                        for (t, _), (first, hw) in delayed.items()
                        if t == self.topics.delay(d)
                    ),
                }
                for d in s.delay_tiers
            ]
            workers = [
                {
                    "worker_id": w["worker_id"],
                    "group": w["worker_group"],
                    "host": w["host"],
                    "pid": w["pid"],
                    "concurrency": w["concurrency"],
                    "in_flight": w["in_flight"],
                    "started_at": w["started_at"].isoformat(),
                    "heartbeat_seconds": (wall - w["heartbeat_at"]).total_seconds(),
                }
                for w in self._store.workers_alive(s.namespace, STALE_AFTER)
            ]
            return {
                "namespace": s.namespace,
                "group": s.worker_group,
                "tiers": tiers,
                "delay_tiers": delays,
                "dlq_depth": self._dead_letters().depth(),
                "completed_last_minute": self._store.completed_since(s.namespace, 60.0),
                "workers": workers,
                "pauses": self._pauses(),
                "at": wall.isoformat(timespec="seconds"),
            }

    def _tier(self, tp: TP) -> str | None:
        return self.topics.priority_of(tp[0])

    def _oldest_waiting(self, waiting: dict[TP, tuple[int, int]]) -> dict[TP, datetime]:
        """When the first record not yet consumed of each partition (first offset, end offset) reached it:
        its Kafka timestamp. A partition holding only transaction markers past its first offset has none."""
        if not waiting:
            return {}
        if self._reader is None:
            self._reader = Source(self.settings, group=f"{self.settings.namespace}.console")
        self._reader.assign([(t, p, first) for (t, p), (first, _) in waiting.items()])
        found: dict[TP, datetime] = {}
        left = set(waiting)
        deadline = time.monotonic() + OLDEST_WAIT
        while left and time.monotonic() < deadline:
            for r in self._reader.poll(100, 0.1):
                if r.tp in left:
                    found[r.tp] = datetime.fromtimestamp(r.timestamp_ms / 1000, tz=UTC)
                    left.discard(r.tp)
            # Read to the end without a record: markers only (the reader sees committed records alone).
            left = {tp for tp in left if self._reader.position(tp) < waiting[tp][1]}
        return found

    # ---------------------------------------------------------------------------------------------- tasks
    def lookup(self, text: str) -> dict[str, Any] | None:
        """The record of a task, by idempotency key or else by task id, with its status as `taskq status`
        says it (`status`: its state, and where a dead task's DLQ record is); None if neither names one."""
        with self._locked():
            ns = self.settings.namespace
            row = self._store.get(ns, text) or self._store.task_by_id(ns, text)
        if row is None:
            return None
        status = status_of(row, task_id=row["task_id"], dlq_topic=self.topics.dlq)
        record = {k: v.isoformat() if isinstance(v, datetime) else v for k, v in dict(row).items()}
        record["status"] = status.state
        where = f"{status.dlq_topic}[{status.dlq_partition}]@{status.dlq_offset}"
        record["dlq"] = None if status.dlq_offset is None else where
        return record

    # ------------------------------------------------------------------------------------------ workflows
    def workflow(self, workflow_id: str) -> dict[str, Any] | None:
        """A workflow's state, its tasks counted by state, and its tree (nested `children`, each node with
        its kind and state; a group's callback is `then`); None if there is no such workflow. At most
        TREE_LIMIT nodes are shown (`truncated` says so)."""
        with self._locked():
            ns = self.settings.namespace
            row, counts = self._store.workflow_get(ns, workflow_id)
            if row is None:
                return None
            nodes = self._store.workflow_tree(ns, workflow_id, TREE_LIMIT + 1)
        by_node: dict[int, dict[str, Any]] = {}
        root: dict[str, Any] | None = None
        for n in nodes[:TREE_LIMIT]:
            item = {**dict(n), "children": [], "then": None}
            by_node[n["node"]] = item
            parent = by_node.get(n["parent"]) if n["parent"] is not None else None
            if n["parent"] is None:
                root = item
            elif parent is not None and n["position"] == -1:
                parent["then"] = item
            elif parent is not None:
                parent["children"].append(item)
        return {
            "workflow_id": workflow_id,
            "state": row["state"],
            "cancelled": row["cancelled"],
            "counts": counts,
            "root": root,
            "truncated": len(nodes) > TREE_LIMIT,
        }

    # ------------------------------------------------------------------------------------------------ DLQ
    def dlq_list(self, f: DlqFilter) -> list[DlqRecord]:
        """DLQ records oldest first that pass the filter, at most LIST_LIMIT."""
        with self._locked():
            records = self._dead_letters().list(
                task_type=f.task_type or None, since=f.since, include_replayed=f.include_replayed
            )
        return [r for r in records if f.matches(r)][:LIST_LIMIT]

    def dlq_show(self, offset: int) -> dict[str, Any]:
        """One DLQ record, payload decoded with its writer schema, secrets hidden as `taskq dlq show` does."""
        with self._locked():
            rec = self._dead_letters().show(offset)
        return rec.redacted(self.settings.dlq_redact).to_dict(full=True)

    def replay(self, offsets: Sequence[int], *, force: bool) -> list[ReplayResult]:
        """Replay DLQ records by offset, as `taskq dlq replay` does: same task id and key, and a record
        replayed before refused unless `force`."""
        if not offsets:
            raise ConfigurationError("nothing to replay: select DLQ records, or replay all matching")
        with self._locked():
            return self._dead_letters().replay(offsets, force=force)

    # --------------------------------------------------------------------------------------------- pauses
    def pause(self, kind: str, name: str) -> bool:
        """Pause a tier or a task type; False if it was paused already."""
        k, name = pause_target(kind, name)
        with self._locked():
            return self._store.pause(self.settings.namespace, k, name)

    def resume(self, kind: str, name: str) -> bool:
        """Resume a tier or a task type; False if it was not paused."""
        k, name = pause_target(kind, name)
        with self._locked():
            return self._store.resume(self.settings.namespace, k, name)

    def pauses(self) -> list[dict[str, str]]:
        """What is paused: kind, name, since when."""
        with self._locked():
            return self._pauses()

    def _pauses(self) -> list[dict[str, str]]:
        return [
            {"kind": kind, "name": name, "paused_at": at.isoformat(timespec="seconds")}
            for kind, name, at in self._store.pauses(self.settings.namespace)
        ]

    def close(self) -> None:
        """Release the clients and the connection."""
        with self._locked():
            if self._dlq is not None:
                self._dlq.close()
                self._dlq = None
            if self._reader is not None:
                self._reader.close()
                self._reader = None
            self._database.close()
