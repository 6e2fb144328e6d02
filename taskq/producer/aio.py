"""AsyncTaskProducer: TaskProducer's API for asyncio services, without blocking their event loop.

Validation and encoding are CPU work of microseconds and run on the loop. Anything that can wait on I/O runs
in a thread: fetching a task type's schema from the registry (first use, then once per schema TTL), a
shared rate limit's round trip to Postgres, flush and close. Acknowledgements come from a thread that polls
the Kafka client and settle asyncio futures on the loop, so `await enqueue(..., wait=True)` suspends only
its own coroutine.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import threading
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, overload

import psycopg

from taskq._core.errors import KafkaAuthenticationError, ProducerClosedError
from taskq._core.settings import Settings
from taskq.producer.producer import TaskProducer, _settled
from taskq.producer.status import Polls, TaskStatus, result_of
from taskq.producer.tasks import Receipt, TaskSpec, _Bulk
from taskq.producer.workflows import Chain, Group, WorkflowReceipt, WorkflowStatus

__all__ = ["AsyncTaskProducer"]


class AsyncTaskProducer:
    """Enqueues typed tasks from asyncio code: `await enqueue(...)`, `await enqueue_many(...)`,
    `await flush()`, `async with`. Takes TaskProducer's arguments and raises the same exceptions."""

    def __init__(self, settings: Settings | None = None, **kwargs: Any) -> None:
        self._producer = TaskProducer(settings, **kwargs)
        self._stop = threading.Event()
        # The futures of every enqueue waiting for acknowledgements, with their loops.
        self._waiting: set[tuple[asyncio.AbstractEventLoop, tuple[asyncio.Future[Any], ...]]] = set()
        self._poller = threading.Thread(target=self._poll, name="taskq-async-producer", daemon=True)
        self._poller.start()

    @classmethod
    def from_env(cls, **kwargs: Any) -> AsyncTaskProducer:
        """A producer configured from TASKQ_* environment variables."""
        return cls(Settings.from_env(), **kwargs)

    @property
    def producer(self) -> TaskProducer:
        """The synchronous producer underneath (its settings, topics and registry)."""
        return self._producer

    def _poll(self) -> None:
        # Serves delivery reports; the client releases the GIL while it waits.
        while not self._stop.is_set():
            try:
                self._producer._sink.poll(0.1)
            except KafkaAuthenticationError as exc:
                # Refused credentials: who waits hears it now, as from TaskProducer, not when delivery
                # times out; the thread goes on serving delivery reports.
                for loop, futures in list(self._waiting):
                    with contextlib.suppress(RuntimeError):  # a closed loop: nobody awaits them
                        loop.call_soon_threadsafe(_fail, futures, exc)

    async def enqueue(
        self,
        task_type: str,
        payload: Mapping[str, Any],
        *,
        priority: str = "normal",
        idempotency_key: str | None = None,
        key: str | bytes | None = None,
        delay: timedelta | float | datetime | None = None,
        at: datetime | None = None,
        max_attempts: int | None = None,
        timeout: float | timedelta | None = None,
        wait: bool = False,
        conn: psycopg.AsyncConnection[Any] | None = None,
    ) -> Receipt:
        """Enqueue one task (see TaskProducer.enqueue); with wait, until the broker acknowledges it; with
        `conn` (an async psycopg connection in an open transaction), staged in the outbox through it."""
        batch = _Bulk(
            task_type=task_type,
            payloads=[payload],
            idempotency_keys=None if idempotency_key is None else (idempotency_key,),
            keys=None if key is None else (key,),
            priority=priority,
            delay=delay,
            at=at,
            max_attempts=max_attempts,
            timeout=timeout,
        )
        return (await self._enqueue(batch, wait, conn))[0]

    @overload
    async def enqueue_many(
        self,
        tasks: Iterable[TaskSpec],
        /,
        *,
        wait: bool = False,
        conn: psycopg.AsyncConnection[Any] | None = None,
    ) -> list[Receipt]: ...

    @overload
    async def enqueue_many(
        self,
        task_type: str,
        payloads: Iterable[Mapping[str, Any]],
        /,
        *,
        priority: str = "normal",
        idempotency_keys: Sequence[str] | None = None,
        keys: Sequence[str | bytes | None] | None = None,
        delay: timedelta | float | datetime | None = None,
        at: datetime | None = None,
        max_attempts: int | None = None,
        timeout: float | timedelta | None = None,
        wait: bool = False,
        conn: psycopg.AsyncConnection[Any] | None = None,
    ) -> list[Receipt]: ...

    async def enqueue_many(
        self,
        tasks: Iterable[TaskSpec] | str,
        payloads: Iterable[Mapping[str, Any]] | None = None,
        /,
        *,
        priority: str = "normal",
        idempotency_keys: Sequence[str] | None = None,
        keys: Sequence[str | bytes | None] | None = None,
        delay: timedelta | float | datetime | None = None,
        at: datetime | None = None,
        max_attempts: int | None = None,
        timeout: float | timedelta | None = None,
        wait: bool = False,
        conn: psycopg.AsyncConnection[Any] | None = None,
    ) -> list[Receipt]:
        """Enqueue a batch, `enqueue_many(task_type, payloads, ...)` or `enqueue_many(tasks)`, as
        TaskProducer.enqueue_many does: every task is validated first, so an invalid one means none is sent;
        with `wait`, until the broker acknowledged them all; with `conn`, staged in the outbox inside that
        connection's transaction."""
        batch = self._producer._batch(
            tasks, payloads, priority, idempotency_keys, keys, delay, at, max_attempts, timeout
        )
        return await self._enqueue(batch, wait, conn)

    async def _enqueue(
        self,
        batch: _Bulk | list[TaskSpec],
        wait: bool,
        conn: psycopg.AsyncConnection[Any] | None,
    ) -> list[Receipt]:
        producer = self._producer
        loop = asyncio.get_running_loop()
        if conn is not None:
            producer._check_stageable(wait)
        if producer._may_block(batch):
            # In the caller's context, so an enqueue's span is a child of the caller's current span.
            accepted = await loop.run_in_executor(
                None, contextvars.copy_context().run, producer._accept, batch
            )
        else:
            accepted = producer._accept(batch)
        if conn is not None:
            statement, params = producer._staged(accepted)
            try:
                await conn.execute(statement, params)
            except psycopg.Error as exc:
                raise producer._stage_failed(exc) from exc
            return accepted.receipts(self)
        if not wait or not accepted.tasks:  # an empty batch has nothing to wait for
            producer._send(accepted, None)
            return accepted.receipts(self)
        future: asyncio.Future[list[tuple[Receipt, str | None]]] = loop.create_future()

        def done(outcomes: list[tuple[Receipt, str | None]]) -> None:
            # Called by the polling thread (or by a poll on the loop), once for the whole batch.
            try:
                loop.call_soon_threadsafe(_resolve, future, outcomes)
            except RuntimeError:  # the loop is closed: nobody awaits this future any more
                pass

        producer._send(accepted, done)
        waiting = (loop, (future,))
        self._waiting.add(waiting)
        try:
            receipts = _settled(await future)
        finally:
            self._waiting.discard(waiting)
        for receipt in receipts:
            receipt.producer = self  # its status() and result() are awaited
        return receipts

    async def status(self, task_id: str | None = None, *, idempotency_key: str | None = None) -> TaskStatus:
        """What became of a task (TaskProducer.status), read in a thread."""
        return await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self._producer.status, task_id, idempotency_key=idempotency_key)
        )

    async def result(
        self, task_id: str | None = None, *, idempotency_key: str | None = None, timeout: float | None = None
    ) -> Any:
        """Wait for a task's result (TaskProducer.result); the waits between reads suspend only this
        coroutine."""
        key, polls = idempotency_key, Polls(timeout)
        while True:
            current = await self.status(task_id, idempotency_key=key)
            key = key or current.idempotency_key
            if current.final:
                return result_of(current)
            await asyncio.sleep(polls.next(current))

    async def enqueue_workflow(self, workflow: TaskSpec | Chain | Group) -> WorkflowReceipt:
        """Enqueue a workflow (TaskProducer.enqueue_workflow), in a thread: it writes to Postgres. The
        receipt's `status()` and `cancel()` are the synchronous producer's."""
        return await asyncio.get_running_loop().run_in_executor(
            None, contextvars.copy_context().run, self._producer.enqueue_workflow, workflow
        )

    async def workflow_status(self, workflow_id: str) -> WorkflowStatus:
        """What became of a workflow (TaskProducer.workflow_status), read in a thread."""
        return await asyncio.get_running_loop().run_in_executor(
            None, self._producer.workflow_status, workflow_id
        )

    async def cancel_workflow(self, workflow_id: str) -> int:
        """Cancel a workflow (TaskProducer.cancel_workflow), in a thread."""
        return await asyncio.get_running_loop().run_in_executor(
            None, self._producer.cancel_workflow, workflow_id
        )

    async def cancel(self, task_id: str | None = None, *, idempotency_key: str | None = None) -> bool:
        """Cancel a task (TaskProducer.cancel), in a thread; whether it had started."""
        return await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self._producer.cancel, task_id, idempotency_key=idempotency_key)
        )

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every accepted task is acknowledged; DeliveryError lists any the broker refused."""
        await asyncio.get_running_loop().run_in_executor(None, self._producer.flush, timeout)

    async def close(self, timeout: float | None = None) -> None:
        """Flush, then release the Kafka client and the polling thread."""
        try:
            await asyncio.get_running_loop().run_in_executor(None, self._producer.close, timeout)
        finally:
            self._stop.set()
            await asyncio.get_running_loop().run_in_executor(None, self._poller.join)

    async def __aenter__(self) -> AsyncTaskProducer:
        if self._stop.is_set():
            raise ProducerClosedError()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


def _fail(futures: tuple[asyncio.Future[Any], ...], exc: BaseException) -> None:
    for future in futures:
        if not future.done():
            future.set_exception(exc)


def _resolve(
    future: asyncio.Future[list[tuple[Receipt, str | None]]], outcomes: list[tuple[Receipt, str | None]]
) -> None:
    if not future.done():  # a cancelled waiter leaves its future done
        future.set_result(outcomes)
