"""Process mode: attempts run in spawned child processes, reused, over a pipe; and the child's side of it.

The protocol, one pickled message at a time over each child's pipe:
- child -> parent, once started: ("ready",), or ("import-error", error_type, message, traceback) and exit;
- parent -> child: (task_type, payload, context fields, timeout), or None to exit cleanly;
- child -> parent, per attempt: ("ok", result) or ("error", error_type, message, traceback, pickled),
  the pickled exception being None when it cannot be pickled.

A spawned child imports this module (for `_child_main`), the package around it and the handlers, and nothing
of the worker loop or its drivers.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from taskq.consumer.executor._outcomes import (
    Attempt,
    Outcome,
    Release,
    Report,
    TaskCrashed,
    TaskFailed,
    bound_traceback,
    cut_short,
    describe,
    failure,
    format_traceback,
    qualified_name,
    timeout_expired,
)
from taskq.consumer.handlers import TaskContext, load

# spawn, never fork: the worker runs librdkafka and psycopg threads, whose locks a forked child would inherit
# in whatever state they were in.
_MP = multiprocessing.get_context("spawn")

#: How often an idle child checks that its parent is still alive.
_PARENT_POLL_SECONDS = 1.0
#: How long to wait for a killed or finished child to be reaped; SIGKILL makes this near-instant.
_REAP_SECONDS = 5.0


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


class ChildPool:
    """The children, started on demand and reused: each runs one attempt at a time for a pool thread."""

    def __init__(
        self, handlers_path: str | None, start_timeout: float, release: Release, report: Report
    ) -> None:
        self._handlers_path = handlers_path
        self._start_timeout = start_timeout
        self._release = release
        self._report = report
        self._lock = threading.Lock()
        self._children: set[_Child] = set()
        self._idle_children: list[_Child] = []
        self._stopping = False  # shutdown is killing what still runs

    def run(self, attempt: Attempt) -> None:
        """Run the attempt in a child; the calling pool thread waits for its reply, death or timeout."""
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
        what = "the workflow inputs"
        try:
            if job.ctx.workflow_inputs is not None:
                # A workflow step's inputs (the results before it) are read here, where Postgres is, and
                # travel with the job: ctx.parent_result and ctx.group_results in the child are these.
                fields["inputs"] = job.ctx._inputs
            what = "the payload"
            # The child gets the time left, not our deadline: monotonic clocks may differ between processes.
            message = pickle.dumps((job.spec.task_type, job.payload, fields, job.timeout))
        except Exception as exc:
            self._checkin(child)
            self._release(attempt)
            error = TaskFailed(
                qualified_name(type(exc)),
                f"{what} of {job.spec.task_type} cannot be read or pickled for its process: {describe(exc)}",
                format_traceback(exc),
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
                self._report(attempt, timeout_expired(job.timeout or 0.0, time.monotonic() - start))
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
            self._report(attempt, cut_short(seconds))
        else:
            self._report(attempt, failure(TaskCrashed(_exit_message(exitcode)), seconds, crashed=True))

    def shutdown(self, deadline: float) -> None:
        """Kill the children running attempts; ask the idle ones to exit, and reap them by `deadline`."""
        with self._lock:
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

    def _checkout_child(self) -> _Child:
        while True:
            with self._lock:
                child = self._idle_children.pop() if self._idle_children else None
            if child is None:
                return self._start_child()
            if child.process.is_alive():
                return child
            _reap(child)  # died while idle (the OOM killer picks big processes): use another
            self._forget(child)

    def _checkin(self, child: _Child) -> None:
        with self._lock:
            if not self._stopping:
                self._idle_children.append(child)
                return
        _reap(child, kill=True)
        self._forget(child)

    def _forget(self, child: _Child) -> None:
        with self._lock:
            self._children.discard(child)

    def _start_child(self) -> _Child:
        assert self._handlers_path is not None  # checked in Executor.submit
        path = self._handlers_path
        started = time.monotonic()
        parent_conn, child_conn = _MP.Pipe()
        process = _MP.Process(
            target=_child_main,
            args=(child_conn, path, os.getpid(), _log_setup()),
            name="taskq-child",
            daemon=True,
        )
        try:
            process.start()
        except (
            Exception
        ) as exc:  # out of processes, memory or file descriptors: this attempt fails, not the pool
            parent_conn.close()
            crash = TaskCrashed(f"cannot start a worker process: {describe(exc)}")
            crash.__cause__ = exc
            raise _StartFailed(failure(crash, time.monotonic() - started, crashed=True)) from exc
        finally:
            # Only the child may hold its end: otherwise its death would never show as EOF here.
            child_conn.close()
        child = _Child(process, parent_conn)
        with self._lock:
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
        raise _StartFailed(failure(crash, seconds, crashed=True))


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
            f"the result of {task_type} cannot be unpickled in the worker: {describe(exc)}",
            format_traceback(exc),
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


def _exit_message(exitcode: int | None) -> str:
    if exitcode is None:
        return "worker process closed its pipe"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"worker process died: exit code {exitcode}"


# -- the child process ------------------------------------------------------------------------------------


def die_with_parent(parent_pid: int) -> None:
    """Make this process die with its parent: the handler children of a worker, and the worker processes of
    a supervisor (`taskq worker --processes N`)."""
    # If the parent is killed -9 nobody kills its children: on Linux the kernel does it (PR_SET_PDEATHSIG;
    # it fires when the *thread* that started the child ends, and pool threads live as long as the executor).
    # Elsewhere, and as a second line, the child's idle loop checks its parent pid.
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _log_setup() -> tuple[int, logging.Formatter | None]:
    """The parent's log level and the formatter of its stderr handler, for a child to log as it does."""
    root = logging.getLogger()
    for handler in root.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stderr:
            return root.level, handler.formatter
    return root.level, None


def _child_main(
    conn: Connection, handlers_path: str, parent_pid: int, log: tuple[int, logging.Formatter | None]
) -> None:
    """Entry point of a child process: load the handlers, then run the attempts sent over the pipe."""
    die_with_parent(parent_pid)
    level, formatter = log
    if formatter is not None:  # a handler's ctx.log lines go where the worker's go, in its format
        stderr = logging.StreamHandler(sys.stderr)
        stderr.setFormatter(formatter)
        logging.getLogger().addHandler(stderr)
    logging.getLogger().setLevel(level)
    # Ctrl-C and a SIGTERM to the whole group (systemd's default) are for the worker, which finishes or
    # times out what its children run; children die by SIGKILL from it, or with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        handlers = load(handlers_path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            failed = ("import-error", qualified_name(type(exc)), describe(exc), format_traceback(exc))
            conn.send_bytes(pickle.dumps(failed))
        conn.close()
        return
    conn.send_bytes(pickle.dumps(("ready",)))
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
            logger = logging.getLogger(f"taskq.task.{task_type}")  # the name a thread handler's has
            inputs = fields.pop("inputs", None)
            ctx = TaskContext(
                **fields,
                logger=logger,
                deadline=deadline,
                workflow_inputs=None if inputs is None else functools.partial(tuple, inputs),
            )
            reply: tuple[Any, ...] = ("ok", spec.fn(payload, ctx))
        except BaseException as exc:
            # SystemExit and KeyboardInterrupt raised by a handler are failed attempts like any other: the
            # child stays, and stays in step with its parent.
            reply = ("error", qualified_name(type(exc)), describe(exc), format_traceback(exc), _pickled(exc))
        try:
            data = pickle.dumps(reply)
        except Exception as exc:
            data = pickle.dumps(
                (
                    "error",
                    qualified_name(type(exc)),
                    f"the result of {task_type} cannot be pickled for the worker: {describe(exc)}",
                    format_traceback(exc),
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
