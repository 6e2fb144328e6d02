"""`RecordingHook`: a worker hook that keeps every event."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from taskq.consumer.events import Event

E = TypeVar("E")


class RecordingHook:
    """A worker hook that keeps every event, so a test can assert on them or wait for one."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._cond = threading.Condition()

    def __call__(self, event: Event) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def of(self, kind: type[E]) -> list[E]:
        """Every event of this type so far."""
        with self._cond:
            return [e for e in self.events if isinstance(e, kind)]

    def wait(self, check: Callable[[], bool], *, timeout: float, what: str) -> None:
        """Block until `check()` holds (checked again on every event); AssertionError after `timeout`."""
        with self._cond:
            if not self._cond.wait_for(check, timeout):
                raise AssertionError(
                    f"timed out after {timeout}s waiting for {what}; last events: {self.events[-20:]}"
                )

    def count(self, kind: type[Event], n: int, *, timeout: float = 60.0) -> None:
        """Wait for at least `n` events of this type."""
        self.wait(lambda: len(self.of(kind)) >= n, timeout=timeout, what=f"{n} {kind.__name__} events")
