"""A test as a user writes one: handlers, InMemoryQueue, no services, well under a second."""

from __future__ import annotations

from collections import Counter
from typing import Any

from taskq import Handlers, Reject, TaskContext
from taskq.testing import InMemoryQueue

SEND = {"type": "record", "name": "Send", "namespace": "shop", "fields": [{"name": "to", "type": "string"}]}


def test_one_effect_per_key_a_retry_and_a_dead_letter_without_services() -> None:
    handlers = Handlers()
    sent: list[str] = []
    attempts: Counter[str] = Counter()

    @handlers.task("shop.Send", schema=SEND, max_attempts=3, timeout=5)
    def send(payload: dict[str, Any], ctx: TaskContext) -> None:
        attempts[payload["to"]] += 1
        if payload["to"] == "flaky" and ctx.attempt == 1:
            raise ConnectionError("mail server busy")
        if payload["to"] == "nobody":
            raise Reject("no such address")
        sent.append(payload["to"])

    with InMemoryQueue(handlers) as q:
        q.producer.enqueue("shop.Send", {"to": "a@example.com"}, idempotency_key="welcome:a")
        q.producer.enqueue("shop.Send", {"to": "a@example.com"}, idempotency_key="welcome:a")  # a duplicate
        q.producer.enqueue("shop.Send", {"to": "flaky"}, idempotency_key="welcome:flaky")
        q.producer.enqueue("shop.Send", {"to": "nobody"}, idempotency_key="welcome:nobody")
        q.run_until_idle()

        assert sorted(sent) == ["a@example.com", "flaky"]  # one effect per key
        assert attempts["flaky"] == 2  # retried once, through a delay tier, fast-forwarded
        assert sorted(c.key for c in q.completed) == ["welcome:a", "welcome:flaky"]
        (dead,) = q.dead_letters
        assert dead.idempotency_key == "welcome:nobody" and "no such address" in dead.reason


def test_the_operators_loop_on_the_fakes_dead_letter_fix_replay_once() -> None:
    handlers, partner_down, sent = Handlers(), [True], []

    @handlers.task("shop.Send", schema=SEND, max_attempts=2)
    def send(payload: dict[str, Any], ctx: TaskContext) -> None:
        if partner_down[0]:
            raise ConnectionError("partner is down")
        sent.append(payload["to"])

    with InMemoryQueue(handlers) as q, q.dlq as dlq:
        q.producer.enqueue("shop.Send", {"to": "a@example.com"}, idempotency_key="hook:a")
        q.run_until_idle()
        (dead,) = dlq.list()
        assert dead.idempotency_key == "hook:a" and dead.attempts == 2 and dlq.depth() == 1
        assert dlq.show(dead.offset).payload == {"to": "a@example.com"}
        partner_down[0] = False  # the fix
        (result,) = dlq.replay([dead.offset])
        assert result.replayed and dlq.depth() == 0
        q.run_until_idle()
        assert sent == ["a@example.com"]
        assert dlq.replay([dead.offset])[0].refused  # a second replay is refused
        (forced,) = dlq.replay([dead.offset], force=True)
        assert forced.already_completed
        q.run_until_idle()
        assert sent == ["a@example.com"]  # and a forced one has no second effect


ORDERED = {
    "type": "record",
    "name": "Step",
    "namespace": "unit",
    "fields": [{"name": "account", "type": "string"}, {"name": "seq", "type": "long"}],
}


def test_ordered_tasks_of_a_key_take_effect_in_enqueue_order_through_retries() -> None:
    handlers = Handlers()
    effects: list[tuple[str, int]] = []
    failed_once: set[tuple[str, int]] = set()

    @handlers.task("unit.Step", schema=ORDERED, ordered=True)
    def step(payload: dict[str, Any], ctx: TaskContext) -> None:
        item = (payload["account"], payload["seq"])
        if payload["seq"] % 4 == 1 and item not in failed_once:
            failed_once.add(item)
            raise RuntimeError("the partner API said 503")
        effects.append(item)

    with InMemoryQueue(handlers, concurrency=8) as q:
        for seq in range(12):
            for account in ("a", "b", "c"):
                q.producer.enqueue("unit.Step", {"account": account, "seq": seq}, key=account)
        q.run_until_idle()
        assert q.dead_letters == []
    assert len(failed_once) == 9  # seq 1, 5 and 9 of each account failed once and ran again
    for account in ("a", "b", "c"):
        assert [seq for acc, seq in effects if acc == account] == list(range(12))


def test_a_batch_is_acknowledged_task_by_task_and_an_empty_one_at_once() -> None:
    handlers = Handlers()

    @handlers.task("shop.Send", schema=SEND)
    def send(payload: dict[str, Any], ctx: TaskContext) -> None:
        return None

    with InMemoryQueue(handlers) as q:
        receipts = q.producer.enqueue_many("shop.Send", [{"to": "a"}, {"to": "b"}], keys=["k", "k"], wait=True)
        assert [r.offset for r in receipts] == [0, 1] and receipts[0].partition == receipts[1].partition
        assert q.producer.enqueue_many("shop.Send", [], wait=True) == []  # nothing to wait for
