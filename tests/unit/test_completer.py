"""The completer's recorder thread: outcomes written off the loop's thread, callbacks run on it."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from taskq._core.errors import StoreUnavailableError
from taskq.consumer.completer import Completer
from taskq.consumer.store import ClaimRequest, Finished
from taskq.testing import InMemoryBroker, InMemoryStore


class FlakyStore(InMemoryStore):
    """Refuses the first `failures` writes as if Postgres were away; records which thread wrote."""

    def __init__(self, failures: int) -> None:
        super().__init__(owner="w")
        self.failures = failures
        self.threads: set[str] = set()

    def finish(self, finished: Sequence[Finished]) -> set[str]:
        self.threads.add(threading.current_thread().name)
        if self.failures:
            self.failures -= 1
            raise StoreUnavailableError("Postgres away")
        return super().finish(finished)


def test_outcomes_are_written_on_the_recorder_thread_and_settled_on_the_callers() -> None:
    store = FlakyStore(failures=1)
    store.claim([ClaimRequest(k, k, "t", 60.0) for k in ("a", "b")])
    completer = Completer(store, InMemoryBroker().sink(), recorder=store)
    settled: list[tuple[str, str]] = []
    for key in ("a", "b"):
        completer.record(
            Finished(key, 1, "completed"), lambda k=key: settled.append((k, threading.current_thread().name))
        )
    completer.flush()
    assert completer.pending() == 2  # handed to the recorder, not yet settled
    completer.wait_recorded(10)  # the first write is refused: queued again, and written by the next
    completer.wait_recorded(10)
    assert settled == [("a", "MainThread"), ("b", "MainThread")]
    assert store.threads == {"taskq-recorder"}
    assert completer.pending() == 0
    assert [store.get(k)["state"] for k in ("a", "b")] == ["completed", "completed"]
    completer.close()
