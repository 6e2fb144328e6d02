"""Dispatch, the worker's third stage: claimed tasks in, attempts started on the executor's slots out.

The buffers (the weighted scheduler, one queue per tier) hold claimed tasks; each pass starts what the free
slots, the concurrency and rate limits of limited task types, the key order of ordered ones, operators'
pauses and the quarantine of suspects allow, in weighted order (invariant 4). Transactional tasks ready
together share a slot and a transaction (group commit). A suspect (a key taken over from a dead worker)
runs alone (invariant 10). Attempts report on the worker's queue of outcomes.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

from taskq._core.broker import TP
from taskq._core.envelope import PRIORITIES
from taskq._core.errors import StoreUnavailableError, TaskqError
from taskq._core.logs import OUTAGE
from taskq._core.tracing import Tracer
from taskq.consumer.claims import Claims
from taskq.consumer.completer import Completer
from taskq.consumer.events import Reporter
from taskq.consumer.executor import Executor, Job, Outcome, failure
from taskq.consumer.handlers import TaskContext
from taskq.consumer.intake import Task
from taskq.consumer.limits import Limits
from taskq.consumer.offsets import Offsets
from taskq.consumer.outcomes import checked_result
from taskq.consumer.scheduler import PriorityScheduler
from taskq.consumer.store import Finished, LeaseLostError, Member, NotStarted, Pauses, TaskStore

if TYPE_CHECKING:
    from taskq.consumer.worker import WorkerConfig

__all__ = ["GROUP_MAX", "GROUP_WINDOW", "Dispatch", "GroupRolledBack"]

log = logging.getLogger("taskq.worker")

#: Most transactional attempts in one group commit: each is a subtransaction, and past 64 in one
#: transaction Postgres's snapshots overflow their subtransaction cache (slower for every session).
GROUP_MAX = 50
#: A group starts no member after it has run this long (seconds): slow tasks commit in small groups, and
#: no effect waits long for the rest of its group.
GROUP_WINDOW = 0.05
#: A wave of group commits waits at most this long (seconds) for the claims in flight.
WAVE_WAIT = 0.05


class GroupRolledBack(TaskqError):
    """The attempt's group commit was rolled back because of another attempt in it; it runs again."""


def _key(task: Task) -> tuple[TP, bytes | None]:
    """What an ordered task type serializes on: its partition and message key."""
    return task.record.tp, task.record.key


@cache
def _task_logger(task_type: str) -> logging.Logger:
    """The logger a task type's handlers get (`ctx.logger`): looked up once per type, not per task."""
    return logging.getLogger(f"taskq.task.{task_type}")


class Dispatch:
    """Starts claimed tasks from the buffers on the executor's slots."""

    def __init__(
        self,
        scheduler: PriorityScheduler[Task],
        executor: Executor,
        claims: Claims,
        limits: Limits,
        store: TaskStore,
        completer: Completer,
        offsets: Offsets,
        tracer: Tracer,
        reported: queue.SimpleQueue[tuple[Task, Outcome] | None],
        *,
        config: WorkerConfig,
        group: str,
        group_commits: bool,
        stop: threading.Event,
        report: Reporter,
        clock: Callable[[], float],
    ) -> None:
        """`reported`: where attempts put their outcomes; `group_commits`: whether any handler's attempts
        run in group commits; `stop`: set once the worker stops (group members not started yet stay so)."""
        self.scheduler = scheduler
        self._executor = executor
        self._claims = claims
        self._limits = limits
        self._store = store
        self._completer = completer
        self._offsets = offsets
        self._tracer = tracer
        self._outcomes = reported
        self._config = config
        self._group = group
        self._groups = group_commits
        self._stop = stop
        self._report = report
        self._clock = clock
        self.running: dict[int, Task] = {}
        # Tasks of a paused task type, claimed and held out of the scheduler until the type is resumed.
        self.on_hold: list[Task] = []
        self.pauses = Pauses()
        self._pauses_read_at = -float("inf")
        # Ordered task types: the task that holds each (partition, key) while it runs or waits to retry.
        self._key_holder: dict[tuple[TP, bytes | None], int] = {}
        self.revoking: set[TP] = set()  # partitions whose revocation is being served
        # Recent group members' run time, a moving average; until members have run, a guess that starts
        # groups of about 8 (pops a group gives back unstarted cost weighted order its precision).
        self._member_seconds = GROUP_WINDOW / 8
        self._quarantine: Task | None = None  # the suspect running alone, until its outcome is recorded
        self._suspect_waits = False  # a suspect is next: nothing starts until the running tasks end
        self._members_running = 0  # members of group commits started and not reported yet

    def ended(
        self, reported: Sequence[tuple[Task, Outcome]]
    ) -> tuple[list[tuple[Task, Outcome]], list[Task]]:
        """Attempts that reported leave the slots. Returns those that ran, for the outcomes stage, and the
        group members never started whose claims are to be given back; the others (past their group's
        window) are back in the buffer, still claimed."""
        ended: list[tuple[Task, Outcome]] = []
        unstarted: list[Task] = []
        for task, outcome in reported:
            self.running.pop(id(task), None)
            if task.gate is not None:
                self._limits.release(task.envelope.idempotency_key)  # the attempt ended (or never started)
            if task.grouped:
                self._members_running -= 1
                if isinstance(outcome.error, NotStarted):
                    task.grouped = False
                    tp = task.record.tp
                    current = self._offsets.current(tp, task.generation)
                    if current and not self._stop.is_set() and tp not in self.revoking:
                        self.scheduler.push_front(task.tier, task)  # past its group's window: still claimed
                    else:
                        unstarted.append(task)  # its claim is given back; its offset stays uncommitted
                    continue
                self._member_seconds += (outcome.seconds - self._member_seconds) / 8
            ended.append((task, outcome))
        return ended, unstarted

    def where(self, match: Callable[[Task], bool]) -> str | None:
        """Where the task `match` picks is in this stage, in words (for a warning), or None."""
        for task in self.running.values():
            if match(task):
                quarantined = " (a suspect, running alone)" if task is self._quarantine else ""
                return f"task {task.envelope.task_id} is running, attempt {task.attempts}{quarantined}"
        for task in self.scheduler:
            if match(task):
                return f"task {task.envelope.task_id} waits for a slot{self._blocked()}"
        for task in self.on_hold:
            if match(task):
                return f"task {task.envelope.task_id} is on hold: its task type is paused"
        if self._quarantine is not None and match(self._quarantine):
            return f"task {self._quarantine.envelope.task_id} ran as a suspect; its outcome is being recorded"
        return None

    def _blocked(self) -> str:
        """What holds every task back, if something does (for a warning)."""
        if self._quarantine is not None:
            suspect = self._quarantine.envelope.task_id
            return f" (nothing starts until suspect {suspect}'s outcome is recorded)"
        if self._suspect_waits:
            return " (a suspect waits for the running tasks to end)"
        return ""

    def drop(self, revoked: set[TP]) -> list[Task]:
        """Take the buffered and paused tasks of revoked partitions out (their claims are to be given back),
        and forget their keys' order."""
        dropped = self.scheduler.remove_if(lambda t: t.record.tp in revoked)
        dropped += [t for t in self.on_hold if t.record.tp in revoked]
        self.on_hold = [t for t in self.on_hold if t.record.tp not in revoked]
        self._key_holder = {k: v for k, v in self._key_holder.items() if k[0] not in revoked}
        return dropped

    def drop_all(self) -> list[Task]:
        """Take every buffered and paused task out (shutdown: their claims are to be given back)."""
        dropped = self.scheduler.remove_if(lambda t: True) + self.on_hold
        self.on_hold = []
        return dropped

    def ready(self, tasks: list[Task]) -> None:
        """Claimed tasks go into the buffers, for dispatch in weighted order."""
        push = self.scheduler.push
        for task in tasks:
            push(task.tier, task)

    def read_pauses(self) -> None:
        """Every `pause_interval` seconds: read what operators paused, give resumed tasks back to the
        scheduler, and renew the leases of paused tasks that wait long, so no other worker takes them over."""
        now = self._clock()
        if now - self._pauses_read_at < self._config.pause_interval:
            return
        self._pauses_read_at = now
        self._read_cancels()
        try:
            pauses = self._store.pauses()
        except StoreUnavailableError as exc:  # the last known state holds meanwhile
            log.warning("cannot read pauses: %s", exc, extra=OUTAGE)
            return
        if pauses != self.pauses:
            log.info(
                "paused tiers: %s; paused task types: %s",
                ", ".join(sorted(pauses.tiers)) or "none",
                ", ".join(sorted(pauses.task_types)) or "none",
            )
            self.pauses = pauses
        resumed = [t for t in self.on_hold if t.envelope.task_type not in pauses.task_types]
        if resumed:
            self.on_hold = [t for t in self.on_hold if t.envelope.task_type in pauses.task_types]
            for task in reversed(resumed):  # first in line again, in their order
                self.scheduler.push_front(task.tier, task)
        stale = now - self._config.claim_wait / 2
        waiting = [t for t in self.on_hold if t.claimed_at < stale]
        waiting += [t for t in self.scheduler if t.tier in pauses.tiers and t.claimed_at < stale]
        if not waiting:
            return
        # A paused task keeps its claim: its lease is renewed while it waits, and no attempt is counted.
        try:
            renewed = self._store.renew(
                [
                    (t.envelope.idempotency_key, t.attempts, self._claims.lease(t) + self._config.claim_wait)
                    for t in waiting
                ]
            )
        except StoreUnavailableError as exc:
            log.warning(
                "could not renew the leases of %d paused task(s): %s", len(waiting), exc, extra=OUTAGE
            )
            return
        lost = {id(t) for t in waiting if t.envelope.idempotency_key not in renewed}
        for task in waiting:
            if id(task) in lost:
                # Taken over while paused: the worker holding the lease now decides this key.
                log.warning("task %s: lease taken over while paused", task.envelope.task_id)
                self.done(task)
            else:
                task.claimed_at = now
        if lost:
            self.on_hold = [t for t in self.on_hold if id(t) not in lost]
            self.scheduler.remove_if(lambda t: id(t) in lost)

    def _read_cancels(self) -> None:
        """With the pauses: which tasks that run here or wait claimed in the buffer were cancelled. A running
        one's handler sees ctx.cancelled; a waiting one never starts: its attempt is recorded failed, which
        a cancelled key's record turns into cancelled (no retry, no DLQ), and its offset moves on."""
        running = [t for t in self.running.values() if t.ctx is not None and not t.ctx.cancelled]
        waiting = [*self.scheduler, *self.on_hold]
        if not running and not waiting:
            return
        try:
            asked = self._store.cancel_requested([t.envelope.idempotency_key for t in (*running, *waiting)])
        except StoreUnavailableError as exc:
            log.warning("cannot read cancellations: %s", exc, extra=OUTAGE)
            return
        if not asked:
            return
        for task in running:
            if task.envelope.idempotency_key in asked and task.ctx is not None:
                task.ctx.cancelled = True
        dropped = {id(t): t for t in waiting if t.envelope.idempotency_key in asked}
        if not dropped:
            return
        self.scheduler.remove_if(lambda t: id(t) in dropped)
        self.on_hold = [t for t in self.on_hold if id(t) not in dropped]
        for task in dropped.values():
            env = task.envelope
            self._report.cancelled_skipped(env)
            self._completer.record(
                Finished(
                    env.idempotency_key,
                    task.attempts,
                    "failed",
                    error="cancelled before it started",
                    workflow=task.workflow,
                ),
                lambda task=task: self.done(task),  # type: ignore[misc]
            )

    def dispatch(self) -> None:
        """Start claimed tasks in weighted order, one slot each; transactional tasks ready together share
        a slot and a transaction (group commit), in as few groups as GROUP_MAX allows. A suspect (a key
        taken over from a dead worker) runs alone, outside any group (invariant 10)."""
        if self._quarantine is not None:
            return  # a suspect runs: nothing starts beside it until its outcome is recorded
        free = self._executor.free_slots()
        if not free or not len(self.scheduler) or (self._suspect_waits and self.running):
            return  # (a suspect waits for the tasks running to end)
        self._suspect_waits = False
        wave = len(self.scheduler) // 2
        if self._groups and not self._members_running and self._short_of_wave(wave, free):
            # A wave of group commits is due (below). It takes up to half the buffer at once, in weighted
            # order: a tier whose refetched records are still being claimed would miss its turns in it,
            # and the tiers buffered would take them (invariant 4). Postgres answers in milliseconds.
            self._completer.wait_claimed(WAVE_WAIT)
        # At most half of what is buffered goes into the groups of one dispatch: the rest, and what is
        # fetched meanwhile, keeps the weighted order deciding what runs next. That half goes into as few
        # groups as the members' pace allows, not one per free slot: a group's transaction, completion
        # statement and commit are shared by more attempts.
        half = len(self.scheduler) // 2
        size = self._group_fits()
        groups = min(free, -(-half // size)) if half > free else free
        per_group = min(size, -(-half // groups)) if half > free else 1
        # Groups start in waves, never beside the groups of an earlier dispatch: groups run side by side
        # member by member, and the members of one wave are dealt out in turn (below), so effects land in
        # the order of the picks. Groups started one by one as others end would each run a stretch of
        # picks at once, and a tier's share over a window would depend on which stretches it cut.
        most = groups * per_group if not self._members_running else 0  # members of this dispatch's groups
        singles: list[Task] = []
        members: list[Task] = []
        # Ordered tasks whose key is held by an earlier task, and limited tasks whose key has no slot or
        # token now: they keep their place in the buffer, and the tasks behind them go by.
        waiting: list[Task] = []
        popped: dict[int, int] = {}  # pop order, to put the waiting tasks back in place
        while True:
            used = len(singles) + -(-len(members) // per_group)
            open_group = len(members) % per_group != 0 and len(members) < most
            if used >= free and not open_group:
                break
            task = self.scheduler.pop(skip=self.pauses.tiers)
            if task is None:
                break
            if task.envelope.task_type in self.pauses.task_types:
                self.on_hold.append(task)  # claimed, and held until its type is resumed
                continue
            popped[id(task)] = len(popped)
            if task.spec.ordered and self._key_holder.get(_key(task), id(task)) != id(task):
                waiting.append(task)
                continue
            if task.gate is not None and not self._limits.ready(task.gate):
                waiting.append(task)
                continue
            if task.suspect:
                # Quarantine: blamed for its worker's death only if it ran alone, a suspect starts only
                # when nothing else runs, and nothing else starts until its outcome is recorded.
                if singles or members or self.running:
                    self.scheduler.push_front(task.tier, task)  # next in line (its pick is refunded)
                    self._suspect_waits = True
                else:
                    singles.append(task)
                    self._hold_key(task)
                break
            # A workflow's step commits alone: the transaction recording its end also moves the workflow on.
            if not (task.spec.transactional and task.spec.group_commit) or task.workflow is not None:
                if used >= free:  # only the open group had room: the task waits, first in line
                    self.scheduler.push_front(task.tier, task)
                    break
                singles.append(task)
                self._hold_key(task)
                continue
            if len(members) >= most or (not open_group and used >= free):
                self.scheduler.push_front(task.tier, task)
                break
            members.append(task)
            self._hold_key(task)
        # Members are dealt to the groups in turn, not in runs: groups run side by side, member by member,
        # so effects land in the order of the picks, and weighted order holds over any window of them.
        n = -(-len(members) // per_group)
        jobs: list[list[Task]] = [[t] for t in singles] + [members[i::n] for i in range(n)]
        gated = [t for job in jobs for t in job if t.gate is not None]
        if gated:
            # One round trip for the batch's slots, one per bucket whose leased tokens ran out: a task
            # refused waits, claimed, and has used up no attempt.
            admitted = self._limits.admit(
                [(t.envelope.idempotency_key, t.gate, self._claims.lease(t)) for t in gated if t.gate]
            )
            refused = {id(t) for t in gated if t.envelope.idempotency_key not in admitted}
            if refused:
                for job in jobs:
                    for t in job:
                        if id(t) in refused:
                            self._free_key(t)
                            waiting.append(t)
                jobs = [[t for t in job if id(t) not in refused] for job in jobs]
        stale = self._clock() - self._config.claim_wait / 2
        waited = [t for job in jobs for t in job if t.claimed_at < stale]
        # Limited tasks waiting for their key keep their claims: renewed as they age, as the others at start.
        parked = [t for t in waiting if t.gate is not None and t.claimed_at < stale]
        lost: set[int] = set()
        if waited or parked:
            # One statement renews every long-waiting task of this dispatch; those not renewed are dropped.
            lost = {id(t) for t in waited + parked} - {id(t) for t in self._claims.renew(waited, parked)}
        suspects = [t for job in jobs for t in job if t.suspect and id(t) not in lost]
        if suspects:
            # Keys taken over before may be poison pills: their runs are marked started before they start, so
            # that this worker's death counts as an interruption. One statement for the dispatch, and only
            # after a worker died: the run of a plain key writes nothing before it starts.
            lost |= {id(t) for t in suspects} - {id(t) for t in self._claims.mark_started(suspects)}
        if lost:
            for job in jobs:
                for t in job:
                    if id(t) in lost:
                        self._free_key(t)
                        self._limits.release(t.envelope.idempotency_key)
            jobs = [[t for t in job if id(t) not in lost] for job in jobs]
            waiting = [t for t in waiting if id(t) not in lost]
        waiting.sort(key=lambda t: popped[id(t)])
        for task in reversed(waiting):
            self.scheduler.push_front(task.tier, task)
        for job in jobs:
            if job and job[0].suspect:
                self._quarantine = job[0]
                self._start(job[0])
            elif job and job[0].spec.transactional and job[0].spec.group_commit and not job[0].workflow:
                self._start_group(job)
            elif job:
                self._start(job[0])

    def _short_of_wave(self, wave: int, free: int) -> bool:
        """A wave of `wave` picks is due, and a tier whose records are being claimed holds less than its
        weighted share of it."""
        if wave <= free:
            return False
        capacity, claiming = self.scheduler.capacity, self._claims.claiming
        return any(
            claiming[t] and self.scheduler.depth(t) * capacity < wave * self.scheduler.reserve(t)
            for t in PRIORITIES
        )

    def _group_fits(self) -> int:
        """Members a group starts within GROUP_WINDOW, at the recent members' pace: a group popped larger
        gives the rest back unstarted, and weighted order is kept best by pops that start."""
        return max(1, min(GROUP_MAX, int(GROUP_WINDOW / max(self._member_seconds, 1e-6)) + 1))

    def _start(self, task: Task) -> None:
        env = task.envelope
        ctx = self._context(task)
        call = None
        if task.spec.transactional:
            spec, store, limit = task.spec, self._store, self._config.result_max_bytes
            workflow = task.workflow

            def call() -> Any:
                returned: list[Any] = [None]
                with store.transaction(
                    env.idempotency_key, task.attempts, result_of=lambda: returned[0], workflow=workflow
                ) as conn:
                    ctx.db = conn
                    # Checked inside the transaction: a result that cannot be stored rolls the effect back.
                    returned[0] = checked_result(spec.fn(task.payload, ctx), limit)
                task.recorded = True
                return returned[0]

        timeout = task.spec.timeout or env.timeout
        task.ctx = ctx
        self.running[id(task)] = task
        self._report.attempt_started(env, task.attempts, task.suspect)
        trace = None
        if self._tracer.active():
            task.span, trace = self._attempt_span(task)
        self._executor.submit(
            Job(spec=task.spec, payload=task.payload, ctx=ctx, timeout=timeout, call=call, trace=trace),
            lambda outcome: self._outcomes.put((task, outcome)),
        )

    def _attempt_span(self, task: Task) -> tuple[Any, contextvars.Context]:
        record = task.record
        return self._tracer.attempt(
            task.envelope, record.topic, task.attempts, self._group, record.partition, record.offset
        )

    def _context(self, task: Task) -> TaskContext:
        env = task.envelope
        workflow = task.workflow
        return TaskContext(
            task_id=env.task_id,
            task_type=env.task_type,
            attempt=task.attempts,
            max_attempts=env.max_attempts or task.spec.policy.max_attempts,
            idempotency_key=env.idempotency_key,
            priority=env.priority,
            headers=dict(task.record.headers),
            logger=_task_logger(env.task_type),
            workflow_inputs=None
            if workflow is None
            else functools.partial(self._store.workflow_inputs, workflow),
        )

    def _start_group(self, tasks: list[Task]) -> None:
        """Run transactional tasks one after another in one transaction on one slot (group commit)."""
        contexts = [self._context(t) for t in tasks]

        def member(task: Task, ctx: TaskContext) -> Member:
            timeout = task.spec.timeout or task.envelope.timeout

            def call(conn: Any) -> Any:
                ctx.db = conn
                ctx.deadline = time.monotonic() + timeout if timeout else None
                if self._tracer.active():
                    if task.span is not None:  # a call of a pass its group dropped: its writes rolled back
                        self._tracer.finish(task.span, "rerun")
                    task.span, trace = self._attempt_span(task)
                    returned = trace.run(task.spec.fn, task.payload, ctx)
                else:
                    returned = task.spec.fn(task.payload, ctx)
                # Checked under the member's savepoint: a result that cannot be stored rolls it back alone.
                return checked_result(returned, self._config.result_max_bytes)

            tp = task.record.tp
            # A member whose turn comes after SIGTERM or its partition's revocation is not started: the
            # group commits what ran, and shutdown and revoke wait for one attempt, not a whole group.
            # Nor one whose turn comes after the group's window: it goes back to the buffer, still
            # claimed, and a group's effects are never held back for long.
            return Member(
                task.envelope.idempotency_key,
                task.attempts,
                call,
                skip=lambda: self._stop.is_set() or tp in self.revoking or window_passed(),
            )

        began: list[float] = []

        def window_passed() -> bool:
            if not began:
                began.append(time.monotonic())
            return time.monotonic() - began[0] > GROUP_WINDOW

        members = [member(t, c) for t, c in zip(tasks, contexts, strict=True)]
        store = self._store

        def run() -> list[Member]:
            store.run_group(members)
            return members

        def report(outcome: Outcome) -> None:
            # One outcome per task: its own when the group committed; the group's when it did not (a
            # failed commit records nothing, so every task of the group runs again).
            for task, m in zip(tasks, members, strict=True):
                if isinstance(m.error, NotStarted):
                    self._outcomes.put((task, failure(m.error, 0.0)))
                elif not outcome.ok:
                    error = outcome.error
                    lost = isinstance(error, LeaseLostError) and m.idempotency_key in error.keys
                    if isinstance(error, LeaseLostError) and not lost:
                        error = GroupRolledBack(f"rolled back with its group: {error}")
                        self._outcomes.put((task, failure(error, m.seconds)))
                    else:
                        self._outcomes.put((task, outcome))
                elif m.error is not None:
                    self._outcomes.put((task, failure(m.error, m.seconds)))
                else:
                    task.recorded = True
                    self._outcomes.put((task, Outcome(ok=True, result=m.result, seconds=m.seconds)))

        timeouts = [t.spec.timeout or t.envelope.timeout for t in tasks]
        for task, ctx in zip(tasks, contexts, strict=True):
            task.ctx = ctx
            self.running[id(task)] = task
            task.grouped = True  # its start is reported when it reports: a member may never start
        self._members_running += len(tasks)
        self._executor.submit(
            Job(
                spec=tasks[0].spec,
                payload=None,
                ctx=contexts[0],
                timeout=None if None in timeouts else sum(t or 0.0 for t in timeouts),
                call=run,
            ),
            report,
        )

    def done(self, task: Task, *, dead: bool = False) -> None:
        """The task's outcome is durable: its key and quarantine are lifted, its offset moves on."""
        self._free_key(task)
        self.lift_quarantine(task)
        self._offsets.done(task.record, task.generation, dead=dead)

    def lift_quarantine(self, task: Task) -> None:
        """The suspect running alone has its outcome recorded: other tasks may start again. (Until then,
        its run is still marked started, and a death would be charged to it.)"""
        if self._quarantine is task:
            self._quarantine = None

    def _hold_key(self, task: Task) -> None:
        if task.spec.ordered:
            self._key_holder[_key(task)] = id(task)

    def _free_key(self, task: Task) -> None:
        if task.spec.ordered and self._key_holder.get(_key(task)) == id(task):
            del self._key_holder[_key(task)]
