"""What the executor runs and reports: Job, the attempt in flight, Outcome, its errors, outcome builders."""

from __future__ import annotations

import contextvars
import time
import traceback as traceback_module
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from taskq._core.errors import TaskqError
from taskq.consumer.handlers import HandlerSpec, TaskContext

#: Where the errors live for users: Outcome.error_type names them "taskq.consumer.executor.TaskTimeout" (and
#: pickle finds them there), wherever in the package they are defined.
_PUBLIC_MODULE = "taskq.consumer.executor"

#: Tracebacks travel in DLQ headers and Postgres rows; only their last part (where it failed) is kept.
TRACEBACK_LIMIT = 8 * 1024
_TRUNCATED = b"...(traceback truncated)\n"


class TaskTimeout(TaskqError):
    """The attempt did not finish within its timeout."""

    __module__ = _PUBLIC_MODULE


class TaskCrashed(TaskqError):
    """The process running the attempt died."""

    __module__ = _PUBLIC_MODULE


class TaskFailed(TaskqError):
    """The handler raised in a child process; its error, re-created in the worker."""

    __module__ = _PUBLIC_MODULE

    def __init__(self, error_type: str, message: str, traceback: str = "") -> None:
        super().__init__(f"{error_type}: {message}")
        self.error_type = error_type
        self.message = message
        self.traceback = traceback

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.error_type, self.message, self.traceback))


@dataclass(slots=True)
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


@dataclass(kw_only=True, slots=True)
class Job:
    """One attempt to run: the handler, its input, and its timeout."""

    spec: HandlerSpec
    payload: Any
    ctx: TaskContext
    #: Seconds; None means no limit.
    timeout: float | None
    #: If given, run this in a thread instead of spec.fn(payload, ctx) (the worker's transactional wrapper).
    call: Callable[[], Any] | None = None
    #: If given, run the handler in this context (the attempt's span current in it, when tracing).
    trace: contextvars.Context | None = None


class Attempt:
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


#: The executor's slot accounting, as the mechanisms call it: free the attempt's slot (idempotent)...
Release = Callable[[Attempt], None]
#: ...and report its outcome (the first one wins: on_done is called exactly once).
Report = Callable[[Attempt, Outcome], None]


def qualified_name(cls: type) -> str:
    """'module.QualName' of a class, the form Outcome.error_type uses."""
    return f"{cls.__module__}.{cls.__qualname__}"


def storable(text: str) -> str:
    """`text`, with what UTF-8 cannot encode written as backslash escapes: lone surrogates, which a name
    decoded with surrogateescape (a file's, say) carries into an error's message. An error's text goes to
    Postgres and into Kafka headers, both UTF-8 only; one that could not be encoded stopped the worker."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def bound_traceback(text: str, limit: int = TRACEBACK_LIMIT) -> str:
    """The last `limit` bytes (UTF-8) of a traceback, marked when cut (and `storable`)."""
    text = storable(text)
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    # A cut inside a multi-byte character leaves a partial one at the start: "ignore" drops it.
    return (_TRUNCATED + data[len(data) - (limit - len(_TRUNCATED)) :]).decode("utf-8", "ignore")


def describe(exc: BaseException) -> str:
    """str(exc) (`storable`), or a placeholder if its __str__ is broken."""
    try:
        return storable(str(exc))
    except Exception:  # a broken __str__ must not lose the outcome
        return f"<unprintable {qualified_name(type(exc))}>"


def format_traceback(exc: BaseException) -> str:
    """The exception's traceback, bounded to TRACEBACK_LIMIT."""
    return bound_traceback("".join(traceback_module.format_exception(exc)))


def failure(exc: BaseException, seconds: float, *, timed_out: bool = False, crashed: bool = False) -> Outcome:
    """The outcome of an attempt that ended in `exc`."""
    return Outcome(
        ok=False,
        error=exc,
        error_type=qualified_name(type(exc)),
        message=describe(exc),
        traceback=format_traceback(exc) if exc.__traceback__ is not None else "",
        timed_out=timed_out,
        crashed=crashed,
        seconds=seconds,
    )


def timeout_expired(timeout: float, seconds: float) -> Outcome:
    """The outcome of an attempt still running at its deadline."""
    return failure(TaskTimeout(f"timed out after {float(timeout)} s"), seconds, timed_out=True)


def cut_short(seconds: float) -> Outcome:
    """The outcome of an attempt still running (or never started) when shutdown's deadline passed."""
    # Invariant 7: on shutdown a worker finishes or times out what it runs; this is the "times out".
    return failure(TaskTimeout("still running when the worker shut down"), seconds, timed_out=True)
