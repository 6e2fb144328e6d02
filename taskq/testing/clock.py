"""A clock that tests move forward."""

from __future__ import annotations

import time


class Clock:
    """Real time plus an offset that tests move forward: delays and leases pass without waiting."""

    def __init__(self) -> None:
        self.offset = 0.0

    def time(self) -> float:
        """Wall-clock seconds (what envelopes' not-before and leases are compared with)."""
        return time.time() + self.offset

    def monotonic(self) -> float:
        """Monotonic seconds (what the worker's timers use)."""
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        """Move both clocks forward."""
        self.offset += max(0.0, seconds)

