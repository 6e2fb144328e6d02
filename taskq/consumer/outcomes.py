"""Outcomes, the worker's fourth stage: a batch of attempts' outcomes in, durable records out.

A completion or a failure is queued for Postgres, a retry or DLQ record for the broker (all sent in
batches by the completer); a task's `done` is called only once they are durable (invariant 1), and its
offset moves on then. Input that never became a task goes to the DLQ here too, as does a poison pill
found at claim time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from taskq._core.broker import TP, Record
from taskq._core.envelope import Topics
from taskq._core.errors import ResultError
from taskq._core.store import encode_result
from taskq._core.tracing import Tracer
from taskq.consumer.completer import Completer
from taskq.consumer.events import Reporter
from taskq.consumer.executor import Outcome, TaskFailed, failure
from taskq.consumer.intake import Rejected, Task, fields
from taskq.consumer.limits import Limits
from taskq.consumer.offsets import Offsets
from taskq.consumer.retry import Reject, Retry
from taskq.consumer.routing import Outgoing, bounded, dead_letter_record, retry_record
from taskq.consumer.store import Finished, LeaseLostError

__all__ = ["Outcomes", "checked_result"]

log = logging.getLogger("taskq.worker")


def checked_result(result: Any, limit: int) -> Any:
    """The handler's return value, once known to be storable as its result; ResultError if not."""
    if result is not None:
        encode_result(result, limit)
    return result


class Outcomes:
    """Records what attempts came to: completed, retried (through a delay topic, or in place for an ordered
    task type), or dead-lettered."""

    def __init__(
        self,
        completer: Completer,
        offsets: Offsets,
        limits: Limits,
        tracer: Tracer,
        topics: Topics,
        *,
        delay_tiers: tuple[timedelta, ...],
        worker_id: str,
        result_max_bytes: int,
        report: Reporter,
        done: Callable[[Task, bool], None],
        lift: Callable[[Task], None],
    ) -> None:
        """`done(task, dead)`: the task's outcome is durable (its offset moves on); `lift(task)`: its failed
        attempt is recorded (a suspect running alone no longer holds the others back)."""
        self._completer = completer
        self._offsets = offsets
        self._limits = limits
        self._tracer = tracer
        self._topics = topics
        self._delay_tiers = delay_tiers
        self._worker_id = worker_id
        self._result_max_bytes = result_max_bytes
        self._report = report
        self._done = done
        self._lift = lift

    def settle(self, reported: Sequence[tuple[Task, Outcome]], now: float) -> list[tuple[Task, float]]:
        """Record a batch of attempts' outcomes. Returns the ordered tasks retried in place, each with the
        clock time it may run again (`now` plus its delay): they wait in the worker, their keys held."""
        again: list[tuple[Task, float]] = []
        for task, outcome in reported:
            delay = self._settle(task, outcome)
            if delay is not None:
                again.append((task, now + delay))
        return again

    def _settle(self, task: Task, outcome: Outcome) -> float | None:
        env, spec = task.envelope, task.spec
        if task.grouped:
            task.grouped = False
            self._report.attempt_started(env, task.attempts)
        if outcome.ok and not task.recorded and outcome.result is not None:
            try:
                checked_result(outcome.result, self._result_max_bytes)
            except ResultError as exc:
                outcome = failure(exc, outcome.seconds)  # never stored cut short, nor dropped silently
        if outcome.ok:
            self._end_span(task, "completed")
            self._report.attempt_succeeded(env, outcome.seconds)
            if task.recorded:
                self._completed(task)
            else:
                self._completer.record(
                    Finished(
                        env.idempotency_key,
                        task.attempts,
                        "completed",
                        result=outcome.result,
                        workflow=task.workflow,
                    ),
                    lambda: self._completed(task),
                )
            return None
        error = outcome.error or Exception(outcome.message)
        if isinstance(error, TaskFailed) and isinstance(error.__cause__, Exception):
            error = error.__cause__  # a process-isolated handler's own exception, when it survived pickling
        if isinstance(error, LeaseLostError):
            log.warning("task %s: %s", env.task_id, error, extra=fields(task))
            self._end_span(task, "lease_lost", str(error))
            self._done(task, False)  # the worker that took the lease over decides this key
            return None
        if isinstance(error, Retry) and error.delay is not None and task.gate is not None:
            # Told to back off (an HTTP 429's Retry-After, say): the key's bucket pauses for every worker.
            self._limits.pause(task.gate, error.delay.total_seconds())
        message = f"{outcome.error_type}: {outcome.message}"
        self._report.attempt_failed(env, outcome.seconds, message)
        policy = spec.policy
        if env.max_attempts is not None:
            policy = replace(policy, max_attempts=env.max_attempts)
        # A result that cannot be stored would be the same on the next attempt: to the DLQ at once.
        final = isinstance(error, Reject | ResultError)
        delay = None if final else policy.next_delay(task.attempts, error)
        if delay is None:
            reason = (
                "result refused"
                if isinstance(error, ResultError)
                else "rejected by handler"
                if isinstance(error, Reject)
                else f"failed {task.attempts} attempt(s)"
            )
            self._end_span(task, "dead_lettered", message)
            self.dead_letter(task, f"{reason}: {message}", outcome.error_type, outcome.traceback)
            return None
        self._end_span(task, "retried", message)
        log.info(
            "task %s: attempt %d failed, retrying in %.1fs: %s",
            env.task_id,
            task.attempts,
            delay.total_seconds(),
            message,
            extra=fields(task),
        )
        if spec.ordered:
            # Retried in place: its offset stays pending and its key stays held, so the key's later tasks
            # wait for it (what ordering means); a restart or rebalance redelivers it first.
            self._report.task_retried(env)
            self._completer.record(
                Finished(
                    env.idempotency_key, task.attempts, "failed", error=message, workflow=task.workflow
                ),
                lambda: self._lift(task),
            )
            return delay.total_seconds()
        now = datetime.now(UTC)
        out = retry_record(
            task.record,
            replace(env, attempt=task.attempts),
            delay,
            self._topics,
            self._delay_tiers,
            now,
        )
        self._report.task_retried(env)
        self._completer.record(
            Finished(env.idempotency_key, task.attempts, "failed", error=message, workflow=task.workflow)
        )
        # Delivery guarantee: the offset is done only when the broker acknowledged the retry record.
        # One too large to send again cannot be retried: a bounded DLQ record takes its place.
        self._completer.publish(
            out,
            lambda: self._done(task, False),
            too_large=lambda: bounded(
                dead_letter_record(
                    task.record,
                    reason=f"failed {task.attempts} attempt(s), too large to retry: {message}",
                    error_type=outcome.error_type,
                    traceback=outcome.traceback,
                    attempts=task.attempts,
                    worker_id=self._worker_id,
                    topics=self._topics,
                )
            ),
        )
        return None

    def dead_letter(self, task: Task, reason: str, error_type: str, traceback: str = "") -> None:
        """Send the task to the DLQ, then record its key dead; its offset moves on once both are durable."""
        out = dead_letter_record(
            task.record,
            reason=reason,
            error_type=error_type,
            traceback=traceback,
            attempts=task.attempts,
            worker_id=self._worker_id,
            topics=self._topics,
        )
        env, record = task.envelope, task.record
        log.warning("task %s dead-lettered: %s", env.task_id, reason, extra=fields(task))
        self._report.dead_lettered(reason, error_type, env, record.topic, record.offset)
        # Delivery guarantee: the key is recorded dead only once the broker acknowledged its DLQ record (a
        # dead key's redelivery is skipped, so recording it first could lose the record), and the offset is
        # done only once both are durable. The record says where the DLQ record is, for result().
        self._completer.publish(
            out,
            lambda: None,
            too_large=lambda: bounded(out),
            on_record=lambda at: self._completer.record(
                Finished(
                    env.idempotency_key,
                    task.attempts,
                    "dead",
                    error=reason,
                    dlq=None if at is None else (at.partition, at.offset),
                    workflow=task.workflow,
                ),
                lambda: self._done(task, True),
            ),
        )

    def reject(self, rejected: Sequence[Rejected], generation: Mapping[TP, int]) -> None:
        """Input that never becomes a task: straight to the DLQ, offset done once the broker has it."""
        for r in rejected:
            self._reject(r.record, r.reason, r.error_type, generation.get(r.record.tp, 0))

    def _reject(self, record: Record, reason: str, error_type: str, generation: int) -> None:
        log.warning("dead-lettering %s[%d]@%d: %s", record.topic, record.partition, record.offset, reason)
        self._report.dead_lettered(reason, error_type, None, record.topic, record.offset)
        out = dead_letter_record(
            record,
            reason=reason,
            error_type=error_type,
            traceback="",
            attempts=0,
            worker_id=self._worker_id,
            topics=self._topics,
        )
        self._completer.publish(
            out, lambda: self._offsets.done(record, generation, dead=True), too_large=lambda: bounded(out)
        )

    def send_again(self, records: Sequence[Record]) -> None:
        """Share mode: a record handed out `send_again_at` times is near the delivery after which the group
        archives it unrun: it is sent again as a new record, and accepted once that is acknowledged. Its
        key stays one effect: the copy is claimed like any redelivery."""
        shares = self._offsets.shares
        assert shares is not None
        for record in records:
            log.warning(
                "%s[%d]@%d handed out %d times: sent again as a new record",
                record.topic,
                record.partition,
                record.offset,
                record.delivery_count,
            )
            again = Outgoing(record.topic, record.key, record.value, list(record.headers))
            self._completer.publish(again, lambda record=record: shares.accept(record))  # type: ignore[misc]

    def _completed(self, task: Task) -> None:
        """The completion is recorded: the offset may be released."""
        self._done(task, False)
        self._report.task_completed(task.envelope)

    def _end_span(self, task: Task, outcome: str, error: str | None = None) -> None:
        if task.span is not None:
            self._tracer.finish(task.span, outcome, error)
            task.span = None
