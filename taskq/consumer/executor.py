"""The executor: runs attempts of tasks in threads, an event loop or child processes, each under a timeout."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import heapq
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback as traceback_module
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from taskq._core.errors import ConfigurationError, TaskqError
from taskq.consumer.handlers import HandlerSpec, TaskContext, load

__all__ = ["Executor", "Job", "Outcome", "TaskCrashed", "TaskFailed", "TaskTimeout"]

_log = logging.getLogger("taskq.executor")

#: Tracebacks travel in DLQ headers and Postgres rows; only their last part (where it failed) is kept.
TRACEBACK_LIMIT = 8 * 1024
_TRUNCATED = b"...(traceback truncated)\n"

# spawn, never fork: the worker runs librdkafka and psycopg threads, whose locks a forked child would inherit
# in whatever state they were in.
_MP = multiprocessing.get_context("spawn")

#: How often an idle child checks that its parent is still alive.
_PARENT_POLL_SECONDS = 1.0
#: How long to wait for a killed or finished child to be reaped; SIGKILL makes this near-instant.
_REAP_SECONDS = 5.0


class TaskTimeout(TaskqError):
    """The attempt did not finish within its timeout."""


class TaskCrashed(TaskqError):
    """The process running the attempt died."""


class TaskFailed(TaskqError):
    """The handler raised in a child process; its error, re-created in the worker."""

    def __init__(self, error_type: str, message: str, traceback: str = "") -> None:
        super().__init__(f"{error_type}: {message}")
        self.error_type = error_type
        self.message = message
        self.traceback = traceback

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.error_type, self.message, self.traceback))


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one attempt ended."""

    ok: bool
    result: Any = None
    #: The exception (thread, async); a TaskFailed (process); a TaskTimeout or TaskCrashed.
    error: BaseException | None = None
    #: Qualified class name of the error, e.g. "builtins.ValueError".
    error_type: str = ""
    message: str = ""
    #: Formatted traceback, at most TRACEBACK_LIMIT bytes of UTF-8 (its end).
    traceback: str = ""
    timed_out: bool = False
    #: The isolated process died (os._exit, a signal, the OOM killer) or could not be started.
    crashed: bool = False
    #: Wall time of the attempt.
    seconds: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Job:
    """One attempt to run: the handler, its input, and its timeout."""

    spec: HandlerSpec
    payload: Any
    ctx: TaskContext
    #: Seconds; None means no limit.
    timeout: float | None
    #: If given, run this in a thread instead of spec.fn(payload, ctx) (the worker's transactional wrapper).
    call: Callable[[], Any] | None = None


def qualified_name(cls: type) -> str:
    """'module.QualName' of a class, the form Outcome.error_type uses."""
    return f"{cls.__module__}.{cls.__qualname__}"


def bound_traceback(text: str, limit: int = TRACEBACK_LIMIT) -> str:
    """The last `limit` bytes (UTF-8) of a traceback, marked when cut."""
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text
    # A cut inside a multi-byte character leaves a partial one at the start: "ignore" drops it.
    return (_TRUNCATED + data[len(data) - (limit - len(_TRUNCATED)) :]).decode("utf-8", "ignore")


def _describe(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # a broken __str__ must not lose the outcome
        return f"<unprintable {qualified_name(type(exc))}>"


def _format(exc: BaseException) -> str:
    return bound_traceback("".join(traceback_module.format_exception(exc)))


def _failure(
    exc: BaseException, seconds: float, *, timed_out: bool = False, crashed: bool = False
) -> Outcome:
    return Outcome(
        ok=False,
        error=exc,
        error_type=qualified_name(type(exc)),
        message=_describe(exc),
        traceback=_format(exc) if exc.__traceback__ is not None else "",
        timed_out=timed_out,
        crashed=crashed,
        seconds=seconds,
    )


def _timed_out(timeout: float, seconds: float) -> Outcome:
    return _failure(TaskTimeout(f"timed out after {float(timeout)} s"), seconds, timed_out=True)


def _cut_short(seconds: float) -> Outcome:
    # Invariant 7: on shutdown a worker finishes or times out what it runs; this is the "times out".
    return _failure(TaskTimeout("still running when the worker shut down"), seconds, timed_out=True)


def _exit_message(exitcode: int | None) -> str:
    if exitcode is None:
        return "worker process closed its pipe"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"worker process died: exit code {exitcode}"


class _Attempt:
    """A submitted job and its state; `reported` and `released` are guarded by the executor's lock."""

    __slots__ = ("job", "on_done", "released", "reported", "started")

    def __init__(self, job: Job, on_done: Callable[[Outcome], None]) -> None:
        self.job = job
        self.on_done = on_done
        self.reported = False
        self.released = False
        self.started = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.started


@dataclass(order=True, slots=True)
class _Timer:
    when: float
    seq: int
    fn: Callable[[], None] | None = field(compare=False)


class _Watchdog:
    """One daemon thread running callbacks at deadlines: timeouts, and on_done calls from the loop."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[_Timer] = []
        self._seq = itertools.count()
        self._cancelled = 0
        self._closed = False
        self._thread: threading.Thread | None = None

    def schedule(self, when: float, fn: Callable[[], None]) -> _Timer | None:
        """Run fn on the watchdog thread at monotonic time `when` (None once closed)."""
        with self._cond:
            if self._closed:
                return None
            timer = _Timer(when, next(self._seq), fn)
            heapq.heappush(self._heap, timer)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="taskq-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
            return timer

    def cancel(self, timer: _Timer | None) -> None:
        """Drop a timer that has not fired."""
        with self._cond:
            if timer is None or timer.fn is None:
                return
            timer.fn = None
            self._cancelled += 1
            # Most timers are cancelled (tasks finish in time) long before their deadline: compact, so
            # long timeouts at high throughput do not pile up dead entries (invariant 5, bounded memory).
            if self._cancelled > 64 and self._cancelled * 2 > len(self._heap):
                self._heap = [t for t in self._heap if t.fn is not None]
                heapq.heapify(self._heap)
                self._cancelled = 0

    def close(self, timeout: float) -> None:
        """Stop the thread; timers not yet fired are dropped."""
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, timeout))

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    if not self._heap:
                        self._cond.wait()
                        continue
                    top = self._heap[0]
                    if top.fn is None:
                        heapq.heappop(self._heap)
                        self._cancelled -= 1
                        continue
                    delay = top.when - time.monotonic()
                    if delay > 0:
                        self._cond.wait(delay)
                        continue
                    heapq.heappop(self._heap)
                    fn, top.fn = top.fn, None
                    break
            try:
                fn()
            except BaseException:  # the watchdog outlives any callback
                _log.exception("executor watchdog callback failed")


class _Child:
    """A child process and the parent's end of its pipe."""

    __slots__ = ("conn", "process")

    def __init__(self, process: BaseProcess, conn: Connection) -> None:
        self.process = process
        self.conn = conn


class _StartFailed(Exception):
    """A child could not be started; carries the outcome to report for the attempt that needed it."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.message)
        self.outcome = outcome


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
        self._start_timeout = process_start_timeout
        self._cond = threading.Condition()
        # Attempts submitted whose thread, coroutine or child has not yet really finished: a timed-out thread
        # still counts, since it still occupies a pool thread and whatever the handler holds.
        self._busy = 0
        self._unreported: set[_Attempt] = set()
        self._closed = False  # no more submits
        self._stopping = False  # shutdown is killing what still runs
        self._jobs: queue.SimpleQueue[_Attempt | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._children: set[_Child] = set()
        self._idle_children: list[_Child] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[Any]] = set()  # the loop only keeps weak references to tasks
        self._watchdog = _Watchdog()

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
        attempt = _Attempt(job, on_done)
        with self._cond:
            if self._closed:
                raise RuntimeError("the executor is shut down")
            self._busy += 1
            self._unreported.add(attempt)
            start_thread = not spec.is_async or job.call is not None
            if start_thread and len(self._threads) < self._concurrency:
                # One more pool thread per submit until there are `concurrency`; each serves thread and
                # process attempts alike, so a queued attempt never waits while a thread could take it.
                thread = threading.Thread(target=self._pool_loop, name="taskq-executor", daemon=True)
                self._threads.append(thread)
                thread.start()
        if spec.is_async and job.call is None:
            self._ensure_loop().call_soon_threadsafe(self._start_async, attempt)
        else:
            self._jobs.put(attempt)

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
            idle, self._idle_children = self._idle_children, []
            running = [c for c in self._children if c not in idle]
            self._children.difference_update(idle)
        for child in running:
            # The pool thread waiting on this child sees it die and reaps it; here we only kill.
            with contextlib.suppress(ValueError):  # already closed by its pool thread
                child.process.kill()
        for child in idle:
            with contextlib.suppress(OSError):
                child.conn.send_bytes(pickle.dumps(None))  # exit cleanly: lets atexit hooks of handlers run
        for child in idle:
            child.process.join(max(0.0, min(1.0, deadline - time.monotonic())))
            _reap(child)
        with self._cond:
            left = list(self._unreported)
        for attempt in left:
            self._report(attempt, _cut_short(attempt.elapsed()))
        for _ in self._threads:
            self._jobs.put(None)
        self._stop_loop(deadline)
        self._watchdog.close(max(0.0, deadline - time.monotonic()))
        # Daemon threads: one stuck in a handler is abandoned, never waited for past the deadline.
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    # -- reporting ------------------------------------------------------------------------------------------

    def _report(self, attempt: _Attempt, outcome: Outcome) -> None:
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

    def _release(self, attempt: _Attempt) -> None:
        # Idempotent, so the pool thread's safety net can release without knowing how far a run got.
        with self._cond:
            if attempt.released:
                return
            attempt.released = True
            self._busy -= 1
            self._cond.notify_all()

    # -- thread mode ----------------------------------------------------------------------------------------

    def _pool_loop(self) -> None:
        while True:
            attempt = self._jobs.get()
            if attempt is None:
                return
            if self._stopping:  # queued past the worker's concurrency and never started
                self._release(attempt)
                self._report(attempt, _cut_short(attempt.elapsed()))
                continue
            try:
                if attempt.job.spec.isolation == "process" and attempt.job.call is None:
                    self._run_in_child(attempt)
                else:
                    self._run_in_thread(attempt)
            except BaseException as exc:  # a bug here must not kill the pool thread or lose the outcome
                _log.exception("executor failed to run task %s", attempt.job.ctx.task_id)
                self._release(attempt)
                self._report(attempt, _failure(exc, attempt.elapsed()))

    def _run_in_thread(self, attempt: _Attempt) -> None:
        job = attempt.job
        start = time.monotonic()
        timer = None
        if job.timeout is not None:
            timeout = job.timeout
            job.ctx.deadline = start + timeout
            # A thread cannot be killed: the timeout is reported at the deadline while it keeps running (and
            # keeps its slot); whatever it returns later is dropped by _report.
            timer = self._watchdog.schedule(
                job.ctx.deadline,
                lambda: self._report(attempt, _timed_out(timeout, time.monotonic() - start)),
            )
        try:
            result = job.call() if job.call is not None else job.spec.fn(job.payload, job.ctx)
            outcome = Outcome(ok=True, result=result, seconds=time.monotonic() - start)
        except BaseException as exc:
            # Any exception the handler raises, SystemExit included, is a failed attempt: in a pool thread
            # nothing else could be meant (KeyboardInterrupt is only delivered to the main thread).
            outcome = _failure(exc, time.monotonic() - start)
        finally:
            self._watchdog.cancel(timer)
            self._release(
                attempt
            )  # before on_done, so the worker sees the free slot when it hears the outcome
        self._report(attempt, outcome)

    # -- async mode -----------------------------------------------------------------------------------------

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._cond:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=_run_loop, args=(loop,), name="taskq-async", daemon=True)
                self._loop, self._loop_thread = loop, thread
                thread.start()
            return self._loop

    def _report_soon(self, attempt: _Attempt, outcome: Outcome) -> None:
        # on_done may block (the worker records outcomes): never on the event loop, which other tasks share.
        self._watchdog.schedule(0.0, lambda: self._report(attempt, outcome))

    def _start_async(self, attempt: _Attempt) -> None:
        job = attempt.job
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        if job.timeout is not None:
            job.ctx.deadline = start + job.timeout
        try:
            task: asyncio.Task[Any] = loop.create_task(job.spec.fn(job.payload, job.ctx))
        except BaseException as exc:
            self._release(attempt)
            self._report_soon(attempt, _failure(exc, time.monotonic() - start))
            return
        self._tasks.add(task)
        timer: asyncio.TimerHandle | None = None
        if job.timeout is not None:
            timeout = job.timeout

            def expire() -> None:
                # Reported at the deadline even if the coroutine swallows the cancellation and runs on.
                self._report_soon(attempt, _timed_out(timeout, time.monotonic() - start))
                task.cancel()

            timer = loop.call_at(loop.time() + timeout, expire)

        def finished(task: asyncio.Task[Any]) -> None:
            self._tasks.discard(task)
            if timer is not None:
                timer.cancel()
            seconds = time.monotonic() - start
            if task.cancelled():
                outcome = _failure(asyncio.CancelledError("the handler's task was cancelled"), seconds)
            elif (exc := task.exception()) is not None:
                outcome = _failure(exc, seconds)
            else:
                outcome = Outcome(ok=True, result=task.result(), seconds=seconds)
            self._release(attempt)
            self._report_soon(attempt, outcome)

        task.add_done_callback(finished)

    def _stop_loop(self, deadline: float) -> None:
        with self._cond:
            loop, thread = self._loop, self._loop_thread
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

    # -- process mode ---------------------------------------------------------------------------------------

    def _run_in_child(self, attempt: _Attempt) -> None:
        job = attempt.job
        try:
            child = self._checkout_child()
        except _StartFailed as failed:
            self._release(attempt)
            self._report(attempt, failed.outcome)
            return
        start = time.monotonic()
        fields = {
            "task_id": job.ctx.task_id,
            "task_type": job.ctx.task_type,
            "attempt": job.ctx.attempt,
            "max_attempts": job.ctx.max_attempts,
            "idempotency_key": job.ctx.idempotency_key,
            "priority": job.ctx.priority,
            "headers": dict(job.ctx.headers),
        }
        if job.timeout is not None:
            # The clock starts once the child is up: start-up is bounded by process_start_timeout instead.
            job.ctx.deadline = start + job.timeout
        try:
            # The child gets the time left, not our deadline: monotonic clocks may differ between processes.
            message = pickle.dumps((job.spec.task_type, job.payload, fields, job.timeout))
        except Exception as exc:
            self._checkin(child)
            self._release(attempt)
            error = TaskFailed(
                qualified_name(type(exc)),
                f"the payload of {job.spec.task_type} cannot be pickled for its process: {_describe(exc)}",
                _format(exc),
            )
            self._report(attempt, _failed_in_child(error, None, 0.0))
            return
        outcome: Outcome | None = None
        with contextlib.suppress(OSError):  # a broken pipe: the child died, found out below
            child.conn.send_bytes(message)
            ready = wait([child.conn, child.process.sentinel], timeout=job.timeout)
            if not ready:
                # SIGKILL, then reap: the handler is gone by the time its timeout is reported.
                _reap(child, kill=True)
                self._forget(child)
                self._release(attempt)
                self._report(attempt, _timed_out(job.timeout or 0.0, time.monotonic() - start))
                return
            if child.conn.poll(0):
                try:
                    outcome = _reply(job.spec.task_type, child.conn.recv_bytes(), time.monotonic() - start)
                except EOFError:
                    outcome = None
        if outcome is not None:
            self._checkin(child)
            self._release(attempt)
            self._report(attempt, outcome)
            return
        # EOF on the pipe or the sentinel fired: the child is dead (os._exit, a signal, the OOM killer).
        exitcode = _reap(child)
        self._forget(child)
        self._release(attempt)
        seconds = time.monotonic() - start
        if self._stopping:
            self._report(attempt, _cut_short(seconds))
        else:
            self._report(attempt, _failure(TaskCrashed(_exit_message(exitcode)), seconds, crashed=True))

    def _checkout_child(self) -> _Child:
        while True:
            with self._cond:
                child = self._idle_children.pop() if self._idle_children else None
            if child is None:
                return self._start_child()
            if child.process.is_alive():
                return child
            _reap(child)  # died while idle (the OOM killer picks big processes): use another
            self._forget(child)

    def _checkin(self, child: _Child) -> None:
        with self._cond:
            if not self._stopping:
                self._idle_children.append(child)
                return
        _reap(child, kill=True)
        self._forget(child)

    def _forget(self, child: _Child) -> None:
        with self._cond:
            self._children.discard(child)

    def _start_child(self) -> _Child:
        assert self._handlers_path is not None  # checked in submit
        path = self._handlers_path
        started = time.monotonic()
        parent_conn, child_conn = _MP.Pipe()
        process = _MP.Process(
            target=_child_main, args=(child_conn, path, os.getpid()), name="taskq-child", daemon=True
        )
        try:
            process.start()
        except (
            Exception
        ) as exc:  # out of processes, memory or file descriptors: this attempt fails, not the pool
            parent_conn.close()
            crash = TaskCrashed(f"cannot start a worker process: {_describe(exc)}")
            crash.__cause__ = exc
            raise _StartFailed(_failure(crash, time.monotonic() - started, crashed=True)) from exc
        finally:
            # Only the child may hold its end: otherwise its death would never show as EOF here.
            child_conn.close()
        child = _Child(process, parent_conn)
        with self._cond:
            self._children.add(child)
            stopping = self._stopping
        if stopping:
            process.kill()
        # Start-up (an interpreter, then the handlers' imports) is bounded: a child hanging there is killed.
        ready = wait([parent_conn, process.sentinel], timeout=self._start_timeout)
        reply: Any = None
        with contextlib.suppress(EOFError, OSError):
            if ready and parent_conn.poll(0):
                reply = pickle.loads(parent_conn.recv_bytes())
        if reply == ("ready",):
            return child
        exitcode = _reap(child, kill=True)
        self._forget(child)
        seconds = time.monotonic() - started
        if isinstance(reply, tuple) and reply[0] == "import-error":
            _, error_type, message, tb = reply
            error = TaskFailed(
                error_type, f"cannot load handlers {path!r} in a worker process: {error_type}: {message}", tb
            )
            raise _StartFailed(_failed_in_child(error, None, seconds))
        if ready:
            crash = TaskCrashed(f"{_exit_message(exitcode)} while starting (handlers {path!r})")
        else:
            crash = TaskCrashed(
                f"worker process did not start within {self._start_timeout} s (handlers {path!r})"
            )
        raise _StartFailed(_failure(crash, seconds, crashed=True))


def _failed_in_child(error: TaskFailed, cause: BaseException | None, seconds: float) -> Outcome:
    error.__cause__ = cause
    return Outcome(
        ok=False,
        error=error,
        error_type=error.error_type,
        message=error.message,
        traceback=bound_traceback(error.traceback),
        seconds=seconds,
    )


def _reply(task_type: str, data: bytes, seconds: float) -> Outcome:
    """The outcome a child's reply describes."""
    try:
        reply = pickle.loads(data)
    except Exception as exc:
        error = TaskFailed(
            qualified_name(type(exc)),
            f"the result of {task_type} cannot be unpickled in the worker: {_describe(exc)}",
            _format(exc),
        )
        return _failed_in_child(error, exc, seconds)
    if reply[0] == "ok":
        return Outcome(ok=True, result=reply[1], seconds=seconds)
    _, error_type, message, tb, pickled = reply
    cause: BaseException | None = None
    if pickled is not None:
        # The original exception, when it survives pickling, lets retry policies match on its class
        # (non_retryable, Retry) through __cause__.
        with contextlib.suppress(Exception):
            cause = pickle.loads(pickled)
    return _failed_in_child(
        TaskFailed(error_type, message, tb), cause if isinstance(cause, BaseException) else None, seconds
    )


def _reap(child: _Child, *, kill: bool = False) -> int | None:
    """Kill (optionally) and join a child, close its pipe, and return its exit code."""
    process = child.process
    try:
        if kill:
            process.kill()
        process.join(_REAP_SECONDS)
        if process.exitcode is None:  # closed its pipe yet lives on: no use to anyone
            process.kill()
            process.join(_REAP_SECONDS)
        exitcode = process.exitcode
        if exitcode is not None:
            process.close()
    except ValueError:  # closed already, by the pool thread or shutdown
        exitcode = None
    child.conn.close()
    return exitcode


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


# -- the child process ------------------------------------------------------------------------------------


def _die_with_parent(parent_pid: int) -> None:
    # If the worker is killed -9 nobody kills its children: on Linux the kernel does it (PR_SET_PDEATHSIG;
    # it fires when the *thread* that started the child ends, and pool threads live as long as the executor).
    # Elsewhere, and as a second line, the child's idle loop checks its parent pid.
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _child_main(conn: Connection, handlers_path: str, parent_pid: int) -> None:
    """Entry point of a child process: load the handlers, then run the attempts sent over the pipe."""
    _die_with_parent(parent_pid)
    # Ctrl-C and a SIGTERM to the whole group (systemd's default) are for the worker, which finishes or
    # times out what its children run; children die by SIGKILL from it, or with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        handlers = load(handlers_path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            conn.send_bytes(
                pickle.dumps(("import-error", qualified_name(type(exc)), _describe(exc), _format(exc)))
            )
        conn.close()
        return
    conn.send_bytes(pickle.dumps(("ready",)))
    logger = logging.getLogger("taskq.task")
    while True:
        try:
            if not conn.poll(_PARENT_POLL_SECONDS):
                if os.getppid() != parent_pid:
                    return
                continue
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if message is None:
            return
        task_type, payload, fields, timeout = message
        try:
            spec = handlers.get(task_type)
            if spec is None:
                raise LookupError(f"no handler for {task_type!r} in {handlers_path}")
            deadline = None if timeout is None else time.monotonic() + timeout
            ctx = TaskContext(**fields, logger=logger, deadline=deadline)
            reply: tuple[Any, ...] = ("ok", spec.fn(payload, ctx))
        except BaseException as exc:
            # SystemExit and KeyboardInterrupt raised by a handler are failed attempts like any other: the
            # child stays, and stays in step with its parent.
            reply = ("error", qualified_name(type(exc)), _describe(exc), _format(exc), _pickled(exc))
        try:
            data = pickle.dumps(reply)
        except Exception as exc:
            data = pickle.dumps(
                (
                    "error",
                    qualified_name(type(exc)),
                    f"the result of {task_type} cannot be pickled for the worker: {_describe(exc)}",
                    _format(exc),
                    None,
                )
            )
        try:
            conn.send_bytes(data)
        except OSError:
            return


def _pickled(exc: BaseException) -> bytes | None:
    try:
        return pickle.dumps(exc)
    except Exception:
        return None
