"""Claims, the worker's second stage: a batch of decoded tasks in, the tasks whose keys this worker now
holds out, ready for dispatch.

A batch's keys are claimed in Postgres in one round trip, sent with the outcomes queued so far while the
loop goes on (invariant 2); at a steady rate a batch lingers a few milliseconds for the next ones to share
it. From each answer a task is ready to run, skipped (completed, dead or cancelled already: its offset
moves on), held to look again (leased elsewhere, or Postgres away), or a poison pill for the DLQ. The
leases of tasks that wait long are renewed here, and the keys of tasks that will not start here are given
back.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from taskq._core.broker import TP
from taskq._core.envelope import Priority
from taskq._core.errors import StoreUnavailableError
from taskq._core.logs import OUTAGE
from taskq.consumer.completer import Completer
from taskq.consumer.events import Reporter
from taskq.consumer.intake import Task, fields
from taskq.consumer.offsets import Offsets
from taskq.consumer.outcomes import Outcomes
from taskq.consumer.store import Claim, ClaimRequest, TaskStore

__all__ = ["Claims", "Held", "max_worker_deaths", "worker_deaths"]

log = logging.getLogger("taskq.worker")

#: Queued claims are sent at once when this many tasks wait for them, whatever their linger: a batch that
#: large shares its round trip well enough (a burn-down's polls take hundreds at a time).
CLAIM_ENOUGH = 64
#: Seconds over which the rate of fetched tasks is counted, to tell whether a claim's linger would be shared.
RATE_WINDOW = 0.1


def max_worker_deaths(max_attempts: int) -> int:
    """Deaths of its own after which a key is dead-lettered as a poison pill, unrun.

    A task merely in flight (or claimed ahead) on a worker that died is not charged an attempt; but a task
    that kills every worker running it must still end in the DLQ: after max_attempts deaths of its own,
    and never after one alone, so a single crash never dead-letters a task with max_attempts=1.
    """
    return max(max_attempts, 2)


def worker_deaths(claim: Claim) -> int:
    """Deaths charged to a key: interruptions of its runs in quarantine (invariant 10).

    A key taken over from a dead worker is a suspect: it runs alone in its process, outside group commit,
    marked started just before it runs. Only such a run's death is an interruption. The death that made it
    a suspect is charged to nobody: whatever ran, was buffered or was claimed ahead beside the task that
    killed the worker cannot be told apart from it.
    """
    return claim.interruptions


@dataclass(slots=True)
class Held:
    """A task held out of the buffer until `due` (clock time), then claimed again."""

    task: Task
    due: float


class Claims:
    """Claims tasks' keys in batches and sorts the tasks by the answers."""

    def __init__(
        self,
        store: TaskStore,
        completer: Completer,
        outcomes: Outcomes,
        offsets: Offsets,
        *,
        claim_wait: float,
        default_lease: float,
        report: Reporter,
        clock: Callable[[], float],
        done: Callable[[Task], None],
        ready: Callable[[list[Task]], None],
    ) -> None:
        """`done(task)`: its key is decided here for good (skipped, or taken over): its offset moves on.
        `ready(tasks)`: a batch's claimed tasks, in order, for dispatch."""
        self.store = store
        self._completer = completer
        self._outcomes = outcomes
        self._offsets = offsets
        self._claim_wait = claim_wait
        self._default_lease = default_lease
        self._report = report
        self._clock = clock
        self._done = done
        self._ready = ready
        #: Tasks held out of the buffer to be claimed again later.
        self.held: list[Held] = []
        #: Tasks per tier whose claims are on their way: buffered as far as flow control is concerned.
        self.claiming: Counter[Priority] = Counter()
        self._step_ends: list[tuple[Task, str, str]] = []  # workflow steps the claims skipped
        self._queued: list[Task] = []  # decoded, their claim not sent yet (`claim`'s linger)
        self._queued_at = 0.0  # when the first of them was queued
        #: Batches whose claims were sent and not answered yet, with when they were sent (by id of the batch).
        self.sent: dict[int, tuple[float, list[Task]]] = {}
        self._linger = 0.0
        # Tasks claimed in the current RATE_WINDOW (since `_window_at`) and in the one before it.
        self._count, self._last_count, self._window_at = 0, 0, float("-inf")

    def lease(self, task: Task) -> float:
        """Seconds a key is leased for the task's run."""
        timeout = task.spec.timeout or task.envelope.timeout
        # A lease outlives the attempt it covers; past it another worker may take the key over.
        return timeout * 1.5 + 5 if timeout else self._default_lease

    def claim(self, batch: list[Task], *, linger: float = 0.0) -> None:
        """Claim the batch's keys in one round trip, sent with the outcomes queued so far, while the loop
        goes on; the answers sort the tasks when they come back (on the loop's thread).

        With `linger`, the batch waits for later ones to share its round trip: it is sent (with every
        batch queued before it) once the first queued has waited `linger` seconds or CLAIM_ENOUGH tasks
        are queued (`send_due`). It waits only while tasks come fast enough for one to be expected within
        the linger (counted over the last RATE_WINDOW): a trickle pays no latency for nothing. Queued
        tasks count as being claimed.
        """
        now = self._clock()
        if now - self._window_at >= RATE_WINDOW:
            # The last full window's count: none if the window before this one passed without a task.
            self._last_count = self._count if now - self._window_at < 2 * RATE_WINDOW else 0
            self._count, self._window_at = 0, now
        self._count += len(batch)
        if not self._queued:
            self._queued_at = now
        self._queued += batch
        for task in batch:
            self.claiming[task.tier] += 1
        expected = self._last_count * linger / RATE_WINDOW  # tasks due to come within the linger
        if expected < 1 or len(self._queued) >= CLAIM_ENOUGH:
            self.send_queued()
        else:
            self._linger = linger

    def send_due(self) -> None:
        """Send the queued claims whose linger is over."""
        if self._queued and self._clock() - self._queued_at >= self._linger:
            self.send_queued()

    def send_queued(self) -> None:
        """Send every queued claim now, in one round trip."""
        if not self._queued:
            return
        batch, self._queued = self._queued, []
        requests = [
            ClaimRequest(
                t.envelope.idempotency_key,
                t.envelope.task_id,
                t.envelope.task_type,
                # Claimed as it arrives, the key is leased for its wait in the buffer as well.
                self.lease(t) + self._claim_wait,
            )
            for t in batch
        ]
        self.sent[id(batch)] = (self._clock(), batch)
        self._completer.claim(requests, functools.partial(self._claimed, batch))

    def where(self, match: Callable[[Task], bool]) -> str | None:
        """Where the task `match` picks is in this stage, in words (for a warning), or None."""
        now = self._clock()
        for task in self._queued:
            if match(task):
                return f"task {task.envelope.task_id} waits for its claim to be sent"
        for sent_at, batch in self.sent.values():
            for task in batch:
                if match(task):
                    return f"task {task.envelope.task_id}: claim sent {now - sent_at:.0f} s ago, unanswered"
        for held in self.held:
            if match(held.task):
                return (
                    f"task {held.task.envelope.task_id} is held (its key leased elsewhere, or Postgres "
                    f"away), to be claimed again in {max(0.0, held.due - now):.1f} s"
                )
        return None

    def queued(self) -> int:
        """Tasks waiting for their claim to be sent."""
        return len(self._queued)

    def linger_left(self) -> float | None:
        """Seconds until the queued claims are due (None: nothing queued)."""
        if not self._queued:
            return None
        return max(0.0, self._queued_at + self._linger - self._clock())

    def release_due(self) -> None:
        """Claim again the held tasks whose time has come."""
        now = self._clock()
        due = [h for h in self.held if h.due <= now]
        if not due:
            return
        self.held = [h for h in self.held if h.due > now]
        self.claim([h.task for h in due])

    def hold(self, tasks: Iterable[Task], seconds: float) -> None:
        """Hold tasks out of the buffer for `seconds`, then claim them again."""
        due = self._clock() + seconds
        self.held.extend(Held(t, due) for t in tasks)

    def forget(self, revoked: set[TP]) -> None:
        """Drop the held tasks of revoked partitions: their new owner claims them."""
        self.held = [h for h in self.held if h.task.record.tp not in revoked]

    def _claimed(self, batch: list[Task], claims: list[Claim] | StoreUnavailableError) -> None:
        """A batch's claims came back (on the loop's thread)."""
        self.sent.pop(id(batch), None)
        for task in batch:
            self.claiming[task.tier] -= 1
        if isinstance(claims, StoreUnavailableError):
            log.warning("store unavailable, holding %d task(s): %s", len(batch), claims, extra=OUTAGE)
            self.hold(batch, 1.0)
            return
        now = self._clock()
        gone: list[Task] = []
        ready: list[Task] = []
        generation = self._offsets.generation
        for task, claim in zip(batch, claims, strict=True):
            task.claimed_at = now
            if generation.get(task.record.tp, 0) != task.generation:
                # Its partition was revoked while the claim was on its way (a revoke waits for claims in
                # flight, but only so long): its new owner runs it. A key claimed here is given back.
                if claim.outcome == "claimed":
                    task.attempts = claim.attempts
                    gone.append(task)
                continue
            if self._sort(task, claim):
                ready.append(task)
        if ready:
            self._ready(ready)
        self.release(gone)
        if self._step_ends:
            self._end_steps()

    def _sort(self, task: Task, claim: Claim) -> bool:
        """Act on one claim's answer; True if the task is claimed and may run."""
        workflow = task.workflow
        if workflow is not None and claim.outcome in ("completed", "dead", "cancelled"):
            # A workflow's step skipped here still ends its node (once: a node ended already stays so),
            # before its offset moves on.
            self._step_ends.append((task, workflow, claim.outcome))
            return False
        if claim.outcome == "cancelled":
            # Cancelled before it started: it never runs, and never reaches the DLQ; its offset moves on.
            self._report.cancelled_skipped(task.envelope)
            self._done(task)
            return False
        if claim.outcome in ("completed", "dead"):
            # Completed, or this very task was dead-lettered already (its offset was not committed before
            # its worker died): the DLQ holds it once, so its redelivery is skipped and committed.
            self._report.duplicate_skipped(task.envelope)
            self._done(task)
            return False
        if claim.outcome in ("running", "duplicate"):
            # Leased by a live worker (or a copy in this batch): look again soon, at latest when it expires.
            self.held.append(Held(task, self._clock() + max(0.2, min(claim.lease_left, 1.0))))
            return False
        task.attempts = claim.attempts
        max_attempts = task.envelope.max_attempts or task.spec.policy.max_attempts
        if task.attempts > max_attempts:
            # A poison pill: earlier attempts never reported (they killed their worker). Never run it again.
            self._outcomes.dead_letter(
                task, f"gave up after {max_attempts} attempt(s) that never finished", "taskq.PoisonPill"
            )
            return False
        deaths = worker_deaths(claim)
        if deaths >= max_worker_deaths(max_attempts):
            # A poison pill too: its runs keep killing their workers (each taken over from a dead worker).
            self._outcomes.dead_letter(
                task, f"gave up after {deaths} run(s) ended with their worker's death", "taskq.PoisonPill"
            )
            return False
        task.suspect = claim.takeovers > 0
        return True

    def _end_steps(self) -> None:
        """Record the ends of the workflow steps the claims skipped, then let their offsets move on; with
        Postgres away they are held and claimed again."""
        ends, self._step_ends = self._step_ends, []
        try:
            self.store.workflow_ended([(wf, t.envelope.idempotency_key, state) for t, wf, state in ends])
        except StoreUnavailableError as exc:
            log.warning("store unavailable, holding %d workflow step(s): %s", len(ends), exc, extra=OUTAGE)
            self.hold([t for t, _, _ in ends], 1.0)
            return
        for task, _, state in ends:
            if state == "cancelled":
                self._report.cancelled_skipped(task.envelope)
            else:
                self._report.duplicate_skipped(task.envelope)
            self._done(task)

    def renew(self, waited: Sequence[Task], parked: Sequence[Task] = ()) -> list[Task]:
        """Extend the leases of tasks that waited long for a slot (about to start: leased for their run) and
        of `parked` ones (still waiting for their key: leased for a wait more); those lost are dropped."""
        leases = [(t.envelope.idempotency_key, t.attempts, self.lease(t)) for t in waited]
        wait = self._claim_wait
        leases += [(t.envelope.idempotency_key, t.attempts, self.lease(t) + wait) for t in parked]
        try:
            renewed = self.store.renew(leases)
        except StoreUnavailableError as exc:
            log.warning("store unavailable, holding %d task(s): %s", len(leases), exc, extra=OUTAGE)
            # Held tasks are claimed again: their own lease answers 'running' until it expires.
            self.hold([*waited, *parked], 1.0)
            return []
        now = self._clock()
        kept = []
        for task in [*waited, *parked]:
            if task.envelope.idempotency_key in renewed:
                task.claimed_at = now
                kept.append(task)
            else:
                # Taken over while it waited: the worker holding the lease now decides this key.
                log.warning(
                    "task %s: lease taken over while it waited for a slot",
                    task.envelope.task_id,
                    extra=fields(task),
                )
                self._done(task)
        return kept

    def mark_started(self, tasks: list[Task]) -> list[Task]:
        """Mark the runs of these tasks started before they start; those whose lease was lost are dropped
        (all are kept, unmarked, if the store is unavailable)."""
        try:
            marked = self.store.mark_started([(t.envelope.idempotency_key, t.attempts) for t in tasks])
        except StoreUnavailableError as exc:
            # Run unmarked rather than held: held, they would wait out their own lease and then be charged
            # an attempt. A poison pill may kill one more worker before the DLQ, during an outage only.
            log.warning(
                "could not mark %d run(s) started, they run unmarked: %s", len(tasks), exc, extra=OUTAGE
            )
            return tasks
        kept = []
        for task in tasks:
            if task.envelope.idempotency_key in marked:
                kept.append(task)
            else:
                # Taken over before it started: the worker holding the lease now decides this key.
                log.warning(
                    "task %s: lease taken over before it started", task.envelope.task_id, extra=fields(task)
                )
                self._done(task)
        return kept

    def release(self, tasks: list[Task]) -> None:
        """Give back the claims of buffered tasks that will not start here: their keys are free at once."""
        if not tasks:
            return
        try:
            self.store.release([(t.envelope.idempotency_key, t.attempts) for t in tasks])
        except StoreUnavailableError as exc:
            log.warning(
                "could not release %d claimed key(s) (their leases will expire): %s",
                len(tasks),
                exc,
                extra=OUTAGE,
            )
        shares = self._offsets.shares
        if shares is not None:
            for task in tasks:
                shares.release(task.record)  # another member gets it at once
