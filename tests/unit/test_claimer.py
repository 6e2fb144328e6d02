"""The claimer on the in-memory store: claims on a thread of their own, answered in the order asked."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from taskq._core.errors import StoreUnavailableError
from taskq.consumer.claimer import Claimer
from taskq.consumer.store import Claim, ClaimRequest
from taskq.testing import InMemoryStore


class SlowClaims:
    """Claims that wait for `go`, counting the statements sent."""

    def __init__(self, store: InMemoryStore) -> None:
        self.store = store
        self.go = threading.Event()
        self.statements: list[list[str]] = []
        self.fail: Exception | None = None

    def claim(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        self.go.wait(10)
        self.statements.append([r.idempotency_key for r in requests])
        if self.fail is not None:
            raise self.fail
        return self.store.claim(requests)


def request(key: str) -> ClaimRequest:
    return ClaimRequest(key, f"id-{key}", "unit.Job", 60.0)


def test_batches_asked_while_a_claim_runs_go_out_together_and_are_answered_in_order() -> None:
    store = InMemoryStore(owner="w")
    slow = SlowClaims(store)
    woken = threading.Event()
    claimer: Claimer[str] = Claimer(store, claims=slow, wake=woken.set)  # type: ignore[arg-type]
    claimer.claim(["a"], [request("a")])
    claimer.claim(["b", "c"], [request("b"), request("c")])
    claimer.claim(["d"], [request("d")])
    assert claimer.pending() == 4 and list(claimer) == ["a", "b", "c", "d"]
    assert claimer.answered() == []  # nothing answered yet: the loop goes on
    slow.go.set()
    answers = claimer.answered(timeout=10)
    assert woken.is_set()
    assert [tasks for tasks, _ in answers] == [["a"], ["b", "c"], ["d"]]
    assert [[c.outcome for c in claims] for _, claims in answers if isinstance(claims, list)] == [
        ["claimed"],
        ["claimed", "claimed"],
        ["claimed"],
    ]
    assert len(slow.statements) <= 2 and [k for keys in slow.statements for k in keys] == ["a", "b", "c", "d"]
    assert claimer.pending() == 0
    claimer.close()


def test_an_unavailable_store_is_an_answer_and_any_other_error_is_raised_on_the_loop() -> None:
    store = InMemoryStore(owner="w")
    slow = SlowClaims(store)
    slow.go.set()
    claimer: Claimer[str] = Claimer(store, claims=slow)  # type: ignore[arg-type]
    slow.fail = StoreUnavailableError("postgres is away")
    claimer.claim(["a"], [request("a")])
    [(tasks, answer)] = claimer.answered(timeout=10)
    assert tasks == ["a"] and isinstance(answer, StoreUnavailableError)
    slow.fail = RuntimeError("a bug")
    claimer.claim(["b"], [request("b")])
    with pytest.raises(RuntimeError, match="a bug"):
        claimer.answered(timeout=10)
    claimer.close()


def test_without_a_claims_store_a_claim_is_answered_at_once() -> None:
    claimer: Claimer[str] = Claimer(InMemoryStore(owner="w"))
    claimer.claim(["a"], [request("a")])
    [(tasks, answer)] = claimer.answered()
    assert tasks == ["a"] and isinstance(answer, list) and answer[0].outcome == "claimed"
