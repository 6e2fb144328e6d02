"""The claimer: claims the idempotency keys of arrived tasks, a batch per round trip, off the worker's loop.

With a `claims` store (a connection of its own) the round trips run on a thread, so the loop goes on fetching
and dispatching tasks claimed earlier while Postgres answers; batches queued meanwhile go out together in one
statement. Answers come back in the order the batches were queued, and are handled on the loop's thread.
Without one (the in-memory fakes) a claim is answered at once, on the caller's thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from taskq._core.errors import StoreUnavailableError
from taskq.consumer.store import Claim, ClaimRequest, TaskStore

T = TypeVar("T")

#: A batch's answers, in request order, or why Postgres did not answer (the tasks are held and claimed again).
Answer = list[Claim] | StoreUnavailableError


class Claimer(Generic[T]):
    """Claims batches of keys, on a thread of its own when given a `claims` store; answers in queue order."""

    def __init__(
        self, store: TaskStore, *, claims: TaskStore | None = None, wake: Callable[[], None] = lambda: None
    ) -> None:
        """`wake` is called on the claim thread after each answer, to wake a loop waiting for something."""
        self._store = store
        self._claims = claims
        self._wake = wake
        self._queued: deque[list[T]] = deque()  # batches asked and not yet taken by `answered`, in order
        self._count = 0  # their tasks
        self._done: list[tuple[list[T], Answer]] = []  # answered synchronously
        self._to_claim: queue.SimpleQueue[list[ClaimRequest] | None] = queue.SimpleQueue()
        self._answers: queue.SimpleQueue[Answer | BaseException] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def claim(self, tasks: list[T], requests: list[ClaimRequest]) -> None:
        """Ask for the keys of `tasks` (one request each); the answer comes from `answered`."""
        if self._claims is None:
            self._done.append((tasks, _claim(self._store, requests)))
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._claim_loop, name="taskq-claimer", daemon=True)
            self._thread.start()
        self._queued.append(tasks)
        self._count += len(tasks)
        self._to_claim.put(requests)

    def _claim_loop(self) -> None:
        assert self._claims is not None
        while (requests := self._to_claim.get()) is not None:
            # What was queued while the last statement ran goes out with this one: one round trip for all.
            batches = [requests]
            while True:
                try:
                    more = self._to_claim.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._to_claim.put(None)  # stop after answering these
                    break
                batches.append(more)
            answer: list[Claim] | BaseException
            try:
                answer = self._claims.claim([r for batch in batches for r in batch])
            except Exception as exc:  # handled on the loop's thread: unavailable is retried, a bug raised
                answer = exc
            for batch in batches:
                if isinstance(answer, list):
                    self._answers.put(answer[: len(batch)])
                    answer = answer[len(batch) :]
                else:
                    self._answers.put(answer)
            self._wake()

    def answered(self, timeout: float = 0.0) -> list[tuple[list[T], Answer]]:
        """The batches answered since the last call, in the order asked; waits up to `timeout` for all of
        them (what revoke and shutdown do). A store error other than unavailability is raised here."""
        out, self._done = self._done, []
        deadline = time.monotonic() + timeout
        while self._queued:
            left = deadline - time.monotonic()
            try:
                answer = self._answers.get(timeout=left) if left > 0 else self._answers.get_nowait()
            except queue.Empty:
                break
            tasks = self._queued.popleft()
            self._count -= len(tasks)
            if isinstance(answer, BaseException) and not isinstance(answer, StoreUnavailableError):
                raise answer
            out.append((tasks, answer))
        return out

    def pending(self) -> int:
        """Tasks whose claims are asked and not yet taken by `answered`."""
        return self._count + sum(len(tasks) for tasks, _ in self._done)

    def __iter__(self) -> Iterator[T]:
        """The tasks whose claims are asked and not yet taken by `answered`."""
        for tasks in self._queued:
            yield from tasks
        for tasks, _ in self._done:
            yield from tasks

    def close(self) -> None:
        """Stop the claim thread once it answered what was asked."""
        if self._thread is not None:
            self._to_claim.put(None)
            self._thread.join(10)
            self._thread = None


def _claim(store: TaskStore, requests: list[ClaimRequest]) -> Answer:
    try:
        return store.claim(requests)
    except StoreUnavailableError as exc:
        return exc
