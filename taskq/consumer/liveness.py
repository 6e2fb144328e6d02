"""A worker's liveness record: written at its start and on every heartbeat by a thread of its own.

Other workers take over at once the keys leased by a worker whose heartbeat is stale (invariant 9). Safety
never rests on it: only the lease holder's current attempt completes, so a worker presumed dead by mistake
records nothing. The heartbeat is one statement every few seconds, never one per task.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Protocol

from taskq._core.errors import StoreUnavailableError
from taskq._core.logs import OUTAGE
from taskq._core.store import WorkerRecord

log = logging.getLogger("taskq.worker")


class LivenessStore(Protocol):
    """Where liveness records live: `IdempotencyStore` (Postgres) or `taskq.testing.InMemoryStore`."""

    def enter(self, worker: WorkerRecord, alive: Callable[[int], bool]) -> set[str]: ...
    def beat(self, worker: WorkerRecord, in_flight: int) -> None: ...
    def leave(self, worker_id: str) -> None: ...


def process_alive(pid: int) -> bool:
    """Whether a process of this host has `pid` (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Liveness:
    """Keeps one worker's liveness record: `start` writes it, a thread beats every `interval` seconds,
    `stop` ends the beats and removes the record if the stop was clean."""

    def __init__(
        self,
        store: LivenessStore,
        worker: WorkerRecord,
        in_flight: Callable[[], int],
        *,
        interval: float,
        alive: Callable[[int], bool] = process_alive,
    ) -> None:
        self.store = store
        self.worker = worker
        self.interval = interval
        self._in_flight = in_flight
        self._alive = alive
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: The ids of the host's earlier workers that `start` found gone (marked dead by it).
        self.predecessors: frozenset[str] = frozenset()

    def start(self) -> None:
        """Write the record, free the keys of the host's dead predecessors, and start beating."""
        # Before the first claim: a predecessor killed on this host (a supervisor's restart) is marked dead
        # now, so its keys are taken over at once rather than once its heartbeat is stale.
        dead = self.store.enter(self.worker, self._alive)
        if dead:
            log.warning("earlier worker(s) of this host are gone, their keys are free: %s", sorted(dead))
        self.predecessors = frozenset(dead)
        self._thread = threading.Thread(target=self._run, name="taskq-liveness", daemon=True)
        self._thread.start()

    def stop(self, *, clean: bool) -> None:
        """Stop beating; a clean stop (every key completed, failed or released) removes the record."""
        self._stop.set()
        if self._thread is None:
            return  # never started
        self._thread.join(timeout=15)
        self._thread = None
        if clean:
            try:
                self.store.leave(self.worker.worker_id)
            except StoreUnavailableError as exc:
                log.warning("could not remove the liveness record (it goes stale instead): %s", exc)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.store.beat(self.worker, self._in_flight())
            except StoreUnavailableError as exc:
                # Missed beats only make other workers take this one's keys over; its completions then
                # fail their lease check and record nothing.
                log.warning("heartbeat not written: %s", exc, extra=OUTAGE)
