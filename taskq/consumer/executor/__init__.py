"""The executor: runs attempts of tasks in threads, an event loop or child processes, each under a timeout.

`Executor` owns the slots (at most `concurrency` attempts at once), the reporting of each attempt's outcome
exactly once, the watchdog, and the dispatch of attempts to the mechanisms, one module each: `_threads`
(the pool threads), `_async` (the event loop) and `_process` (child processes and the child's side).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from taskq._core.errors import ConfigurationError
from taskq.consumer.executor._async import EventLoop
from taskq.consumer.executor._outcomes import (
    TRACEBACK_LIMIT,
    Attempt,
    Job,
    Outcome,
    TaskCrashed,
    TaskFailed,
    TaskTimeout,
    bound_traceback,
    cut_short,
    failure,
    qualified_name,
)
from taskq.consumer.executor._process import ChildPool
from taskq.consumer.executor._threads import ThreadPool, run_in_thread
from taskq.consumer.executor._watchdog import Watchdog

__all__ = [
    "TRACEBACK_LIMIT",
    "Executor",
    "Job",
    "Outcome",
    "TaskCrashed",
    "TaskFailed",
    "TaskTimeout",
    "bound_traceback",
    "failure",
    "qualified_name",
]

_log = logging.getLogger("taskq.executor")


class Executor:
    """Runs attempts under a timeout, at most `concurrency` at once: in threads, a loop or processes."""

    def __init__(
        self, *, concurrency: int, handlers_path: str | None = None, process_start_timeout: float = 60.0
    ) -> None:
        if concurrency < 1:
            raise ConfigurationError(f"concurrency must be >= 1, got {concurrency}")
        if process_start_timeout <= 0:
            raise ConfigurationError(
                f"process_start_timeout must be > 0 seconds, got {process_start_timeout}"
            )
        self._concurrency = concurrency
        self._handlers_path = handlers_path
        self._cond = threading.Condition()
        # Attempts submitted whose thread, coroutine or child has not yet really finished: a timed-out thread
        # still counts, since it still occupies a pool thread and whatever the handler holds.
        self._busy = 0
        self._unreported: set[Attempt] = set()
        self._closed = False  # no more submits
        self._stopping = False  # shutdown is killing what still runs
        self._watchdog = Watchdog()
        self._threads = ThreadPool(concurrency, self._run)
        self._loop = EventLoop(self._release, self._report_soon)
        self._children = ChildPool(handlers_path, process_start_timeout, self._release, self._report)

    # -- public ---------------------------------------------------------------------------------------------

    def submit(self, job: Job, on_done: Callable[[Outcome], None]) -> None:
        """Start an attempt; on_done(outcome) is called exactly once, from an executor thread."""
        # on_done should be brief (hand the outcome to the worker's loop): timeouts and async outcomes are
        # delivered from one watchdog thread, and a slow on_done there delays the reports after it.
        spec = job.spec
        in_process = spec.isolation == "process" and job.call is None and not spec.is_async
        if in_process and self._handlers_path is None:
            raise ConfigurationError(
                f"{spec.task_type}: isolation='process' needs the executor's handlers_path"
            )
        attempt = Attempt(job, on_done)
        with self._cond:
            if self._closed:
                raise RuntimeError("the executor is shut down")
            self._busy += 1
            self._unreported.add(attempt)
            if not spec.is_async or job.call is not None:
                # One more pool thread per submit until there are `concurrency`; each serves thread and
                # process attempts alike, so a queued attempt never waits while a thread could take it.
                self._threads.grow()
        if spec.is_async and job.call is None:
            self._loop.submit(attempt)
        else:
            self._threads.put(attempt)

    def prepare_threads(self, init: Callable[[], None]) -> threading.Event:
        """Start all `concurrency` pool threads now, each calling `init` first (e.g. opening its database
        connection), rather than one at each of the first submits; the event is set once all have."""
        with self._cond:
            return self._threads.start_all(init)

    def free_slots(self) -> int:
        """Concurrency minus attempts still running, timed-out threads included."""
        with self._cond:
            return max(0, self._concurrency - self._busy)

    def running(self) -> int:
        """Attempts submitted and not yet really finished (a timed-out thread counts until it returns)."""
        with self._cond:
            return self._busy

    def shutdown(self, timeout: float) -> None:
        """Wait up to `timeout` for running attempts to report; then cut them short and kill the children."""
        # Attempts still unreported then get a timed-out outcome, from this thread, before shutdown returns.
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: not self._unreported, timeout=max(0.0, deadline - time.monotonic()))
            self._stopping = True
        self._children.shutdown(deadline)
        with self._cond:
            left = list(self._unreported)
        for attempt in left:
            self._report(attempt, cut_short(attempt.elapsed()))
        self._threads.stop()
        self._loop.stop(deadline)
        self._watchdog.close(max(0.0, deadline - time.monotonic()))
        self._threads.join(deadline)

    # -- dispatch -------------------------------------------------------------------------------------------

    def _run(self, attempt: Attempt) -> None:
        # Called on a pool thread for each attempt it takes: run it there, or in a child process it waits on.
        if self._stopping:  # queued past the worker's concurrency and never started
            self._release(attempt)
            self._report(attempt, cut_short(attempt.elapsed()))
            return
        try:
            if attempt.job.spec.isolation == "process" and attempt.job.call is None:
                self._children.run(attempt)
            else:
                run_in_thread(attempt, self._watchdog, self._release, self._report)
        except BaseException as exc:  # a bug here must not kill the pool thread or lose the outcome
            _log.exception("executor failed to run task %s", attempt.job.ctx.task_id)
            self._release(attempt)
            self._report(attempt, failure(exc, attempt.elapsed()))

    # -- reporting ------------------------------------------------------------------------------------------

    def _report(self, attempt: Attempt, outcome: Outcome) -> None:
        # The first outcome wins (a deadline, the handler, or shutdown): on_done is called exactly once.
        with self._cond:
            if attempt.reported:
                return
            attempt.reported = True
        try:
            attempt.on_done(outcome)
        except BaseException:
            _log.exception("on_done failed for task %s", attempt.job.ctx.task_id)
        finally:
            with self._cond:
                self._unreported.discard(attempt)
                self._cond.notify_all()

    def _report_soon(self, attempt: Attempt, outcome: Outcome) -> None:
        # on_done may block (the worker records outcomes): never on the event loop, which other tasks share.
        self._watchdog.schedule(0.0, lambda: self._report(attempt, outcome))

    def _release(self, attempt: Attempt) -> None:
        # Idempotent, so the pool thread's safety net can release without knowing how far a run got.
        with self._cond:
            if attempt.released:
                return
            attempt.released = True
            self._busy -= 1
            self._cond.notify_all()
