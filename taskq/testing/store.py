"""`InMemoryStore`: the idempotency store's claims, leases, completions, slots, buckets and pauses in
memory."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from taskq._core.errors import TaskqError
from taskq._core.store import NodeRecord, encode_result
from taskq._core.workflows import advance, parse_header, step_ends, workflow_inputs
from taskq.consumer.store import (
    FORGET_WORKERS_AFTER,
    Claim,
    ClaimRequest,
    Finished,
    LeaseLostError,
    Member,
    NotStarted,
    Pauses,
    SlotRequest,
    WorkerRecord,
)
from taskq.testing.workflows import InMemoryWorkflows, MemoryNodes


@dataclass
class _Row:
    task_id: str
    task_type: str
    state: str
    attempts: int
    lease_owner: str | None
    lease_expires_at: float | None
    last_error: str | None = None
    result: Any = None
    created_at: float = 0.0
    updated_at: float = 0.0
    completed_at: float | None = None
    interruptions: int = 0
    takeovers: int = 0
    started: bool = False
    cancel_requested: bool = False
    dlq: tuple[int, int] | None = None


@dataclass
class _Liveness:
    record: WorkerRecord
    heartbeat_at: float
    in_flight: int = 0
    dead_at: float | None = None
    #: Its first beat after a gap longer than stale_after (None until one).
    beating_since: float | None = None


@dataclass
class _Slot:
    task_type: str
    key: str
    owner: str
    lease_expires_at: float


@dataclass
class _Bucket:
    rate: float
    capacity: float
    tokens: float
    updated_at: float  # in the future while the bucket is paused


class _NoDatabase:
    """What a transactional handler gets as ctx.db from an InMemoryStore made without `connect`."""

    def __getattr__(self, name: str) -> Any:
        raise TaskqError(
            "a transactional handler needs a database connection: give InMemoryQueue (or InMemoryStore) "
            "connect=..., a function returning a DB-API connection"
        )


def _stored(result: Any) -> Any:
    """A result as Postgres gives it back: its JSON read again (tuples become lists, and so on)."""
    return None if result is None else json.loads(encode_result(result))


class InMemoryStore:
    """The idempotency store's rules in memory: claim with a lease (attempts counted at claim), completion
    and failure only by the lease holder's current attempt, replay resets, purge of old finished keys.

    `rows` holds the records of the store's namespace, by key. Several stores of one namespace (one per
    worker id) share them: `InMemoryStore(owner="b", rows=a.rows)`; a store of another namespace has rows
    of its own, as namespaces sharing a Postgres database keep their records apart. `workers` holds the
    liveness records, by worker id, shared by every store of one database (`workers=a.workers`): a key
    leased by a worker whose heartbeat is older than `stale_after` seconds on `clock`, or that was marked
    dead, is taken over by the next claim as the same attempt: a takeover, and an interruption too if its
    run was marked started (`mark_started`). `slots` (concurrency slots, by idempotency key) and `buckets`
    (shared token buckets, by name) are shared the same way.
    """

    def __init__(
        self,
        *,
        owner: str,
        namespace: str = "taskq",
        clock: Callable[[], float] = time.time,
        rows: dict[str, _Row] | None = None,
        workers: dict[str, _Liveness] | None = None,
        stale_after: float = 10.0,
        connect: Callable[[], Any] | None = None,
        slots: dict[str, _Slot] | None = None,
        buckets: dict[str, _Bucket] | None = None,
        paused: dict[tuple[str, str], datetime] | None = None,
        workflows: InMemoryWorkflows | None = None,
    ) -> None:
        self.owner = owner
        self.namespace = namespace
        self.rows: dict[str, _Row] = {} if rows is None else rows
        self.workers: dict[str, _Liveness] = {} if workers is None else workers
        self.slots: dict[str, _Slot] = {} if slots is None else slots
        self.buckets: dict[str, _Bucket] = {} if buckets is None else buckets
        self.stale_after = stale_after
        self._clock = clock
        self._connect = connect
        self._lock = threading.Lock()
        #: DLQ replays: (topic, offset) -> (when, how many times); one replay at a time, as in Postgres
        self.replays: dict[tuple[str, int], tuple[datetime, int]] = {}
        self._replay_lock = threading.Lock()
        #: What operators paused, (kind, name) -> when; stores of one namespace share it: `paused=a.paused`
        self.paused: dict[tuple[str, str], datetime] = {} if paused is None else paused
        #: Workflows and their nodes; stores of one namespace share them: `workflows=a.workflows`
        self.workflows = InMemoryWorkflows() if workflows is None else workflows

    def pause(self, kind: str, name: str) -> bool:
        """Pause a tier or a task type (kind "tier" or "task_type"); False if it was paused already."""
        with self._lock:
            if (kind, name) in self.paused:
                return False
            self.paused[(kind, name)] = datetime.now(UTC)
            return True

    def resume(self, kind: str, name: str) -> bool:
        """Resume a tier or a task type; False if it was not paused."""
        with self._lock:
            return self.paused.pop((kind, name), None) is not None

    def pauses(self) -> Pauses:
        """What is paused, as the worker reads it every few seconds."""
        with self._lock:
            return Pauses(
                tiers=frozenset(n for k, n in self.paused if k == "tier"),
                task_types=frozenset(n for k, n in self.paused if k == "task_type"),
            )

    def claim(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """Claim each key for one attempt; a key twice in one batch: 'duplicate' (as IdempotencyStore)."""
        out: list[Claim] = []
        answered: set[str] = set()
        with self._lock:
            now = self._clock()
            dead = self._dead_workers(now)
            for r in requests:
                row = self.rows.get(r.idempotency_key)
                if r.idempotency_key in answered:
                    out.append(Claim(r.idempotency_key, "duplicate", row.attempts if row else 0))
                    continue
                answered.add(r.idempotency_key)
                running = row is not None and row.state == "running"
                expired = running and row is not None and (row.lease_expires_at or 0) < now
                # Taken over from a dead worker: a takeover (an interruption too if the run was marked
                # started), and the same attempt runs again.
                taken = (
                    running and row is not None and row.lease_owner != self.owner and row.lease_owner in dead
                )
                # A dead key is claimed by a new task of the key, not by the dead-lettered one redelivered.
                again = row is not None and row.state == "dead" and row.task_id != r.task_id
                if row is None or row.state == "failed" or again or expired or taken:
                    attempts = 1 if row is None else row.attempts + (0 if taken else 1)
                    takeovers = 0 if row is None else row.takeovers + (1 if taken else 0)
                    interrupted = taken and row is not None and row.started
                    interruptions = 0 if row is None else row.interruptions + (1 if interrupted else 0)
                    created = now if row is None else row.created_at
                    self.rows[r.idempotency_key] = _Row(
                        r.task_id, r.task_type, "running", attempts, self.owner, now + r.lease_seconds,
                        row.last_error if row else None, None, created, now, None, interruptions, takeovers,
                    )  # fmt: skip
                    out.append(Claim(r.idempotency_key, "claimed", attempts, 0.0, interruptions, takeovers))
                    continue
                counts = row.interruptions, row.takeovers
                if row.state == "completed":
                    out.append(Claim(r.idempotency_key, "completed", row.attempts, 0.0, *counts))
                elif row.state == "cancelled":
                    out.append(Claim(r.idempotency_key, "cancelled", row.attempts, 0.0, *counts))
                elif row.state == "dead":
                    out.append(Claim(r.idempotency_key, "dead", row.attempts, 0.0, *counts))
                else:
                    left = (row.lease_expires_at or now) - now
                    out.append(Claim(r.idempotency_key, "running", row.attempts, left, *counts))
        return out

    def enter(self, worker: WorkerRecord, alive: Callable[[int], bool]) -> set[str]:
        """Write the worker's liveness record and mark dead the earlier workers of its host whose process
        is gone; returns their ids (as IdempotencyStore)."""
        with self._lock:
            now = self._clock()
            self.workers[worker.worker_id] = _Liveness(worker, now)
            marked = set()
            for worker_id, w in self.workers.items():
                earlier = w.record.host == worker.host and w.record.started_at <= worker.started_at
                gone = w.dead_at is None and not alive(w.record.pid)
                if earlier and worker_id != worker.worker_id and gone:
                    w.dead_at = now
                    marked.add(worker_id)
            forgotten = [i for i, w in self.workers.items() if w.heartbeat_at < now - FORGET_WORKERS_AFTER]
            for worker_id in forgotten:
                del self.workers[worker_id]
            return marked

    def beat(self, worker: WorkerRecord, in_flight: int) -> None:
        """Write the worker's heartbeat (a record marked dead by mistake comes back to life)."""
        with self._lock:
            now = self._clock()
            known = self.workers.get(worker.worker_id)
            started = known.record if known is not None else worker
            since = None if known is None else known.beating_since
            if known is not None and known.heartbeat_at < now - self.stale_after:
                since = now
            self.workers[worker.worker_id] = _Liveness(started, now, in_flight, beating_since=since)

    def leave(self, worker_id: str) -> None:
        """Remove the worker's liveness record (a clean stop)."""
        with self._lock:
            self.workers.pop(worker_id, None)

    def _dead_workers(self, now: float) -> set[str]:
        """Workers marked dead, and those whose heartbeat is stale, as this store's owner may judge them (as
        in Postgres): counted from its own first beat after a gap, if any, and not at all while its own
        record is stale (an outage it sat out too). An owner without a record judges by heartbeats alone."""
        me = self.workers.get(self.owner)
        cut_off = me is not None and me.heartbeat_at < now - self.stale_after
        since = me.beating_since if me is not None and me.beating_since is not None else float("-inf")
        return {
            worker_id
            for worker_id, w in self.workers.items()
            if w.dead_at is not None or (not cut_off and max(w.heartbeat_at, since) < now - self.stale_after)
        }

    def acquire_slots(self, requests: Sequence[SlotRequest]) -> set[str]:
        """Take a slot for each task whose key has fewer live slots than its limit, earlier requests of a key
        first; a slot is live while its lease lasts and its owner's heartbeat is fresh (as in Postgres)."""
        granted: set[str] = set()
        with self._lock:
            now = self._clock()
            dead = self._dead_workers(now)
            asked = {r.idempotency_key for r in requests}
            live: dict[tuple[str, str], int] = {}
            for key, slot in list(self.slots.items()):
                if slot.lease_expires_at <= now or slot.owner in dead:
                    if key not in asked:
                        del self.slots[key]  # dead: freed for the key's next acquirer
                elif key not in asked:
                    live[(slot.task_type, slot.key)] = live.get((slot.task_type, slot.key), 0) + 1
            for r in {r.idempotency_key: r for r in requests}.values():
                held = live.get((r.task_type, r.key), 0)
                if held < r.limit:
                    live[(r.task_type, r.key)] = held + 1
                    expires = now + r.lease_seconds
                    self.slots[r.idempotency_key] = _Slot(r.task_type, r.key, self.owner, expires)
                    granted.add(r.idempotency_key)
        return granted

    def release_slots(self, idempotency_keys: Sequence[str]) -> None:
        """Give back this owner's slots of these tasks."""
        with self._lock:
            for key in idempotency_keys:
                slot = self.slots.get(key)
                if slot is not None and slot.owner == self.owner:
                    del self.slots[key]

    def take_tokens(
        self, bucket: str, *, rate: float, capacity: float, want: float
    ) -> tuple[float, float, float]:
        """Refill a shared bucket and take up to `want` whole tokens: (granted, left, seconds paused)."""
        with self._lock:
            now = self._clock()
            b = self.buckets.get(bucket)
            if b is None:
                granted = min(want, float(int(capacity)))
                self.buckets[bucket] = _Bucket(rate, capacity, capacity - granted, now)
                return granted, capacity - granted, 0.0
            tokens = min(b.capacity, b.tokens + max(0.0, now - b.updated_at) * b.rate)
            granted = min(want, float(int(tokens)))
            b.rate, b.capacity, b.tokens = rate, capacity, tokens - granted
            b.updated_at = max(b.updated_at, now)
            return granted, b.tokens, max(0.0, b.updated_at - now)

    def pause_tokens(self, bucket: str, *, rate: float, capacity: float, seconds: float) -> None:
        """Empty a shared bucket and grant nothing from it for `seconds` (a longer pause set stays)."""
        with self._lock:
            now = self._clock()
            b = self.buckets.setdefault(bucket, _Bucket(rate, capacity, 0.0, now))
            b.tokens, b.updated_at = 0.0, max(b.updated_at, now + seconds)

    def purge_idle(self) -> tuple[int, int]:
        """Delete buckets refilled to the brim and slots whose lease ended: (buckets, slots)."""
        with self._lock:
            now = self._clock()
            full = [
                name
                for name, b in self.buckets.items()
                if b.updated_at <= now and b.tokens + (now - b.updated_at) * b.rate >= b.capacity
            ]
            ended = [key for key, slot in self.slots.items() if slot.lease_expires_at < now]
            for name in full:
                del self.buckets[name]
            for key in ended:
                del self.slots[key]
            return len(full), len(ended)

    def finish_and_claim(
        self, finished: Sequence[Finished], requests: Sequence[ClaimRequest]
    ) -> tuple[set[str], list[Claim]]:
        """`finish(finished)`, then `claim(requests)`: IdempotencyStore does both in one round trip."""
        return self.finish(finished), self.claim(requests)

    def _holds(self, key: str, attempts: int) -> _Row | None:
        row = self.rows.get(key)
        ok = row is not None and row.state == "running" and row.lease_owner == self.owner
        return row if ok and row is not None and row.attempts == attempts else None

    def finish(self, finished: Sequence[Finished]) -> set[str]:
        """Record completions and failures, and move on the workflows they end steps of; returns the keys
        whose lease was lost (nothing recorded)."""
        lost: set[str] = set()
        steps: list[tuple[str, str, str]] = []
        with self._lock:
            now = self._clock()
            for f in finished:
                row = self._holds(f.idempotency_key, f.attempts)
                if row is None:
                    lost.add(f.idempotency_key)
                    continue
                state = "cancelled" if f.state == "failed" and row.cancel_requested else f.state
                row.state, row.updated_at, row.lease_owner, row.lease_expires_at = state, now, None, None
                if f.state == "completed":
                    row.result, row.completed_at, row.last_error = _stored(f.result), now, None
                else:
                    row.last_error, row.dlq = f.error[:4000], f.dlq
                if f.workflow is not None:
                    steps.append((f.workflow, f.idempotency_key, state))
            advance(self._nodes(), step_ends(steps))
        return lost

    def _nodes(self) -> MemoryNodes:
        """The workflows' nodes, for `advance` (under the lock)."""

        def result(key: str) -> tuple[str | None, Any, str | None]:
            row = self.rows.get(key)
            return (None, None, None) if row is None else (row.task_id, row.result, row.last_error)

        return self.workflows.view(result, self._clock)

    def purge_workflows(self, ttl_seconds: float, *, batch: int = 1_000) -> int:
        """Forget workflows that ended more than the TTL ago, with their nodes (as IdempotencyStore)."""
        with self._lock:
            return self.workflows.purge(self._clock() - ttl_seconds)

    def take_staged(self) -> list[tuple[str, bytes | None, bytes, list[tuple[str, bytes]]]]:
        """The records workflows staged since the last call (topic, key, value, headers), for the relay."""
        with self._lock:
            staged, self.workflows.outbox[:] = list(self.workflows.outbox), []
            return staged

    def workflow_ended(self, ends: Sequence[tuple[str, str, str]]) -> None:
        """Record the ends of workflow steps skipped by the worker (as IdempotencyStore)."""
        with self._lock:
            advance(self._nodes(), step_ends(ends))

    def workflow_inputs(self, workflow: str) -> tuple[Any, list[dict[str, Any]] | None]:
        """(ctx.parent_result, ctx.group_results) of a workflow's step."""
        workflow_id, node = parse_header(workflow)
        with self._lock:
            return workflow_inputs(self._nodes(), workflow_id, node)

    def workflow_create(self, workflow_id: str, nodes: Sequence[NodeRecord]) -> None:
        """Write a new workflow and start it: its first tasks wait in `workflows.outbox` for the relay."""
        with self._lock:
            self.workflows.create(workflow_id, nodes)
            advance(self._nodes(), start=[(workflow_id, 0)])

    def workflow_status(self, workflow_id: str) -> tuple[str | None, bool, dict[str, int]]:
        """(the workflow's state or None if unknown, whether it was cancelled, its tasks by state)."""
        with self._lock:
            wf = self.workflows.workflows.get(workflow_id)
            counts: dict[str, int] = {}
            for (w, _), (node, _, _) in self.workflows.nodes.items():
                if w == workflow_id and node.kind == "task":
                    counts[node.state] = counts.get(node.state, 0) + 1
            return (None, False, {}) if wf is None else (wf.state, wf.cancelled, counts)

    def workflow_cancel(self, workflow_id: str) -> tuple[int, int]:
        """Cancel a workflow: its waiting steps never start, its staged tasks are cancelled as `cancel`
        would (as in Postgres). Returns (staged tasks, of which not started)."""
        with self._lock:
            wf = self.workflows.workflows.get(workflow_id)
            if wf is None or wf.state != "running":
                return 0, 0
            wf.cancelled = True
            staged = [
                record
                for (w, _), (node, record, _) in self.workflows.nodes.items()
                if w == workflow_id and node.kind == "task" and node.state == "running"
            ]
        not_started = 0
        for record in staged:
            assert record.idempotency_key is not None
            before, _, held = self.cancel(record.idempotency_key, record.task_id or "")
            not_started += before in ("unknown", "failed") or (before == "running" and not held)
        return len(staged), not_started

    def release(self, claims: Sequence[tuple[str, int]]) -> set[str]:
        """Give back claims whose attempts never started: uncounted, claimable at once (as in Postgres)."""
        released: set[str] = set()
        with self._lock:
            now = self._clock()
            for key, attempts in claims:
                row = self._holds(key, attempts)
                if row is not None:
                    row.attempts -= 1
                    row.lease_owner, row.lease_expires_at, row.updated_at = None, now - 1e-6, now  # expired
                    released.add(key)
        return released

    def renew(self, leases: Sequence[tuple[str, int, float]]) -> set[str]:
        """Extend (key, attempt, seconds from now) leases held by this owner; returns the keys renewed."""
        renewed: set[str] = set()
        with self._lock:
            now = self._clock()
            for key, attempts, seconds in leases:
                row = self._holds(key, attempts)
                if row is not None:
                    row.lease_expires_at, row.updated_at = now + seconds, now
                    renewed.add(key)
        return renewed

    def mark_started(self, runs: Sequence[tuple[str, int]]) -> set[str]:
        """Mark (key, attempt) runs held by this owner started; returns the keys marked (as in Postgres)."""
        marked: set[str] = set()
        with self._lock:
            for key, attempts in runs:
                row = self._holds(key, attempts)
                if row is not None:
                    row.started = True
                    marked.add(key)
        return marked

    @contextmanager
    def _connection(self) -> Iterator[Any]:
        """The handler's connection (from `connect`, or one that says it is missing): rolled back if the
        block raises, closed at its end."""
        conn = self._connect() if self._connect is not None else _NoDatabase()
        try:
            yield conn
        except BaseException:
            if self._connect is not None:
                conn.rollback()
            raise
        finally:
            if self._connect is not None:
                conn.close()

    @contextmanager
    def transaction(
        self,
        idempotency_key: str,
        attempts: int,
        result: Any = None,
        *,
        result_of: Callable[[], Any] | None = None,
        workflow: str | None = None,
    ) -> Iterator[Any]:
        """The handler's connection (from `connect`); the completion is recorded only if it commits."""
        with self._connection() as conn:
            yield conn
            if result_of is not None:
                result = result_of()
            with self._lock:
                row = self._holds(idempotency_key, attempts)
                if row is None:
                    raise LeaseLostError(f"lease of {idempotency_key!r} attempt {attempts} was taken over")
                if self._connect is not None:
                    conn.commit()
                self._complete(row, result)
                if workflow is not None:
                    advance(self._nodes(), step_ends([(workflow, idempotency_key, "completed")]))

    def _complete(self, row: _Row, result: Any) -> None:
        now = self._clock()
        row.state, row.result, row.completed_at, row.updated_at = "completed", _stored(result), now, now
        row.lease_owner, row.lease_expires_at, row.last_error = None, None, None

    def prepare_thread(self) -> None:
        """Nothing to open ahead: the fake's connections are made per transaction."""

    def run_group(self, members: Sequence[Member]) -> None:
        """Run transactional attempts together and record the completions of those that returned, all or
        nothing (as IdempotencyStore; a fake connection from `connect` has no savepoints)."""
        with self._connection() as conn:
            for member in members:
                if member.skip():
                    member.error = NotStarted(f"{member.idempotency_key}: not started")
                    continue
                started = time.monotonic()
                try:
                    member.result = member.call(conn)
                except Exception as exc:
                    member.error = exc
                member.seconds = time.monotonic() - started
            with self._lock:
                done = [m for m in members if m.error is None]
                lost = frozenset(
                    m.idempotency_key for m in done if not self._holds(m.idempotency_key, m.attempts)
                )
                if lost:
                    raise LeaseLostError(f"leases taken over during a group commit: {sorted(lost)}", lost)
                if self._connect is not None:
                    conn.commit()
                for m in done:
                    self._complete(self.rows[m.idempotency_key], m.result)

    def get(self, idempotency_key: str) -> dict[str, Any] | None:
        """The record of one key, or None."""
        with self._lock:
            row = self.rows.get(idempotency_key)
            if row is None:
                return None

            def at(t: float | None) -> datetime | None:
                return None if t is None else datetime.fromtimestamp(t, UTC)

            return {
                "idempotency_key": idempotency_key,
                "task_id": row.task_id,
                "task_type": row.task_type,
                "state": row.state,
                "attempts": row.attempts,
                "takeovers": row.takeovers,
                "interruptions": row.interruptions,
                "started": row.started,
                "lease_owner": row.lease_owner,
                "lease_expires_at": at(row.lease_expires_at),
                "last_error": row.last_error,
                "result": row.result,
                "created_at": at(row.created_at),
                "updated_at": at(row.updated_at),
                "completed_at": at(row.completed_at),
                "cancel_requested": row.cancel_requested,
                "dlq_partition": None if row.dlq is None else row.dlq[0],
                "dlq_offset": None if row.dlq is None else row.dlq[1],
            }

    def find(self, task_id: str) -> dict[str, Any] | None:
        """The record of the task with this id, or None (as Postgres: the latest updated of its keys)."""
        with self._lock:
            keys = [k for k, r in self.rows.items() if r.task_id == task_id]
            key = max(keys, key=lambda k: self.rows[k].updated_at, default=None)
        return None if key is None else self.get(key)

    def cancel(self, idempotency_key: str, task_id: str = "") -> tuple[str, int, bool]:
        """Cancel a key (as Postgres): (its state before, or "unknown"; its attempts; whether a worker held
        it). A key without a record, waiting for an attempt or for a new owner ends cancelled; a running one
        is asked to stop; a finished one stays as it is."""
        with self._lock:
            now = self._clock()
            row = self.rows.get(idempotency_key)
            if row is None:
                self.rows[idempotency_key] = _Row(
                    task_id, "", "cancelled", 0, None, None, created_at=now, updated_at=now, completed_at=now,
                    cancel_requested=True,
                )  # fmt: skip
                return "unknown", 0, False
            before, held = row.state, row.state == "running" and row.lease_owner is not None
            if before in ("running", "failed"):
                row.cancel_requested, row.updated_at = True, now
                if not held:
                    row.state, row.completed_at = "cancelled", now
                    row.lease_owner = row.lease_expires_at = None
            return before, row.attempts, held

    def cancel_requested(self, idempotency_keys: Sequence[str]) -> set[str]:
        """Which of these keys were asked to stop."""
        with self._lock:
            return {k for k in idempotency_keys if k in self.rows and self.rows[k].cancel_requested}

    def reset_for_replay(self, idempotency_key: str) -> bool:
        """Start a dead key's attempts over (DLQ replay); False if it is not dead."""
        with self._lock:
            row = self.rows.get(idempotency_key)
            if row is None or row.state != "dead":
                return False
            row.state, row.attempts, row.updated_at = "failed", 0, self._clock()
            row.takeovers = row.interruptions = 0
            return True

    def purge(self, ttl_seconds: float, *, batch: int = 10_000, keep: Sequence[str] = ()) -> int:
        """Delete completed and dead records older than the TTL, except the keys in `keep`."""
        with self._lock:
            cutoff = self._clock() - ttl_seconds
            kept = set(keep)
            old = [
                k
                for k, r in self.rows.items()
                if r.state in ("completed", "dead", "cancelled") and r.updated_at < cutoff and k not in kept
            ]
            for k in old:
                del self.rows[k]
            return len(old)

    def counts(self) -> dict[str, int]:
        """Number of records per state."""
        with self._lock:
            out: dict[str, int] = {}
            for r in self.rows.values():
                out[r.state] = out.get(r.state, 0) + 1
            return out

    def retries(self) -> tuple[int, int]:
        """(tasks that needed more than one attempt, attempts beyond the first)."""
        with self._lock:
            again = [r.attempts - 1 for r in self.rows.values() if r.attempts > 1]
            return len(again), sum(again)

    def replayed(self, topic: str) -> dict[int, tuple[datetime, int]]:
        """The replayed offsets of a DLQ topic: when, and how many times."""
        with self._lock:
            return {offset: r for (t, offset), r in self.replays.items() if t == topic}

    def replayed_between(self, topic: str, start: int, end: int) -> int:
        """How many records of an offset range were replayed."""
        return sum(1 for offset in self.replayed(topic) if start <= offset < end)

    @contextmanager
    def replaying(
        self, *, topic: str, offset: int, task_id: str, idempotency_key: str, force: bool
    ) -> Iterator[int | None]:
        """Mark a record replayed for the block (None: replayed before and not forced); the mark stays
        only if the block exits cleanly, and a concurrent replay waits for it (as PostgresReplayLog)."""
        with self._replay_lock:
            before = self.replays.get((topic, offset))
            if before is not None and not force:
                yield None
                return
            count = (before[1] if before else 0) + 1
            yield count  # an exception here (the send failed) leaves no mark
            with self._lock:
                self.replays[(topic, offset)] = (datetime.fromtimestamp(self._clock(), UTC), count)

    def close(self) -> None:
        """Nothing to release."""
