"""The watchdog: one daemon thread running callbacks at deadlines for the executor."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

_log = logging.getLogger("taskq.executor")


@dataclass(order=True, slots=True)
class Timer:
    when: float
    seq: int
    fn: Callable[[], None] | None = field(compare=False)


class Watchdog:
    """One daemon thread running callbacks at deadlines: timeouts, and on_done calls from the loop."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[Timer] = []
        self._seq = itertools.count()
        self._cancelled = 0
        self._closed = False
        self._thread: threading.Thread | None = None

    def schedule(self, when: float, fn: Callable[[], None]) -> Timer | None:
        """Run fn on the watchdog thread at monotonic time `when` (None once closed)."""
        with self._cond:
            if self._closed:
                return None
            timer = Timer(when, next(self._seq), fn)
            heapq.heappush(self._heap, timer)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="taskq-watchdog", daemon=True)
                self._thread.start()
            elif self._heap[0] is timer:
                # Only a timer that is now the earliest moves the thread's wake-up. A task's timeout is
                # scheduled at every start and is almost never the earliest: waking the thread for it
                # would cost a thread switch a task for nothing.
                self._cond.notify()
            return timer

    def cancel(self, timer: Timer | None) -> None:
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
