"""Thread mode: a pool of daemon threads, and an attempt run in one of them under a watchdog deadline."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from taskq.consumer.executor._outcomes import Attempt, Outcome, Release, Report, failure, timeout_expired
from taskq.consumer.executor._watchdog import Watchdog

_log = logging.getLogger("taskq.executor")


class ThreadPool:
    """Up to `size` daemon threads, each handing the attempts it takes from one queue to `run`."""

    def __init__(self, size: int, run: Callable[[Attempt], None]) -> None:
        self._size = size
        self._run = run
        self._jobs: queue.SimpleQueue[Attempt | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def grow(self) -> None:
        """Start one more thread, unless there are `size`; called under the executor's lock, once a submit."""
        if len(self._threads) < self._size:
            self._spawn(self._loop)

    def start_all(self, init: Callable[[], None]) -> threading.Event:
        """Start every thread now, each calling `init` before it takes an attempt (one that raises is
        logged and the thread goes on); the event is set once each of them has. Called before any submit."""
        ready = threading.Event()
        left = [self._size - len(self._threads)]
        lock = threading.Lock()

        def prepared() -> None:
            try:
                init()
            except Exception as exc:  # e.g. Postgres not answering yet: the first attempt connects instead
                _log.warning("preparing a pool thread failed (it goes on unprepared): %s", exc)
            with lock:
                left[0] -= 1
                if not left[0]:
                    ready.set()
            self._loop()

        if not left[0]:
            ready.set()
        while len(self._threads) < self._size:
            self._spawn(prepared)
        return ready

    def _spawn(self, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, name="taskq-executor", daemon=True)
        self._threads.append(thread)
        thread.start()

    def put(self, attempt: Attempt) -> None:
        self._jobs.put(attempt)

    def stop(self) -> None:
        """Tell every thread to end once the queue ahead of it is done."""
        for _ in self._threads:
            self._jobs.put(None)

    def join(self, deadline: float) -> None:
        # Daemon threads: one stuck in a handler is abandoned, never waited for past the deadline.
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _loop(self) -> None:
        while True:
            attempt = self._jobs.get()
            if attempt is None:
                return
            self._run(attempt)


def run_in_thread(attempt: Attempt, watchdog: Watchdog, release: Release, report: Report) -> None:
    """Run the attempt in the calling thread; its timeout is reported by the watchdog at the deadline."""
    job = attempt.job
    start = time.monotonic()
    timer = None
    if job.timeout is not None:
        timeout = job.timeout
        job.ctx.deadline = start + timeout
        # A thread cannot be killed: the timeout is reported at the deadline while it keeps running (and
        # keeps its slot); whatever it returns later is dropped by report.
        timer = watchdog.schedule(
            job.ctx.deadline,
            lambda: report(attempt, timeout_expired(timeout, time.monotonic() - start)),
        )
    try:
        if job.trace is None:
            result = job.call() if job.call is not None else job.spec.fn(job.payload, job.ctx)
        else:  # the attempt's span is current while the handler runs: its own spans are children
            result = (
                job.trace.run(job.call)
                if job.call is not None
                else job.trace.run(job.spec.fn, job.payload, job.ctx)
            )
        outcome = Outcome(ok=True, result=result, seconds=time.monotonic() - start)
    except BaseException as exc:
        # Any exception the handler raises, SystemExit included, is a failed attempt: in a pool thread
        # nothing else could be meant (KeyboardInterrupt is only delivered to the main thread).
        outcome = failure(exc, time.monotonic() - start)
    finally:
        watchdog.cancel(timer)
        release(attempt)  # before on_done, so the worker sees the free slot when it hears the outcome
    report(attempt, outcome)
