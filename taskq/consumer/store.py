"""The idempotency store: one Postgres row per idempotency key, claimed with a lease before a task runs."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import psycopg
from psycopg.pq import TransactionStatus

from taskq._core.db import Connection, Database, Row, Transaction, in_transaction
from taskq._core.errors import StoreUnavailableError, TaskqError
from taskq._core.store import (
    Claim,
    ClaimOutcome,
    ClaimRequest,
    Finished,
    Pauses,
    SlotRequest,
    Store,
    WorkerRecord,
    pause_target,
)
from taskq._core.workflows import STEP_ENDS, PostgresNodes, advance, parse_header, step_ends, workflow_inputs

__all__ = [
    "Claim",
    "ClaimOutcome",
    "ClaimRequest",
    "Finished",
    "IdempotencyStore",
    "LeaseLostError",
    "Member",
    "NotStarted",
    "Pauses",
    "SlotRequest",
    "TaskStore",
    "WorkerRecord",
]

#: Liveness records silent for longer than this are forgotten (seconds): longer than any lease lasts, so
#: a key leased by a forgotten worker is free by then anyway.
FORGET_WORKERS_AFTER = 24 * 3600.0

#: Groups run without a savepoint per member while fewer than this share of recent groups had a member
#: that raised. A savepoint is a statement and a subtransaction a member, a quarter of an exactly-once
#: task's cost. Without them a member that raises before sending a statement costs nothing more, but one
#: that raises after costs its group a second pass, with them. Counted over about the last eight groups (a
#: moving average), so a task type that keeps failing turns them back on within two or three groups, and
#: they go again a few clean groups after it stops.
SAVEPOINTS_ABOVE = 0.2

#: How a pass of a group ended: committed; dropped because a member raised where it had no savepoint (run
#: it again with savepoints); dropped for a statement that failed at the server (run it again member by
#: member).
_COMMITTED, _RAISED, _FAILED = "committed", "raised", "failed"


class LeaseLostError(Exception):
    """Another worker took over this key's lease; this attempt's completion was not recorded."""

    def __init__(self, message: str, keys: frozenset[str] = frozenset()) -> None:
        super().__init__(message)
        #: The keys whose leases were lost (a group commit names the members it concerns).
        self.keys = keys


class NotStarted(TaskqError):
    """The group stopped before this attempt started: the worker is stopping or the partition was revoked."""


def _never() -> bool:
    return False


@dataclass(slots=True)
class Member:
    """One attempt of a group commit: its key, and the handler call to run on the group's connection.

    After the group ran: `error` is what the call raised (its writes rolled back, and no other's), or
    NotStarted if `skip()` was true when its turn came, or None and `result` what it returned; `seconds`
    its wall time.
    """

    idempotency_key: str
    attempts: int
    call: Callable[[Any], Any]
    skip: Callable[[], bool] = _never
    result: Any = None
    error: BaseException | None = None
    seconds: float = 0.0


class TaskStore(Protocol):
    """What a worker needs of the idempotency store: `IdempotencyStore`, or `taskq.testing.InMemoryStore`."""

    def claim(self, requests: Sequence[ClaimRequest]) -> list[Claim]: ...
    def finish(self, finished: Sequence[Finished]) -> set[str]: ...
    def finish_and_claim(
        self, finished: Sequence[Finished], requests: Sequence[ClaimRequest]
    ) -> tuple[set[str], list[Claim]]: ...
    def release(self, claims: Sequence[tuple[str, int]]) -> set[str]: ...
    def renew(self, leases: Sequence[tuple[str, int, float]]) -> set[str]: ...
    def mark_started(self, runs: Sequence[tuple[str, int]]) -> set[str]: ...
    def pauses(self) -> Pauses: ...
    def transaction(
        self,
        idempotency_key: str,
        attempts: int,
        result: Any = None,
        *,
        result_of: Callable[[], Any] | None = None,
        workflow: str | None = None,
    ) -> AbstractContextManager[Any]: ...
    def cancel_requested(self, idempotency_keys: Sequence[str]) -> set[str]: ...
    def workflow_ended(self, ends: Sequence[tuple[str, str, str]]) -> None: ...
    def workflow_inputs(self, workflow: str) -> tuple[Any, list[dict[str, Any]] | None]: ...
    def run_group(self, members: Sequence[Member]) -> None: ...
    def prepare_thread(self) -> None: ...
    def enter(self, worker: WorkerRecord, alive: Callable[[int], bool]) -> set[str]: ...
    def beat(self, worker: WorkerRecord, in_flight: int) -> None: ...
    def leave(self, worker_id: str) -> None: ...
    def acquire_slots(self, requests: Sequence[SlotRequest]) -> set[str]: ...
    def release_slots(self, idempotency_keys: Sequence[str]) -> None: ...
    def take_tokens(
        self, bucket: str, *, rate: float, capacity: float, want: float
    ) -> tuple[float, float, float]: ...
    def pause_tokens(self, bucket: str, *, rate: float, capacity: float, seconds: float) -> None: ...
    def close(self) -> None: ...


class IdempotencyStore:
    """Claims, completions and failures of one namespace's idempotency keys, batched: one round trip for
    many tasks. Namespaces sharing a database keep apart records of the same key."""

    def __init__(self, database: Database, *, owner: str, namespace: str, stale_after: float = 10.0) -> None:
        """`stale_after`: seconds after its last heartbeat when a worker is presumed dead and its keys are
        taken over by the next claim."""
        self.database = database
        self.owner = owner
        self.namespace = namespace
        self.stale_after = stale_after
        self._store = Store(database)
        self._lock = threading.Lock()
        self._local = threading.local()
        self._thread_conns: list[Connection] = []
        self._slots_conn: Connection | None = None
        self._wf_conn: Connection | None = None
        #: The recent share of groups with a member that raised (see SAVEPOINTS_ABOVE).
        self._raising = 0.0

    def claim(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """Claim each key for one attempt; answers in request order. A key twice in one batch: 'duplicate'."""
        unique: dict[str, ClaimRequest] = {}
        for r in requests:
            unique.setdefault(r.idempotency_key, r)
        claims = (
            self._store.claim(self.namespace, self.owner, list(unique.values()), stale_after=self.stale_after)
            if unique
            else []
        )
        return _in_request_order(requests, claims)

    def finish(self, finished: Sequence[Finished]) -> set[str]:
        """Record completions and failures; returns the keys whose lease was lost (nothing recorded)."""
        return self.finish_and_claim(finished, [])[0]

    def finish_and_claim(
        self, finished: Sequence[Finished], requests: Sequence[ClaimRequest]
    ) -> tuple[set[str], list[Claim]]:
        """`finish(finished)`, then `claim(requests)`: (the keys whose lease was lost, the claims).

        One round trip and one transaction, where the worker's loop had a claim and a completion
        statement, each with its own commit. A key finished here and claimed again (a redelivered copy) is
        answered as finished. Steps of workflows end on a connection of their own (`_finish_steps`), before
        the round trip.
        """
        if any(f.workflow is not None for f in finished):
            return self._finish_steps(finished), self.claim(requests) if requests else []
        unique = list({r.idempotency_key: r for r in requests[::-1]}.values())  # each key once
        done = [f for f in finished if f.state == "completed"]
        failed = [f for f in finished if f.state != "completed"]
        completed, recorded, claims = self._store.finish_and_claim(
            self.namespace, self.owner, done, failed, unique, stale_after=self.stale_after
        )
        lost = {f.idempotency_key for f in done} - completed | {f.idempotency_key for f in failed} - recorded
        return lost, _in_request_order(requests, claims)

    def _finish_steps(self, finished: Sequence[Finished]) -> set[str]:
        """`finish` for a batch holding steps of workflows: the outcomes and what they move on, in one
        transaction (on a connection of its own, kept)."""
        done = [f for f in finished if f.state == "completed"]
        failed = [f for f in finished if f.state != "completed"]
        conn = self._workflow_connection()
        try:
            with self.database.transaction(conn) as tx:
                states = dict.fromkeys(
                    self._store.complete(self.namespace, self.owner, done, tx=tx) if done else (), "completed"
                )
                if failed:
                    states.update(self._store.fail_states(self.namespace, self.owner, failed, tx=tx))
                steps = [
                    (f.workflow, f.idempotency_key, states[f.idempotency_key])
                    for f in finished
                    if f.workflow is not None and states.get(f.idempotency_key) in STEP_ENDS
                ]
                # Exactly once: the next steps are staged in the transaction that records these outcomes.
                advance(PostgresNodes(tx, self.namespace), step_ends(steps))
        except StoreUnavailableError:
            conn.close()
            raise
        return {f.idempotency_key for f in finished} - set(states)

    def workflow_ended(self, ends: Sequence[tuple[str, str, str]]) -> None:
        """Record the ends of workflow steps this worker skipped, (workflow header, key, state): cancelled
        before they started, or completed or dead already (a redelivery). A step that ended already is not
        ended again."""
        steps = step_ends(ends)
        if not steps:
            return
        with self.database.transaction(self._workflow_connection()) as tx:
            advance(PostgresNodes(tx, self.namespace), steps)

    def workflow_inputs(self, workflow: str) -> tuple[Any, list[dict[str, Any]] | None]:
        """(ctx.parent_result, ctx.group_results) of a workflow's step, read when its handler asks."""
        workflow_id, node = parse_header(workflow)
        return workflow_inputs(PostgresNodes(self.database, self.namespace), workflow_id, node)

    def _workflow_connection(self) -> Connection:
        conn = self._wf_conn
        if conn is None or conn.closed or conn.broken:
            conn = self._wf_conn = self.database.connect(autocommit=False, keyed=True)
        return conn

    def release(self, claims: Sequence[tuple[str, int]]) -> set[str]:
        """Give back (key, attempt) claims whose attempts never started: the attempt is uncounted and the
        key can be claimed at once. Returns the keys released (the others' leases were taken over)."""
        return self._store.release(self.namespace, self.owner, claims) if claims else set()

    def renew(self, leases: Sequence[tuple[str, int, float]]) -> set[str]:
        """Extend (key, attempt, seconds from now) leases; returns the keys renewed (the others were lost)."""
        return self._store.renew(self.namespace, self.owner, leases) if leases else set()

    def mark_started(self, runs: Sequence[tuple[str, int]]) -> set[str]:
        """Mark (key, attempt) runs started, so that their worker's death counts as an interruption; returns
        the keys marked (the others' leases were lost)."""
        return self._store.mark_started(self.namespace, self.owner, runs) if runs else set()

    def cancel_requested(self, idempotency_keys: Sequence[str]) -> set[str]:
        """Which of these keys (tasks this worker runs) were asked to stop: what ctx.cancelled says."""
        if not idempotency_keys:
            return set()
        return self._store.cancel_requested(self.namespace, idempotency_keys)

    def pause(self, kind: str, name: str) -> bool:
        """Pause a tier or a task type (kind "tier" or "task_type"); False if it was paused already."""
        return self._store.pause(self.namespace, *pause_target(kind, name))

    def resume(self, kind: str, name: str) -> bool:
        """Resume a tier or a task type; False if it was not paused."""
        return self._store.resume(self.namespace, *pause_target(kind, name))

    def pauses(self) -> Pauses:
        """What operators paused in the namespace (`taskq pause`): one query, read every few seconds."""
        rows = self._store.pauses(self.namespace)
        return Pauses(
            tiers=frozenset(name for kind, name, _ in rows if kind == "tier"),
            task_types=frozenset(name for kind, name, _ in rows if kind == "task_type"),
        )

    @contextmanager
    def transaction(
        self,
        idempotency_key: str,
        attempts: int,
        result: Any = None,
        *,
        result_of: Callable[[], Any] | None = None,
        workflow: str | None = None,
    ) -> Iterator[Connection]:
        """A connection in a transaction that records the key's completion when the block exits cleanly, with
        `result` (or what `result_of()` returns then) as its result; for a step of a workflow (its header
        `workflow`), the workflow moves on in that transaction too.

        The handler's writes and the completion commit together or not at all: exactly-once for effects in
        Postgres. LeaseLostError (and a rollback) if another worker took the lease meanwhile.
        """
        conn = self._thread_connection()
        try:
            with self.database.transaction(conn) as tx:
                yield conn
                if result_of is not None:
                    result = result_of()
                done = Finished(idempotency_key, attempts, "completed", result=result)
                if not self._store.complete(self.namespace, self.owner, [done], tx=tx):
                    # Raised inside the transaction, so the handler's writes roll back with it.
                    raise LeaseLostError(f"lease of {idempotency_key!r} attempt {attempts} was taken over")
                if workflow is not None:
                    # Exactly once: the next step is staged in the transaction that records this completion.
                    step = (workflow, idempotency_key, "completed")
                    advance(PostgresNodes(tx, self.namespace), step_ends([step]))
        finally:
            self._check_in(conn)

    def run_group(self, members: Sequence[Member]) -> None:
        """Run transactional attempts in one transaction on one connection (group commit).

        A call that raises is rolled back alone and keeps its error. The completions of the others are
        recorded in the same transaction, so the commit makes every effect and its completion durable
        together, and a failed commit raises (the driver's error) and leaves none. If another worker took
        over a member's lease, the whole group is rolled back: LeaseLostError names the lost keys, and
        nothing of the group is recorded.

        The members' statements are pipelined: sent as they are made, answered together at the end, so a
        group costs a few round trips, not one per statement. While members seldom raise, they run without
        a savepoint each (SAVEPOINTS_ABOVE). A member that raises before sending a statement has nothing to
        roll back, and the pass goes on; one that raises after drops the pass, and the group runs again
        with a savepoint per member, the members before it and itself called a second time. A statement that
        fails at the server cannot be told from the others' there: the group is then rolled back whole and
        run again with each member answered before the next, so the failing member fails alone. Either way
        only the last call's writes count.
        """
        conn = self._thread_connection()
        try:
            savepoints = self._raising >= SAVEPOINTS_ABOVE
            ended = self._run_members(conn, members, savepoints=savepoints, answer_each=False)
            if ended == _RAISED:
                _restart(members)
                ended = self._run_members(conn, members, savepoints=True, answer_each=False)
            if ended == _FAILED:
                _restart(members)
                self._run_members(conn, members, savepoints=True, answer_each=True)
            raised = any(m.error is not None and not isinstance(m.error, NotStarted) for m in members)
            # Groups run side by side on their threads: an update lost between two of them is harmless.
            self._raising += (raised - self._raising) / 8
        finally:
            self._check_in(conn)

    def _run_members(
        self, conn: Connection, members: Sequence[Member], *, savepoints: bool, answer_each: bool
    ) -> str:
        """One pass of `run_group`: how it ended (_COMMITTED, _RAISED or _FAILED; only _COMMITTED when
        `answer_each`)."""
        # Autocommit for the pass, so the transaction below sends the only BEGIN: with it off, the driver
        # adds its own before the first statement (it cannot see the first BEGIN unanswered in the pipeline),
        # a statement and a server warning per group. Set on the client alone, no round trip.
        conn.autocommit = True
        try:
            return self._run_pass(conn, members, savepoints=savepoints, answer_each=answer_each)
        finally:
            if not conn.closed:
                conn.autocommit = False

    def _run_pass(
        self, conn: Connection, members: Sequence[Member], *, savepoints: bool, answer_each: bool
    ) -> str:
        ended = _FAILED
        with conn.pipeline() as pipeline:
            # Every command the driver sends in the pipeline, whichever cursor sends it, queues its result
            # here first: a member that queued none sent nothing, and its writes are none.
            queued = pipeline.result_queue = _Counted(pipeline.result_queue)
            # The group's transaction, its BEGIN and COMMIT sent with the group's statements: two round trips
            # a group (its statements and completions answered together, then the commit), where
            # `conn.transaction()` would sync the pipeline on entry and exit. Committed on a clean exit.
            with psycopg.Transaction(conn):
                if not queued.total:  # the BEGIN was not counted: a driver that queues elsewhere
                    savepoints = True
                cursor = conn.cursor()  # one cursor for every member's savepoint: none built per member
                for i, member in enumerate(members):
                    if isinstance(member.error, NotStarted) or member.skip():
                        member.error = member.error or NotStarted(f"{member.idempotency_key}: not started")
                        continue
                    started = time.monotonic()
                    # With `savepoints`, one per member, so a failing member rolls back alone. Never
                    # released: a RELEASE would be one more statement per member, and the group commits them
                    # all. Each its own name: a rollback to the savepoint of a member whose statements the
                    # server skipped fails, where a shared name would roll back an earlier member's failed
                    # writes and hide them.
                    savepoint = f"taskq_member_{i}" if savepoints else ""
                    if savepoint:
                        cursor.execute(f"SAVEPOINT {savepoint}", prepare=False)
                    before = queued.total
                    try:
                        member.result = member.call(conn)
                        if answer_each:
                            pipeline.sync()
                            if conn.info.transaction_status == TransactionStatus.INERROR:
                                # The handler swallowed its own statement's error: its writes are incomplete.
                                raise psycopg.errors.InFailedSqlTransaction(
                                    f"{member.idempotency_key}: a statement failed in the handler"
                                )
                    except Exception as exc:
                        member.error = exc
                        member.seconds = time.monotonic() - started
                        if not savepoints:
                            if queued.total == before and not isinstance(exc, psycopg.Error):
                                continue  # it sent nothing: nothing of it to roll back, and the pass goes on
                            # Its writes cannot be rolled back alone: this pass is dropped, and the group
                            # runs again with savepoints (member by member if a statement failed at the
                            # server). Answered first, as below: a ROLLBACK into an aborted pipeline fails.
                            if _answer(conn, pipeline) and not isinstance(exc, psycopg.Error):
                                ended = _RAISED
                            raise psycopg.Rollback from None
                        if answer_each:
                            _answer(conn, pipeline)  # statements it left queued: their errors are its own
                        cursor.execute(f"ROLLBACK TO SAVEPOINT {savepoint}", prepare=False)
                        if answer_each:
                            pipeline.sync()
                        continue
                    member.seconds = time.monotonic() - started
                # Delivery guarantee: a server-side failure in an unanswered pipeline may belong to any member
                # (a handler may have seen another's error), so nothing of this pass is kept; the caller runs
                # the group again one member at a time.
                if not answer_each and any(isinstance(m.error, psycopg.Error) for m in members):
                    # Answered first: the pipeline is aborted up to its next sync, and a ROLLBACK sent into
                    # it would come back aborted too (PipelineAborted when the pipeline closes).
                    _answer(conn, pipeline)
                    raise psycopg.Rollback
                ok = [m for m in members if m.error is None]
                done = [Finished(m.idempotency_key, m.attempts, "completed", result=m.result) for m in ok]
                recorded: Callable[[], set[str]] = set
                if done:
                    tx = Transaction(self.database, conn)
                    try:
                        recorded = self._store.send_complete(self.namespace, self.owner, done, tx=tx)
                    except StoreUnavailableError:
                        # The driver reads answers as they arrive: a member's failed statement answered by
                        # now is raised here, while sending the completions. Unless the connection is gone,
                        # that is a member's failure like any other: this pass is dropped and rerun.
                        if answer_each or conn.broken or conn.closed:
                            raise
                        _answer(conn, pipeline)
                        raise psycopg.Rollback from None
                if answer_each:
                    pipeline.sync()  # members were answered one by one: a failure here is the completions'
                elif not _answer(conn, pipeline):
                    raise psycopg.Rollback
                lost = frozenset(f.idempotency_key for f in done) - recorded()
                if lost:
                    # Raised inside the transaction: every member's writes roll back with it.
                    raise LeaseLostError(f"leases taken over during a group commit: {sorted(lost)}", lost)
                ended = _COMMITTED
        # Leaving the pipeline sent the COMMIT and waited for it: a failed commit raised the driver's error.
        return ended

    def enter(self, worker: WorkerRecord, alive: Callable[[int], bool]) -> set[str]:
        """Write the worker's liveness record, and mark dead the workers of its host started before it whose
        process is gone (`alive(pid)` false): their keys are taken over at once. Returns the ids marked dead.
        A host is one process id space: workers in containers that share a host name need their own."""
        self._store.worker_beat(worker, 0, stale_after=self.stale_after)
        gone = [worker_id for worker_id, pid in self._store.workers_on_host(worker) if not alive(pid)]
        marked = self._store.workers_mark_dead(gone) if gone else set()
        self._store.workers_prune(FORGET_WORKERS_AFTER)
        return marked

    def beat(self, worker: WorkerRecord, in_flight: int) -> None:
        """Write the worker's heartbeat: alive now, with `in_flight` tasks running."""
        self._store.worker_beat(worker, in_flight, stale_after=self.stale_after)

    def leave(self, worker_id: str) -> None:
        """Remove the worker's liveness record (a clean stop)."""
        self._store.worker_leave(worker_id)

    def acquire_slots(self, requests: Sequence[SlotRequest]) -> set[str]:
        """Take a concurrency slot for each task whose key has room (earlier requests of a key first), in one
        transaction; returns the idempotency keys granted. Slots of dead workers do not count."""
        unique = list({r.idempotency_key: r for r in requests}.values())
        if not unique:
            return set()
        conn = self._slots_conn
        if conn is None or conn.closed or conn.broken:
            # Kept between batches (a connect per dispatch would cost more than the acquire itself).
            conn = self._slots_conn = self.database.connect(autocommit=False, keyed=True)
        try:
            return self._store.acquire_slots(
                self.namespace, self.owner, unique, stale_after=self.stale_after, conn=conn
            )
        except StoreUnavailableError:
            conn.close()
            raise

    def release_slots(self, idempotency_keys: Sequence[str]) -> None:
        """Give back this worker's concurrency slots of these tasks."""
        if idempotency_keys:
            self._store.release_slots(self.namespace, self.owner, idempotency_keys)

    def take_tokens(
        self, bucket: str, *, rate: float, capacity: float, want: float
    ) -> tuple[float, float, float]:
        """Take up to `want` tokens of a shared bucket: (granted, tokens left, seconds still paused)."""
        return self._store.take_tokens(bucket, rate=rate, capacity=capacity, want=want)

    def pause_tokens(self, bucket: str, *, rate: float, capacity: float, seconds: float) -> None:
        """Empty a shared bucket and grant nothing from it for `seconds`, for every worker."""
        self._store.pause_tokens(bucket, rate=rate, capacity=capacity, seconds=seconds)

    def _check_in(self, conn: Connection) -> None:
        """After a handler's use: close a connection left in any state but idle (replaced next time)."""
        if conn.closed or in_transaction(conn):
            conn.close()
            self._local.conn = None

    def prepare_thread(self) -> None:
        """Open the calling thread's connection for transactional attempts now, not at its first one."""
        self._thread_connection()

    def _thread_connection(self) -> Connection:
        # One connection per executor thread, kept between tasks: a connect per task would cost more than
        # most handlers. A connection left in any state but idle is closed and replaced.
        conn: Connection | None = getattr(self._local, "conn", None)
        if conn is None or conn.closed or conn.broken:
            conn = self._local.conn = self.database.connect(autocommit=False)
            with self._lock:
                self._thread_conns = [c for c in self._thread_conns if not c.closed] + [conn]
        return conn

    def get(self, idempotency_key: str) -> Row | None:
        """The record of one key, or None."""
        return self._store.get(self.namespace, idempotency_key)

    def reset_for_replay(self, idempotency_key: str) -> bool:
        """Start a dead key's attempts over (DLQ replay); False if it is not dead (e.g. completed)."""
        return self._store.reset_for_replay(self.namespace, idempotency_key)

    def purge(self, ttl_seconds: float, *, batch: int = 10_000, keep: Sequence[str] = ()) -> int:
        """Delete completed and dead records older than the TTL, except the keys in `keep`; how many."""
        total = 0
        while True:
            n = self._store.purge(self.namespace, ttl_seconds, batch=batch, keep=keep)
            total += n
            if n < batch:
                return total

    def purge_workflows(self, ttl_seconds: float, *, batch: int = 1_000) -> int:
        """Delete workflows that ended more than the TTL ago, with their nodes; how many."""
        total = 0
        while True:
            n = self._store.workflow_purge(self.namespace, ttl_seconds, batch=batch)
            total += n
            if n < batch:
                return total

    def retries(self) -> tuple[int, int]:
        """(tasks that needed more than one attempt, attempts beyond the first), over all workers."""
        return self._store.retries(self.namespace)

    def purge_idle(self) -> tuple[int, int]:
        """Delete shared token buckets that refilled to the brim and this namespace's concurrency slots whose
        lease ended, rows that change nothing (each is written again on its next use): (buckets, slots)."""
        return self._store.purge_idle(self.namespace)

    def counts(self) -> dict[str, int]:
        """Number of records per state."""
        return self._store.counts(self.namespace)

    def close(self) -> None:
        """Close the connections (the loop's, and the handler threads' idle ones)."""
        self.database.close()
        for kept in (self._slots_conn, self._wf_conn):
            if kept is not None:
                kept.close()
        self._slots_conn = self._wf_conn = None
        with self._lock:
            for conn in self._thread_conns:
                if not conn.closed and not in_transaction(conn):
                    conn.close()
            self._thread_conns = []


class _Counted(deque[Any]):
    """A pipeline's queue of pending results that counts what is queued on it from now on (`total`); made
    from the queue it replaces, so results already pending stay in line."""

    total = 0

    def append(self, item: Any) -> None:
        self.total += 1
        super().append(item)


def _restart(members: Sequence[Member]) -> None:
    """Forget what a dropped pass left on the members, for the next one (one not started stays so)."""
    for member in members:
        if not isinstance(member.error, NotStarted):
            member.result, member.error, member.seconds = None, None, 0.0


def _answer(conn: Connection, pipeline: psycopg.Pipeline) -> bool:
    """Sync the pipeline; False if a statement failed or left the transaction failed."""
    try:
        pipeline.sync()
    except psycopg.Error:
        return False
    return conn.info.transaction_status != TransactionStatus.INERROR


def _in_request_order(requests: Sequence[ClaimRequest], claims: Sequence[Claim]) -> list[Claim]:
    """The claims of a batch's unique keys, answered per request: a key's second request is 'duplicate'."""
    by_key = {c.idempotency_key: c for c in claims}
    out: list[Claim] = []
    answered: set[str] = set()
    for r in requests:
        claim = by_key[r.idempotency_key]
        if r.idempotency_key in answered:
            out.append(Claim(r.idempotency_key, "duplicate", claim.attempts))
            continue
        answered.add(r.idempotency_key)
        out.append(claim)
    return out
