"""Async mode: coroutine handlers run as tasks of one event loop, on its own daemon thread."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from taskq.consumer.executor._outcomes import Attempt, Outcome, Release, Report, failure, timeout_expired


class EventLoop:
    """The loop's thread, started by the first async attempt, and the tasks running on it."""

    def __init__(self, release: Release, report_soon: Report) -> None:
        # report_soon, not report: outcomes are delivered from another thread, never from the loop.
        self._release = release
        self._report_soon = report_soon
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[Any]] = set()  # the loop only keeps weak references to tasks

    def submit(self, attempt: Attempt) -> None:
        self._ensure_loop().call_soon_threadsafe(self._start, attempt)

    def stop(self, deadline: float) -> None:
        """Cancel the tasks, wait for them until `deadline`, then stop the loop and its thread."""
        with self._lock:
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def cancel_all() -> None:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=max(0.01, deadline - time.monotonic()))

        future = asyncio.run_coroutine_threadsafe(cancel_all(), loop)
        try:
            future.result(timeout=max(0.01, deadline - time.monotonic()))
        except Exception:  # a coroutine blocking the loop: it is abandoned with its daemon thread
            future.cancel()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(max(0.0, deadline - time.monotonic()))

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=_run_loop, args=(loop,), name="taskq-async", daemon=True)
                self._loop, self._thread = loop, thread
                thread.start()
            return self._loop

    def _start(self, attempt: Attempt) -> None:
        job = attempt.job
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        if job.timeout is not None:
            job.ctx.deadline = start + job.timeout
        try:
            coro = job.spec.fn(job.payload, job.ctx)
            # A task runs in a copy of the context it is created in: the attempt's span, when tracing.
            task: asyncio.Task[Any] = (
                loop.create_task(coro) if job.trace is None else job.trace.run(loop.create_task, coro)
            )
        except BaseException as exc:
            self._release(attempt)
            self._report_soon(attempt, failure(exc, time.monotonic() - start))
            return
        self._tasks.add(task)
        timer: asyncio.TimerHandle | None = None
        if job.timeout is not None:
            timeout = job.timeout

            def expire() -> None:
                # Reported at the deadline even if the coroutine swallows the cancellation and runs on.
                self._report_soon(attempt, timeout_expired(timeout, time.monotonic() - start))
                task.cancel()

            timer = loop.call_at(loop.time() + timeout, expire)

        def finished(task: asyncio.Task[Any]) -> None:
            self._tasks.discard(task)
            if timer is not None:
                timer.cancel()
            seconds = time.monotonic() - start
            if task.cancelled():
                outcome = failure(asyncio.CancelledError("the handler's task was cancelled"), seconds)
            elif (exc := task.exception()) is not None:
                outcome = failure(exc, seconds)
            else:
                outcome = Outcome(ok=True, result=task.result(), seconds=seconds)
            self._release(attempt)
            self._report_soon(attempt, outcome)

        task.add_done_callback(finished)


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
