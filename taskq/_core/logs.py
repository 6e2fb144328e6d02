"""Log lines that come in floods: librdkafka's retries, a worker's while a service is away."""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable, Hashable

__all__ = ["OUTAGE", "OUTAGE_WINDOW", "RepeatFilter", "outage_kind"]

_DIGITS = re.compile(r"\d+")


class RepeatFilter(logging.Filter):
    """Collapses a flood of one kind of log line: the first is logged, then at most one every `window`
    seconds, saying how many like it were held back since the last one shown.

    A kind is the level and the line with its numbers blanked out: while a broker is away librdkafka
    reports "Connect to ... failed (after 0ms in state CONNECT)" about every 50 ms per client.
    """

    def __init__(
        self,
        window: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        kind: Callable[[logging.LogRecord], Hashable | None] | None = None,
    ) -> None:
        """`kind(record)`: the kind of a line, or None for a line never held back; by default, the level
        and the line with its numbers blanked out."""
        super().__init__()
        self.window = window
        self._clock = clock
        self._kind = kind
        self._lock = threading.Lock()
        self._kinds: dict[Hashable, tuple[float, int]] = {}  # kind -> (last shown, held back since)

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether to log this record; the one that ends a held-back run says how many it stood for."""
        text = record.getMessage()
        if self._kind is None:
            kind: Hashable = (record.levelno, _DIGITS.sub("#", text))
        elif (kind := self._kind(record)) is None:
            return True
        now = self._clock()
        with self._lock:
            shown, held = self._kinds.get(kind, (-math.inf, 0))
            if now - shown < self.window:
                self._kinds[kind] = (shown, held + 1)
                return False
            if len(self._kinds) >= 1000:  # bounded: forget the kinds that are quiet
                self._kinds = {k: v for k, v in self._kinds.items() if now - v[0] < self.window}
            self._kinds[kind] = (now, 0)
        if held:
            record.msg, record.args = f"{text} [repeated {held} times in the last {now - shown:.0f} s]", None
        return True


#: The `extra` of a line a worker logs each time it finds a service away (Postgres, say): every 50 ms or so
#: for as long as the outage lasts. The `taskq` command shows the first of each such line, then at most one
#: every OUTAGE_WINDOW seconds saying how many it stands for, so a log that covers an outage still shows what
#: happened around it.
OUTAGE = {"outage": True}
OUTAGE_WINDOW = 10.0


def outage_kind(record: logging.LogRecord) -> Hashable | None:
    """The kind of an outage line for `RepeatFilter` (its logger, level and unformatted message: each retry
    names the error it met, and those differ as a service restarts); None for every other line."""
    if not getattr(record, "outage", False):
        return None
    return (record.name, record.levelno, record.msg)
