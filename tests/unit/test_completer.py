"""The completer's recorder thread: outcomes written off the loop's thread, callbacks run on it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from taskq._core.errors import StoreUnavailableError
from taskq.consumer.completer import Completer
from taskq.consumer.store import Claim, ClaimRequest, Finished
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


class GatedStore(InMemoryStore):
    """Holds its first round trip until `gate` is set, so what is queued meanwhile goes in one more."""

    def __init__(self) -> None:
        super().__init__(owner="w")
        self.gate, self.entered = threading.Event(), threading.Event()
        self.trips: list[tuple[int, int]] = []  # (outcomes, claim requests) per round trip

    def finish_and_claim(
        self, finished: Sequence[Finished], requests: Sequence[ClaimRequest]
    ) -> tuple[set[str], list[Claim]]:
        self.entered.set()
        self.gate.wait(10)
        self.trips.append((len(finished), len(requests)))
        return super().finish_and_claim(finished, requests)


def test_claims_go_with_the_queued_outcomes_and_each_batch_gets_its_own_answers() -> None:
    store = GatedStore()
    store.claim([ClaimRequest("done", "done", "t", 60.0)])
    completer = Completer(store, InMemoryBroker().sink(), recorder=store)
    answers: dict[str, list[tuple[str, str]]] = {}

    def answered(name: str) -> Callable[[list[Claim] | StoreUnavailableError], None]:
        def on_claimed(claims: list[Claim] | StoreUnavailableError) -> None:
            assert not isinstance(claims, StoreUnavailableError)
            answers[name] = [(c.idempotency_key, c.outcome) for c in claims]

        return on_claimed

    recorded: list[str] = []
    completer.record(Finished("done", 1, "completed"), lambda: recorded.append("done"))
    completer.claim([ClaimRequest("a", "a", "t", 60.0)], answered("first"))
    assert store.entered.wait(10)
    # Asked while the first round trip is held: both go in the next one, each answered for its own keys.
    completer.claim(
        [ClaimRequest("b", "b", "t", 60.0), ClaimRequest("done", "again", "t", 60.0)], answered("2nd")
    )
    completer.claim([ClaimRequest("c", "c", "t", 60.0), ClaimRequest("b", "b", "t", 60.0)], answered("third"))
    assert completer.claiming() == 5
    store.gate.set()
    completer.wait_claimed(10)
    assert completer.claiming() == 0 and recorded == ["done"]
    assert store.trips == [(1, 1), (0, 4)]
    assert answers == {
        "first": [("a", "claimed")],
        "2nd": [("b", "claimed"), ("done", "completed")],
        "third": [("c", "claimed"), ("b", "duplicate")],
    }
    completer.close()
