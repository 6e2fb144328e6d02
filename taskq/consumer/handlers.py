"""Handlers: the functions that run tasks, registered per task type on a `Handlers` object."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from taskq._core.durations import Rate, parse_rate
from taskq._core.envelope import PRIORITIES
from taskq._core.errors import ConfigurationError
from taskq.consumer.periodic import CATCH_UPS, CatchUp, PeriodicSpec, schedule_of
from taskq.consumer.retry import RetryPolicy
from taskq.schemas import avro
from taskq.schemas.errors import PayloadValidationError

Isolation = Literal["thread", "process"]
Upcaster = Callable[[dict[str, Any], int], dict[str, Any]]
#: A function of a task's payload naming the key it is limited under (a string, or anything str() names).
KeyOf = Callable[[Any], Any]


@dataclass(kw_only=True)
class TaskContext:
    """What a handler knows about the task it runs."""

    task_id: str
    task_type: str
    attempt: int
    max_attempts: int
    idempotency_key: str
    priority: str
    headers: Mapping[str, bytes]
    logger: logging.Logger
    #: With transactional=True: a psycopg connection in the transaction that also records the completion.
    db: Any = None
    #: Set when the task is picked up; a handler may check it between steps of long work.
    deadline: float | None = None
    #: The task was cancelled while it ran: a handler may check it between steps of long work and stop
    #: (cooperative: its outcome is recorded as usual). Seen within the worker's pause_interval; a
    #: process-isolated handler's stays False.
    cancelled: bool = False
    #: For a step of a workflow: reads what the steps before it gave, once, when the handler first asks.
    workflow_inputs: Callable[[], tuple[Any, Any]] | None = field(default=None, repr=False)

    @cached_property
    def _inputs(self) -> tuple[Any, Any]:
        return self.workflow_inputs() if self.workflow_inputs is not None else (None, None)

    @property
    def parent_result(self) -> Any:
        """In a chain, the result of the step before: a task's, a chain's (its last step's) or a group's
        callback's. A chain's first step, or a group's member, gets what came before its chain or group.
        None elsewhere."""
        return self._inputs[0]

    @property
    def group_results(self) -> list[dict[str, Any]] | None:
        """For a group's callback (or the step after a group without one): per member, in order, a dict of
        its task id, state (completed, dead, cancelled, skipped), result and error. None elsewhere."""
        result: list[dict[str, Any]] | None = self._inputs[1]
        return result

    @cached_property
    def log(self) -> TaskLog:
        """`logger`, each line carrying the task id, idempotency key, task type, tier and attempt."""
        return TaskLog(
            self.logger,
            task_fields(self.task_id, self.idempotency_key, self.task_type, self.priority, self.attempt),
        )


def task_fields(
    task_id: str, idempotency_key: str, task_type: str, tier: str, attempt: int
) -> dict[str, Any]:
    """What every log line about one attempt of a task carries (as `extra`: fields of the JSON log)."""
    return {
        "task_id": task_id,
        "idempotency_key": idempotency_key,
        "task_type": task_type,
        "tier": tier,
        "attempt": attempt,
    }


class TaskLog(logging.LoggerAdapter[logging.Logger]):
    """A task's logger: the task's fields are added to each line's own `extra`."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        """Merge the task's fields into the line's `extra` (the task's win on a clash)."""
        kwargs["extra"] = {**(kwargs.get("extra") or {}), **(self.extra or {})}
        return msg, kwargs


@dataclass(frozen=True, kw_only=True)
class HandlerSpec:
    """A registered handler and how to run it."""

    task_type: str
    fn: Callable[..., Any]
    schema: dict[str, Any] | None
    parsed: avro.ParsedSchema | None
    policy: RetryPolicy
    timeout: float | None
    transactional: bool
    isolation: Isolation
    #: Transactional attempts ready together share one transaction (False: each commits alone).
    group_commit: bool = True
    upcaster: Upcaster | None = None
    is_async: bool = field(default=False)
    #: Tasks with the same key (the `key=` they were enqueued with) run one at a time, in enqueue order.
    ordered: bool = False
    #: At most this many tasks of one concurrency key run at once, across every worker.
    concurrency_limit: int | None = None
    concurrency_key: KeyOf | None = None
    #: Tasks of one rate key start at most at this rate, across every worker.
    rate_limit: Rate | None = None
    rate_key: KeyOf | None = None


class Handlers:
    """A registry of handlers by task type; `taskq worker MODULE:ATTR` runs the one at MODULE.ATTR."""

    def __init__(self) -> None:
        self._specs: dict[str, HandlerSpec] = {}
        self._periodic: dict[str, PeriodicSpec] = {}
        #: "MODULE:ATTR" this registry was loaded from (set by the worker; process isolation needs it).
        self.import_path: str | None = None

    def task(
        self,
        task_type: str,
        *,
        schema: str | Path | Mapping[str, Any] | None = None,
        max_attempts: int = 5,
        timeout: float | None = None,
        transactional: bool = False,
        group_commit: bool = True,
        isolation: Isolation = "thread",
        retry: RetryPolicy | None = None,
        non_retryable: tuple[type[BaseException], ...] = (),
        upcaster: Upcaster | None = None,
        ordered: bool = False,
        concurrency_limit: int | None = None,
        concurrency_key: KeyOf | None = None,
        rate_limit: str | None = None,
        rate_key: KeyOf | None = None,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Register `fn(payload, ctx)` (or `async def`) as the handler of a task type.

        ordered=True: tasks enqueued with the same `key=` (in one tier) run one at a time, in enqueue order.
        A failing one is retried in place, holding its key's later tasks back until it succeeds or is
        dead-lettered.

        concurrency_limit=N: at most N tasks of one key (`concurrency_key(payload)`, or the whole type
        without one) run at once across every worker. rate_limit="100/s": tasks of one key
        (`rate_key(payload)`) start at most at that rate across every worker, in bursts of up to the count;
        `Retry(delay=...)` from such a handler pauses its key's bucket for every worker. A task over either
        limit waits in the worker's buffer, claimed, without using up an attempt.

        transactional=True: `ctx.db` is a connection in the transaction that records the completion, so the
        handler's writes there happen exactly once. Attempts ready together run in one transaction, each
        under a savepoint (group commit: their effects become visible together, and one that raises is
        rolled back alone). A group's statements are pipelined: errors surface at the group's end, a fetch or
        a `ctx.db.transaction()` exit, and COPY needs group_commit=False, which commits each attempt alone.
        """
        if task_type in self._specs:
            raise ConfigurationError(f"a handler for {task_type!r} is already registered")
        if isolation not in ("thread", "process"):
            raise ConfigurationError(f"isolation must be 'thread' or 'process', got {isolation!r}")
        if transactional and isolation == "process":
            raise ConfigurationError(
                f"{task_type}: transactional=True needs isolation='thread' (the transaction is the worker's)"
            )
        if timeout is not None and timeout <= 0:
            raise ConfigurationError(f"{task_type}: timeout must be > 0 seconds, got {timeout}")
        loaded: dict[str, Any] | None = None
        if schema is not None:
            loaded = dict(schema) if isinstance(schema, Mapping) else avro.load_schema(_resolve(schema))
            if avro.full_name(loaded) != task_type:
                raise ConfigurationError(f"schema for {task_type!r} is the record {avro.full_name(loaded)!r}")
        policy = retry or RetryPolicy(max_attempts=max_attempts, non_retryable=non_retryable)
        limit = concurrency_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ConfigurationError(
                f"{task_type}: concurrency_limit must be an int >= 1, got {concurrency_limit!r}"
            )
        try:
            rate = parse_rate(rate_limit) if rate_limit is not None else None
        except ConfigurationError as exc:
            raise ConfigurationError(f"{task_type}: {exc}") from None
        for name, fn, needs, given in (
            ("concurrency_key", concurrency_key, "concurrency_limit", concurrency_limit),
            ("rate_key", rate_key, "rate_limit", rate_limit),
        ):
            if fn is not None and not callable(fn):
                raise ConfigurationError(
                    f"{task_type}: {name} must be a function of the payload, got {type(fn).__name__}"
                )
            if fn is not None and given is None:
                raise ConfigurationError(f"{task_type}: {name} needs {needs}")

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            is_async = inspect.iscoroutinefunction(fn)
            if is_async and isolation == "process":
                raise ConfigurationError(
                    f"{task_type}: async handlers run in the worker's event loop, not a process"
                )
            if is_async and transactional:
                # ctx.db is a blocking connection whose transaction records the completion; a coroutine
                # would return before its writes, and the completion would be committed without them.
                raise ConfigurationError(
                    f"{task_type}: transactional=True needs a plain `def` handler (ctx.db is a blocking "
                    "psycopg connection); make it sync, or drop transactional and write idempotently"
                )
            self._specs[task_type] = HandlerSpec(
                task_type=task_type,
                fn=fn,
                schema=loaded,
                parsed=avro.parse(loaded) if loaded is not None else None,
                policy=policy,
                timeout=timeout,
                transactional=transactional,
                group_commit=group_commit,
                isolation=isolation,
                upcaster=upcaster,
                is_async=is_async,
                ordered=ordered,
                concurrency_limit=concurrency_limit,
                concurrency_key=concurrency_key,
                rate_limit=rate,
                rate_key=rate_key,
            )
            return fn

        return register

    def periodic(
        self,
        cron: str | None = None,
        *,
        every: str | float | timedelta | None = None,
        payload: Mapping[str, Any] | None = None,
        priority: str = "normal",
        name: str | None = None,
        catch_up: CatchUp = "last",
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Run a registered handler's task on a schedule: a cron expression (UTC) or `every="30s"`.

        Goes above `@handlers.task(...)`. Every worker runs the scheduler, and each slot is enqueued once,
        with the idempotency key `periodic:<name>:<slot time>`, through the outbox (so the workers' relay,
        or `taskq relay`, publishes it). After downtime, catch_up decides what runs of the missed slots:
        "last" (the latest, the default), "all" or "skip".
        """
        schedule = schedule_of(cron, every)
        if catch_up not in CATCH_UPS:
            raise ConfigurationError(f"catch_up must be one of {', '.join(CATCH_UPS)}, got {catch_up!r}")
        if priority not in PRIORITIES:
            raise ConfigurationError(f"priority {priority!r} is not one of {', '.join(PRIORITIES)}")

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            spec = next((s for s in self._specs.values() if s.fn is fn), None)
            if spec is None:
                raise ConfigurationError(
                    f"@handlers.periodic on {getattr(fn, '__name__', fn)!r}: put it above "
                    "@handlers.task(...), on a registered handler"
                )
            key = name or spec.task_type
            if key in self._periodic:
                raise ConfigurationError(f"a periodic task named {key!r} is already registered (give name=)")
            body = dict(payload or {})
            if spec.parsed is not None:
                try:
                    avro.validate(spec.parsed, body, task_type=spec.task_type)
                except PayloadValidationError as exc:
                    raise ConfigurationError(f"periodic {key!r}: {exc}") from None
            self._periodic[key] = PeriodicSpec(key, spec.task_type, schedule, body, priority, catch_up)
            return fn

        return register

    @property
    def periodic_tasks(self) -> list[PeriodicSpec]:
        """The periodic tasks registered with `periodic`."""
        return list(self._periodic.values())

    def get(self, task_type: str) -> HandlerSpec | None:
        """The handler of a task type, or None."""
        return self._specs.get(task_type)

    def __iter__(self) -> Iterator[HandlerSpec]:
        return iter(self._specs.values())

    def __len__(self) -> int:
        return len(self._specs)

    def __contains__(self, task_type: object) -> bool:
        return task_type in self._specs


def _resolve(path: str | Path) -> Path:
    # A relative schema path is tried as given, then next to the calling module's file.
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    for frame in inspect.stack()[2:6]:
        candidate = Path(frame.filename).resolve().parent / p
        if candidate.exists():
            return candidate
    return p


def load(import_path: str) -> Handlers:
    """Import MODULE:ATTR and return its Handlers."""
    import importlib

    module_name, _, attr = import_path.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"expected MODULE:ATTR, got {import_path!r}")
    try:
        module = importlib.import_module(module_name)
    except SyntaxError as exc:
        raise ConfigurationError(
            f"cannot import {module_name}: {exc.msg} ({exc.filename}, line {exc.lineno})"
        ) from exc
    except ImportError as exc:  # the module, or something it imports, is missing
        raise ConfigurationError(f"cannot import {module_name}: {exc}") from exc
    if not hasattr(module, attr):
        raise ConfigurationError(
            f"{module_name} has no attribute {attr!r} (expected MODULE:ATTR of a taskq.Handlers)"
        )
    handlers = getattr(module, attr)
    if not isinstance(handlers, Handlers):
        raise ConfigurationError(f"{import_path} is {type(handlers).__name__}, not a taskq.Handlers")
    handlers.import_path = import_path
    return handlers
