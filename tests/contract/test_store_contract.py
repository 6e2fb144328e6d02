"""The idempotency store's rules, the same for InMemoryStore and the Postgres IdempotencyStore."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from taskq._core.errors import InvalidTaskError, NotCancellableError, TaskFailed
from taskq.consumer.store import ClaimRequest, Finished, LeaseLostError, Pauses, SlotRequest, WorkerRecord
from taskq.producer.status import cancel, result_of, status_of
from taskq.testing import InMemoryStore
from tests.acceptance.helpers import wait_until


def req(key: str, lease: float = 30.0) -> ClaimRequest:
    return ClaimRequest(key, f"id-{key}", "contract.Task", lease)


def test_a_new_key_is_claimed_once_and_a_leased_key_is_held(stores: tuple[Any, Any]) -> None:
    a, b = stores
    (first,) = a.claim([req("k")])
    assert (first.outcome, first.attempts) == ("claimed", 1)
    (second,) = b.claim([req("k")])
    assert second.outcome == "running" and 0 < second.lease_left <= 30
    # The same key twice in one batch: the second copy is a duplicate, never a second claim.
    assert [c.outcome for c in a.claim([req("d"), req("d")])] == ["claimed", "duplicate"]


def test_only_the_lease_holder_completes_and_a_completed_key_is_skipped(stores: tuple[Any, Any]) -> None:
    a, b = stores
    a.claim([req("k")])
    assert b.finish([Finished("k", 1, "completed")]) == {"k"}  # not b's lease
    assert a.finish([Finished("k", 2, "completed")]) == {"k"}  # not the current attempt
    assert a.finish([Finished("k", 1, "completed", result={"ok": True})]) == set()
    (again,) = b.claim([req("k")])
    assert (again.outcome, again.attempts) == ("completed", 1)
    row = a.get("k")
    assert row is not None and row["state"] == "completed" and row["result"] == {"ok": True}


def test_a_failed_attempt_is_claimed_again_with_the_next_attempt_number(stores: tuple[Any, Any]) -> None:
    a, b = stores
    a.claim([req("k")])
    assert a.finish([Finished("k", 1, "failed", error="boom")]) == set()
    (retry,) = b.claim([req("k")])
    assert (retry.outcome, retry.attempts) == ("claimed", 2)
    assert b.finish([Finished("k", 2, "dead", error="boom again")]) == set()
    assert a.get("k")["state"] == "dead"
    assert a.reset_for_replay("k") is True and a.reset_for_replay("k") is False
    (replayed,) = a.claim([req("k")])
    assert (replayed.outcome, replayed.attempts) == ("claimed", 1)
    assert a.counts() == {"running": 1}
    assert a.retries() == (0, 0)


def test_a_dead_key_is_skipped_for_its_own_task_and_claimed_by_a_new_one(stores: tuple[Any, Any]) -> None:
    a, b = stores
    a.claim([req("k")])
    assert a.finish([Finished("k", 1, "dead", error="boom")]) == set()
    # The dead-lettered task delivered again (its worker died before committing its offset): skipped.
    (again,) = b.claim([req("k")])
    assert (again.outcome, again.attempts) == ("dead", 1)
    # A new task enqueued with the same key is claimed, with the next attempt number.
    (fresh,) = b.claim([ClaimRequest("k", "id-new", "contract.Task", 30.0)])
    assert (fresh.outcome, fresh.attempts) == ("claimed", 2)


def test_an_expired_lease_is_taken_over_and_the_late_attempt_records_nothing(stores: tuple[Any, Any]) -> None:
    a, b = stores
    a.claim([req("k", lease=0.05)])
    wait_until(lambda: b.claim([req("k")])[0].outcome == "claimed", timeout=10, what="the lease to expire")
    assert a.finish([Finished("k", 1, "completed")]) == {"k"}
    assert b.get("k")["attempts"] == 2 and b.get("k")["lease_owner"] == "b"


def test_one_batch_claims_new_keys_and_answers_every_known_one_by_its_record(stores: tuple[Any, Any]) -> None:
    a, b = stores
    # Known keys, one of each kind: completed, failed, dead (asked for by its own task, then by a new one),
    # leased by a live worker, and leased by one whose lease ended.
    a.claim([req("done"), req("failed"), req("dead"), req("again"), req("held"), req("ended", lease=0.05)])
    assert a.finish(
        [
            Finished("done", 1, "completed"),
            Finished("failed", 1, "failed", error="boom"),
            Finished("dead", 1, "dead", error="boom"),
            Finished("again", 1, "dead", error="boom"),
        ]
    ) == set()
    wait_until(lambda: b.claim([req("ended")])[0].outcome == "claimed", timeout=10, what="the lease to end")
    assert b.release([("ended", 2)]) == {"ended"}  # b gives it back: its lease is over, its attempt uncounted
    again = ClaimRequest("again", "id-new", "contract.Task", 30.0)  # a new task of a dead key
    batch = [req("new-1"), req("done"), req("failed"), req("dead"), again]
    batch += [req("held"), req("ended"), req("new-2"), req("new-1")]
    answers = b.claim(batch)
    assert [(c.idempotency_key, c.outcome, c.attempts) for c in answers] == [
        ("new-1", "claimed", 1),
        ("done", "completed", 1),
        ("failed", "claimed", 2),
        ("dead", "dead", 1),
        ("again", "claimed", 2),
        ("held", "running", 1),
        ("ended", "claimed", 2),
        ("new-2", "claimed", 1),
        ("new-1", "duplicate", 1),
    ]
    assert 0 < answers[5].lease_left <= 30
    # Every claimed key is b's to finish, whichever way it was claimed; the others are not.
    claimed = [c for c in answers[:8] if c.outcome == "claimed"]
    assert b.finish([Finished(c.idempotency_key, c.attempts, "completed") for c in claimed]) == set()
    assert b.finish([Finished("held", 1, "completed")]) == {"held"}
    assert a.counts() == {"completed": 6, "dead": 1, "running": 1}


def test_a_transaction_records_the_completion_only_while_the_lease_holds(stores: tuple[Any, Any]) -> None:
    a, b = stores
    a.claim([req("t")])
    with a.transaction("t", 1, result=None):
        pass
    assert a.get("t")["state"] == "completed"
    a.claim([req("lost", lease=0.05)])
    wait_until(lambda: b.claim([req("lost")])[0].outcome == "claimed", timeout=10, what="a takeover")
    with pytest.raises(LeaseLostError), a.transaction("lost", 1):
        pass
    assert b.get("lost")["state"] == "running"


def test_purge_forgets_old_finished_keys_only(stores: tuple[Any, Any]) -> None:
    a, _ = stores
    a.claim([req("done"), req("busy"), req("in-dlq")])
    a.finish([Finished("done", 1, "completed"), Finished("in-dlq", 1, "completed")])
    assert a.purge(0, keep=["in-dlq"]) == 1  # finished before now; a key still in the DLQ is kept
    assert a.get("done") is None and a.get("busy") is not None and a.get("in-dlq") is not None


def test_purge_keeps_a_key_first_claimed_before_the_cutoff_until_it_has_been_finished_that_long(
    stores: tuple[Any, Any],
) -> None:
    a, _ = stores
    claimed_at = time.time()
    a.claim([req("slow")])
    time.sleep(0.6)  # the attempt runs a while
    a.finish([Finished("slow", 1, "completed")])
    # The cutoff falls between the key's first claim and its completion: it is not old enough yet.
    assert a.purge(time.time() - claimed_at - 0.3) == 0 and a.get("slow") is not None
    assert a.purge(0) == 1 and a.get("slow") is None


def test_a_replay_is_marked_once_unless_forced_and_a_failed_one_leaves_no_mark(replay_log: Any) -> None:
    def replay(offset: int, *, force: bool = False) -> int | None:
        with replay_log.replaying(topic="c.dlq", offset=offset, task_id="t", idempotency_key="k", force=force) as n:
            return n  # type: ignore[no-any-return]

    assert replay(3) == 1
    assert replay(3) is None  # refused: replayed already
    assert replay(3, force=True) == 2
    with pytest.raises(RuntimeError), replay_log.replaying(
        topic="c.dlq", offset=4, task_id="t", idempotency_key="k", force=False
    ):
        raise RuntimeError("the send failed")
    assert set(replay_log.replayed("c.dlq")) == {3}
    assert replay_log.replayed("c.dlq")[3][1] == 2
    assert replay_log.replayed_between("c.dlq", 0, 4) == 1 and replay_log.replayed_between("c.dlq", 4, 9) == 0
    assert replay_log.replayed("other.dlq") == {}


def test_a_released_claim_is_uncounted_and_claimed_at_once_by_another_worker(stores: tuple[Any, Any]) -> None:
    a, b = stores
    a.claim([req("k"), req("lost")])
    assert a.finish([Finished("k", 1, "failed", error="boom")]) == set()
    (second,) = a.claim([req("k")])
    assert second.attempts == 2
    # Claimed ahead, never started, its partition revoked: given back, the attempt uncounted.
    assert b.release([("k", 2)]) == set()  # only the lease holder releases
    assert a.release([("k", 1)]) == set()  # and only its current attempt
    assert a.release([("k", 2)]) == {"k"}
    (taken,) = b.claim([req("k")])
    assert (taken.outcome, taken.attempts) == ("claimed", 2)
    assert a.release([("k", 2)]) == set()  # b holds it now


def test_a_renewed_lease_outlives_its_first_term_and_a_lost_one_is_not_renewed(stores: tuple[Any, Any]) -> None:
    a, b = stores
    a.claim([req("k", lease=0.05), req("gone", lease=0.05)])
    assert a.renew([("k", 1, 30.0)]) == {"k"}
    assert b.renew([("k", 1, 30.0)]) == set()
    wait_until(lambda: b.claim([req("gone")])[0].outcome == "claimed", timeout=10, what="the lease to expire")
    assert a.renew([("gone", 1, 30.0)]) == set()
    (held,) = b.claim([req("k")])
    assert held.outcome == "running" and held.lease_left > 10


def test_namespaces_sharing_a_database_keep_their_own_record_of_a_key(namespaces: tuple[Any, Any]) -> None:
    x, y = namespaces
    (in_x,) = x.claim([req("k")])
    (in_y,) = y.claim([req("k")])  # the same key in another namespace is another task: it runs there too
    assert (in_x.outcome, in_x.attempts) == (in_y.outcome, in_y.attempts) == ("claimed", 1)
    assert x.finish([Finished("k", 1, "completed")]) == set()
    assert y.finish([Finished("k", 1, "dead", error="boom")]) == set()
    assert (x.get("k")["state"], y.get("k")["state"]) == ("completed", "dead")
    assert x.counts() == {"completed": 1} and y.counts() == {"dead": 1}
    assert x.reset_for_replay("k") is False and y.reset_for_replay("k") is True
    assert x.purge(-60) == 1  # x's record only
    assert x.get("k") is None and y.get("k")["state"] == "failed"
    (again,) = y.claim([req("k")])
    assert (again.outcome, again.attempts) == ("claimed", 1)
    assert y.finish([Finished("k", 1, "failed", error="again")]) == set()
    (retry,) = y.claim([req("k")])
    assert retry.attempts == 2 and x.retries() == (0, 0) and y.retries() == (1, 1)


def worker(owner: str, pid: int = 1_000_001, host: str = "host-1", later: float = 0.0) -> WorkerRecord:
    return WorkerRecord(owner, "ns", "ns.workers", host, pid, 4, datetime.now(UTC) + timedelta(seconds=later))


def test_finishing_and_claiming_together_records_the_outcomes_first_and_answers_each_claim(
    stores: tuple[Any, Any],
) -> None:
    a, b = stores
    a.claim([req("done"), req("failed"), req("copy"), req("other")])
    lost, answers = a.finish_and_claim(
        [
            Finished("done", 1, "completed", result=7),
            Finished("failed", 1, "failed", error="boom"),
            Finished("copy", 1, "completed"),
            Finished("other", 2, "completed"),  # not its current attempt: nothing recorded
        ],
        # A redelivered copy of a key finished in the same call is answered as finished, not as leased.
        [req("new"), req("copy"), req("failed"), req("new")],
    )
    assert lost == {"other"}
    assert [(c.idempotency_key, c.outcome, c.attempts) for c in answers] == [
        ("new", "claimed", 1),
        ("copy", "completed", 1),
        ("failed", "claimed", 2),
        ("new", "duplicate", 1),
    ]
    assert a.get("done")["result"] == 7
    # Either half may be empty.
    assert b.finish_and_claim([], [req("other")])[1][0].outcome == "running"
    assert a.finish_and_claim([Finished("new", 1, "completed")], []) == (set(), [])
    assert a.counts() == {"completed": 3, "running": 2}


def test_a_key_leased_by_a_worker_whose_heartbeat_is_stale_is_taken_over_as_the_same_attempt(
    stores: tuple[Any, Any],
) -> None:
    a, b = stores
    a.enter(worker("a"), lambda pid: True)
    a.claim([req("k", lease=300)])
    b.stale_after = 0.3  # seconds; a beats no more
    (held,) = b.claim([req("k")])
    assert held.outcome == "running"  # a's heartbeat is fresh
    taken = wait_until(
        lambda: next((c for c in b.claim([req("k")]) if c.outcome == "claimed"), None),
        timeout=10,
        what="a's heartbeat to go stale",
    )
    # Not charged an attempt: the same attempt runs again, counted as a takeover (a never marked it started).
    assert (taken.attempts, taken.takeovers, taken.interruptions) == (1, 1, 0)
    assert a.finish([Finished("k", 1, "completed")]) == {"k"}  # presumed dead: a records nothing
    row = b.get("k")
    assert (row["lease_owner"], row["attempts"], row["takeovers"]) == ("b", 1, 1)
    assert b.finish([Finished("k", 1, "dead", error="x")]) == set()
    assert b.reset_for_replay("k") and b.get("k")["takeovers"] == 0


def _taken_beating(store: Any, key: str) -> Any:
    """The store's worker beats, as a live one does (only then does it judge others by theirs), and claims
    `key`: the claim if it was taken over, else None."""
    store.beat(worker(store.owner), 0)
    return next((c for c in store.claim([req(key)]) if c.outcome == "claimed"), None)


def test_a_takeover_counts_as_an_interruption_only_when_the_dead_worker_had_marked_the_run_started(
    stores: tuple[Any, Any],
) -> None:
    a, b = stores
    a.enter(worker("a"), lambda pid: True)
    b.enter(worker("b"), lambda pid: True)
    a.stale_after = b.stale_after = 0.3  # seconds; the owner beats no more, and its taker beats as it waits

    def take(store: Any) -> Any:
        return wait_until(
            lambda: _taken_beating(store, "k"), timeout=10, what="the owner's heartbeat to go stale"
        )

    a.claim([req("k", lease=300)])
    # a claimed the key ahead and died without starting it (a plain run marks nothing either): a takeover.
    assert (take(b).takeovers, b.get("k")["interruptions"]) == (1, 0)
    # b claimed it ahead too, and died before starting it: a second takeover, still no interruption.
    taken = take(a)
    assert (taken.attempts, taken.takeovers, taken.interruptions) == (1, 2, 0)
    assert b.mark_started([("k", 1)]) == set()  # only the lease holder's current attempt is marked
    assert a.mark_started([("k", 2)]) == set()
    assert a.mark_started([("k", 1)]) == {"k"} and a.get("k")["started"] is True
    # a dies while running it: that run is known to have started.
    taken = take(b)
    assert (taken.attempts, taken.takeovers, taken.interruptions) == (1, 3, 1)
    row = b.get("k")
    assert (row["lease_owner"], row["takeovers"], row["interruptions"], row["started"]) == ("b", 3, 1, False)
    assert b.finish([Finished("k", 1, "dead", error="x")]) == set()
    assert b.reset_for_replay("k")
    assert (b.get("k")["takeovers"], b.get("k")["interruptions"]) == (0, 0)


def test_a_worker_that_beats_keeps_its_keys_and_its_own_stale_record_never_frees_them_for_itself(
    stores: tuple[Any, Any],
) -> None:
    a, b = stores
    a.enter(worker("a"), lambda pid: True)
    a.claim([req("k", lease=300)])
    a.stale_after = b.stale_after = 0.3
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        a.beat(worker("a"), 1)
        assert [c.outcome for c in b.claim([req("k")])] == ["running"]
        time.sleep(0.1)
    time.sleep(0.5)  # a's record goes stale; a itself still holds its key (a redelivered copy waits)
    assert [c.outcome for c in a.claim([req("k")])] == ["running"]


def test_after_an_outage_every_worker_sat_out_no_worker_is_presumed_dead_until_its_judge_has_beaten_a_while(
    stores: tuple[Any, Any],
) -> None:
    # Postgres unreachable for longer than stale_after without restarting (a network partition, a proxy's
    # restart, a failover to a standby started long ago): no worker could beat, so every record is stale
    # when it ends. The first claim after it must not take a live worker's keys over (its outcome would be
    # refused and its run redone, and a key it ran as a suspect charged an interruption).
    a, b = stores
    a.enter(worker("a"), lambda pid: True)
    b.enter(worker("b"), lambda pid: True)
    a.claim([req("k", lease=300)])
    a.stale_after = b.stale_after = 0.3
    time.sleep(0.5)  # the outage: neither beats
    # b's own record is stale: b was cut off too, and judges nobody by a beat it could not have seen.
    assert [c.outcome for c in b.claim([req("k")])] == ["running"]
    b.beat(worker("b"), 0)
    # b beats again, since just now: a, alive, beats within stale_after of that, and is not judged sooner.
    assert [c.outcome for c in b.claim([req("k")])] == ["running"]
    a.beat(worker("a"), 1)
    deadline = time.monotonic() + 0.8
    while time.monotonic() < deadline:
        a.beat(worker("a"), 1)
        b.beat(worker("b"), 0)
        assert [c.outcome for c in b.claim([req("k")])] == ["running"]
        time.sleep(0.05)

    # A worker that stays silent once its judge has beaten for stale_after is presumed dead, as ever.
    taken = wait_until(lambda: _taken_beating(b, "k"), timeout=10, what="a's heartbeat to go stale")
    assert taken.takeovers == 1


def test_keys_of_a_worker_without_a_liveness_record_wait_for_their_lease(stores: tuple[Any, Any]) -> None:
    a, b = stores
    a.enter(worker("a"), lambda pid: True)
    a.leave("a")  # a clean stop: the record goes
    a.claim([req("k", lease=300)])
    b.stale_after = 0.01
    time.sleep(0.2)
    (held,) = b.claim([req("k")])
    assert held.outcome == "running" and held.lease_left > 250


def test_a_starting_worker_marks_dead_the_gone_processes_of_its_host_and_takes_their_keys_at_once(
    stores: tuple[Any, Any],
) -> None:
    a, b = stores
    a.enter(worker("a", pid=111), lambda pid: True)
    a.claim([req("k", lease=300)])
    a.enter(worker("other-host", pid=111, host="host-2"), lambda pid: True)
    a.enter(worker("younger", pid=333, later=3600), lambda pid: True)
    marked = b.enter(worker("b", pid=222, later=1), lambda pid: pid == 222)
    # Pid 111 is gone from host-1; host-2's pid 111 is not ours to judge, nor a worker started after b.
    assert marked == {"a"}
    (taken,) = b.claim([req("k")])
    assert (taken.outcome, taken.attempts, taken.takeovers) == ("claimed", 1, 1)
    assert b.enter(worker("b", pid=222, later=1), lambda pid: pid == 222) == set()  # marked once
    a.beat(worker("a", pid=111), 0)  # a was alive after all: its record revives, its lost lease stays lost
    assert a.finish([Finished("k", 1, "completed")]) == {"k"}


def slot(key: str, partner: str = "p", limit: int = 2, lease: float = 300.0) -> SlotRequest:
    return SlotRequest(key, "contract.Call", partner, limit, lease)


def test_a_key_gives_at_most_its_limit_of_slots_first_come_and_a_released_slot_goes_to_the_next(
    stores: tuple[Any, Any],
) -> None:
    a, b = stores
    assert a.acquire_slots([slot("k1"), slot("k2"), slot("k3")]) == {"k1", "k2"}
    assert b.acquire_slots([slot("k4"), slot("q1", partner="q")]) == {"q1"}  # p is full; q is another key
    assert b.acquire_slots([SlotRequest("t1", "contract.Other", "p", 1, 300.0)]) == {"t1"}  # another type
    b.release_slots(["k1"])  # not b's slot: nothing freed
    assert b.acquire_slots([slot("k4")]) == set()
    a.release_slots(["k1"])
    assert b.acquire_slots([slot("k4"), slot("k5")]) == {"k4"}
    # A task asking again for the slot it holds (a redelivered copy) keeps it, not a second one.
    assert a.acquire_slots([slot("k2")]) == {"k2"}
    assert b.acquire_slots([slot("k5")]) == set()


def test_slots_of_a_worker_whose_heartbeat_is_stale_or_whose_lease_ended_are_free(
    stores: tuple[Any, Any],
) -> None:
    a, b = stores
    a.enter(worker("a"), lambda pid: True)
    assert a.acquire_slots([slot("k1"), slot("k2", lease=0.05)]) == {"k1", "k2"}
    wait_until(lambda: b.acquire_slots([slot("k3")]) == {"k3"}, timeout=10, what="k2's lease to end")
    assert b.acquire_slots([slot("k4")]) == set()  # k1's holder is alive
    b.stale_after = 0.3  # a beats no more: its k1 frees once its heartbeat is stale
    wait_until(lambda: b.acquire_slots([slot("k4")]) == {"k4"}, timeout=10, what="a's heartbeat to go stale")


def test_a_paused_bucket_grants_nothing_to_anyone_until_the_pause_ends(stores: tuple[Any, Any]) -> None:
    a, b = stores
    name = f"{a.namespace}:contract"
    assert a.take_tokens(name, rate=10, capacity=5, want=3) == (3, 2, 0)
    b.pause_tokens(name, rate=10, capacity=5, seconds=30)
    granted, left, paused = a.take_tokens(name, rate=10, capacity=5, want=1)
    assert (granted, left) == (0, 0) and 25 < paused <= 30
    b.pause_tokens(name, rate=10, capacity=5, seconds=1)  # a shorter pause leaves the longer one
    assert 25 < b.take_tokens(name, rate=10, capacity=5, want=1)[2] <= 30
    short = f"{a.namespace}:short"
    a.pause_tokens(short, rate=10, capacity=5, seconds=0.2)
    wait_until(
        lambda: b.take_tokens(short, rate=10, capacity=5, want=1)[0] == 1, timeout=10, what="the pause"
    )


def test_purge_idle_forgets_only_full_buckets_and_ended_slots(stores: tuple[Any, Any]) -> None:
    a, b = stores
    full, drawn = f"{a.namespace}:full", f"{a.namespace}:drawn"
    a.take_tokens(full, rate=1000, capacity=2, want=1)  # full again within a few ms
    a.take_tokens(drawn, rate=0.001, capacity=5, want=4)  # refills one token in 1,000 s
    assert a.acquire_slots([slot("held"), slot("ended", lease=0.05)]) == {"held", "ended"}
    purged: list[tuple[int, int]] = []
    wait_until(lambda: purged.append(a.purge_idle()) or purged[-1][1] == 1, timeout=10, what="the lease to end")
    # Buckets are shared by every namespace of the database: other full ones may go too.
    assert sum(buckets for buckets, _ in purged) >= 1
    if isinstance(a, InMemoryStore):
        assert set(a.buckets) == {drawn}
    # The drawn bucket still holds its state: 1 token left, not a fresh bucket's 5.
    assert b.take_tokens(drawn, rate=0.001, capacity=5, want=5)[0] == 1
    # The held slot still counts; the ended one was gone for good anyway.
    assert b.acquire_slots([slot("k3"), slot("k4")]) == {"k3"}
    assert b.purge_idle()[1] == 0


def test_a_pause_is_seen_by_every_store_of_its_namespace_until_resumed(
    stores: tuple[Any, Any], namespaces: tuple[Any, Any]
) -> None:
    a, b = stores
    assert b.pauses() == Pauses()
    assert a.pause("tier", "low") is True and a.pause("tier", "low") is False
    assert a.pause("task_type", "contract.Task") is True
    assert b.pauses() == Pauses(tiers=frozenset({"low"}), task_types=frozenset({"contract.Task"}))
    assert b.resume("tier", "low") is True and b.resume("tier", "low") is False
    assert a.pauses() == Pauses(task_types=frozenset({"contract.Task"}))
    x, y = namespaces  # another namespace's pauses are its own
    assert x.pause("tier", "high") is True
    assert y.pauses() == Pauses() and x.pauses() == Pauses(tiers=frozenset({"high"}))


def test_a_result_is_stored_as_json_and_the_status_says_what_became_of_each_task(
    stores: tuple[Any, Any], records: Any
) -> None:
    a, _ = stores
    assert status_of(records.get("k"), task_id="id-k", dlq_topic="t.dlq").state == "unknown"
    a.claim([req("k"), req("f"), req("d")])
    assert status_of(records.get("k"), task_id="id-k", dlq_topic="t.dlq").state == "running"
    assert a.finish([Finished("k", 1, "completed", result={"n": [1, 2], "s": "é"})]) == set()
    assert a.finish([Finished("f", 1, "failed", error="boom")]) == set()
    assert a.finish([Finished("d", 1, "dead", error="bad input", dlq=(2, 41))]) == set()
    done = status_of(records.find("id-k"), task_id="id-k", dlq_topic="t.dlq")
    assert (done.state, done.attempts, done.idempotency_key) == ("completed", 1, "k")
    assert done.result == {"n": [1, 2], "s": "é"}
    assert result_of(done) == {"n": [1, 2], "s": "é"}
    assert status_of(records.get("f"), task_id="id-f", dlq_topic="t.dlq").state == "retrying"
    dead = status_of(records.get("d"), task_id="id-d", dlq_topic="t.dlq")
    assert (dead.state, dead.last_error, dead.dlq_partition, dead.dlq_offset) == ("dead", "bad input", 2, 41)
    with pytest.raises(TaskFailed, match=r"bad input; its DLQ record is t\.dlq\[2\]@41") as failed:
        result_of(dead)
    assert failed.value.dlq_offset == 41
    assert records.find("id-none") is None


def test_a_transaction_records_what_its_block_returned_as_the_result(stores: tuple[Any, Any]) -> None:
    a, _ = stores
    a.claim([req("t")])
    returned: list[Any] = [None]
    with a.transaction("t", 1, result_of=lambda: returned[0]):
        returned[0] = [1, "two"]
    assert a.get("t")["result"] == [1, "two"]


def test_a_cancelled_key_is_never_claimed_and_its_state_says_whether_it_had_started(
    stores: tuple[Any, Any], records: Any
) -> None:
    a, b = stores
    # No record yet (waiting in a tier or a delay tier): cancelled, and a claim answers it as cancelled.
    assert cancel(records, "id-new", "new") is False
    (claim,) = b.claim([req("new")])
    assert claim.outcome == "cancelled"
    assert status_of(records.get("new"), task_id="id-new", dlq_topic="t.dlq").state == "cancelled"
    # Failed, waiting for its next attempt: cancelled, had started.
    a.claim([req("f")])
    a.finish([Finished("f", 1, "failed", error="boom")])
    assert cancel(records, None, "f") is True
    assert b.claim([req("f")])[0].outcome == "cancelled"
    # Running: asked to stop, recorded as usual when it ends; a failed attempt of it is not retried.
    a.claim([req("r"), req("r2")])
    assert cancel(records, "id-r", None) is True
    assert a.cancel_requested(["r", "r2"]) == {"r"}
    assert status_of(records.get("r"), task_id="id-r", dlq_topic="t.dlq").cancel_requested
    a.finish([Finished("r", 1, "failed", error="stopped")])
    assert records.get("r")["state"] == "cancelled"
    # Finished: refused, with its state.
    a.finish([Finished("r2", 1, "completed")])
    with pytest.raises(NotCancellableError, match="is completed already"):
        cancel(records, None, "r2")
    with pytest.raises(NotCancellableError, match="is cancelled already"):
        cancel(records, None, "new")
    # A task id no worker has claimed cannot be found: its key is needed.
    with pytest.raises(InvalidTaskError, match="idempotency key"):
        cancel(records, "id-nobody", None)
