"""The Postgres layer on a real database: the connector's named queries and transactions, and the Store."""

from __future__ import annotations

import re
import select
import tempfile
import threading
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from psycopg import pq

from taskq._core.db import Database, Transaction
from taskq._core.errors import StoreUnavailableError
from taskq._core.settings import Settings
from taskq._core.store import Claim, ClaimRequest, Finished, Store
from taskq.consumer.store import IdempotencyStore, LeaseLostError, Member
from tests.acceptance.helpers import wait_until


@pytest.fixture
def db(base_settings: Settings) -> Iterator[Database]:
    """A migrated schema of the test's own (no topics: these tests never touch Kafka)."""
    database = Database(base_settings.database_url, schema="t" + uuid.uuid4().hex[:10])
    database.migrate()
    yield database
    database.close()
    database.drop_schema()


def _backend_pid(db: Database) -> int:
    assert db._conn is not None
    return db._conn.info.backend_pid


def _record_replay(store: Store, tx: Transaction, offset: int = 0) -> int | None:
    return store.dlq_record_replay(
        tx, topic="t.dlq", offset=offset, task_id="t1", idempotency_key="k", force=False
    )


def _terminate(db: Database, pid: int) -> None:
    with db.connection() as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))


def test_named_queries_return_a_row_rows_and_a_row_count(db: Database) -> None:
    assert db.one("get", namespace="ns", key="nothing") is None
    claim = {"namespace": "ns", "stale_after": 10.0, "keys": ["a", "b"], "task_ids": ["1", "2"]}
    claim |= {"task_types": ["t", "t"], "leases": [60.0, 60.0]}
    assert db.all("claim", **claim, owner="w") == []  # new keys, claimed: only keys known before answer
    row = db.one("get", namespace="ns", key="a")
    assert row is not None and (row["state"], row["lease_owner"]) == ("running", "w")
    rows = db.all("claim", **claim, owner="w2")
    assert sorted((r["idempotency_key"], r["outcome"], r["attempts"]) for r in rows) == [
        ("a", "running", 1),
        ("b", "running", 1),
    ]
    assert db.all("counts", namespace="ns") == [{"state": "running", "n": 2}]
    db.all(
        "fail", namespace="ns", keys=["a", "b"], attempts=[1, 1], states=["dead", "dead"], errors=["x", "y"], owner="w",
        dlq_partitions=[0, 0], dlq_offsets=[7, None],
    )
    assert db.execute("purge", namespace="ns", ttl_seconds=-60, batch=10, keep=[]) == 2


def test_a_transaction_commits_on_a_clean_exit_and_rolls_back_on_an_error(db: Database) -> None:
    store = Store(db)
    with db.transaction() as tx:
        assert _record_replay(store, tx) == 1
        assert store.dlq_replayed("t.dlq") == {}  # not visible outside until committed
    assert set(store.dlq_replayed("t.dlq")) == {0}

    with pytest.raises(RuntimeError, match="send failed"), db.transaction() as tx:
        _record_replay(store, tx, offset=1)
        raise RuntimeError("send failed")
    assert set(store.dlq_replayed("t.dlq")) == {0}
    assert store.dlq_replayed_between("t.dlq", 0, 2) == 1

    with db.transaction() as tx:  # replayed before and not forced: refused, and nothing changes
        assert _record_replay(store, tx) is None
    assert store.dlq_replayed("t.dlq")[0][1] == 1


def test_a_replay_row_holds_a_concurrent_replay_until_it_commits_which_then_refuses_it(db: Database) -> None:
    store = Store(db)
    second: list[int | None] = []

    def replay_again() -> None:
        with db.transaction() as tx:
            second.append(_record_replay(store, tx))

    with db.transaction() as tx:
        assert _record_replay(store, tx) == 1
        thread = threading.Thread(target=replay_again)
        thread.start()
        with db.connection() as probe:

            def blocked() -> bool:
                row = probe.execute(
                    "SELECT count(*) AS n FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
                    (tx.connection.info.backend_pid,),
                ).fetchone()
                return row is not None and row["n"] == 1

            wait_until(blocked, timeout=30, what="the second replay to wait on the first one's row")
        assert not second
    thread.join(30)
    assert second == [None]


def test_a_driver_error_becomes_store_unavailable_naming_the_query_without_the_password(
    base_settings: Settings,
) -> None:
    password = urlsplit(base_settings.database_url).password
    unmigrated = Database(base_settings.database_url, schema="t" + uuid.uuid4().hex[:10])
    try:
        with pytest.raises(StoreUnavailableError) as info:
            Store(unmigrated).counts("ns")
    finally:
        unmigrated.close()
    assert "'counts'" in str(info.value) and "taskq_tasks" in str(info.value)
    assert isinstance(info.value.__cause__, psycopg.Error)
    assert not password or password not in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://taskq:s3cret-pw@127.0.0.1:1/taskq",
        "host=127.0.0.1 port=1 user=taskq password=s3cret-pw dbname=taskq",
    ],
)
def test_an_unreachable_database_is_store_unavailable_without_the_password(url: str) -> None:
    db = Database(url)
    with pytest.raises(StoreUnavailableError) as info:
        db.one("counts", namespace="ns")
    assert "127.0.0.1" in str(info.value) and "s3cret-pw" not in str(info.value)
    assert isinstance(info.value.__cause__, psycopg.OperationalError)


def test_the_kept_connection_is_dropped_after_it_breaks_and_the_next_query_reconnects(db: Database) -> None:
    assert db.all("counts", namespace="ns") == []
    pid = _backend_pid(db)
    _terminate(db, pid)
    with pytest.raises(StoreUnavailableError, match="'counts'") as info:
        db.all("counts", namespace="ns")
    assert isinstance(info.value.__cause__, psycopg.OperationalError)
    assert db._conn is None
    assert db.all("counts", namespace="ns") == []
    assert _backend_pid(db) != pid


def _prepared_and_bound(conn: Any, run: Any) -> list[tuple[str, str]]:
    """(message, statement name) of each Parse and Bind `run()` sent on `conn`, from libpq's trace."""
    # `F <length> Parse "statement" ...` and `F <length> Bind "portal" "statement" ...`
    found = re.finditer(
        r'^F\t\d+\t(?:(Parse)\t "([^"]*)"|(Bind)\t "[^"]*" "([^"]*)")', _traced(conn, run), re.M
    )
    return [(m.group(1) or m.group(3), m.group(2) or m.group(4)) for m in found]


def test_the_recorders_round_trip_prepares_its_statements_once_per_connection(db: Database) -> None:
    # Claims and outcomes go through libpq as statements prepared on the kept connection: the same round
    # trip through psycopg's cursors cost the process five times the CPU. A new connection (the last one
    # was lost) has none of them, and prepares them again.
    store = IdempotencyStore(db, owner="w", namespace="ns")
    assert store.get("k0") is None  # the kept connection, opened by a query through psycopg

    def steps(first: int) -> None:
        for i in range(first, first + 3):
            done = [Finished(f"k{i}", 1, "completed")]
            claims = [ClaimRequest(f"k{i + 1}", "t", "t", 60.0)]
            assert store.finish_and_claim(done, claims) == (set(), [Claim(f"k{i + 1}", "claimed", 1)])

    def claim_then_steps() -> None:
        store.claim([ClaimRequest("k0", "k0", "t", 60.0)])
        steps(0)

    sent = _prepared_and_bound(db._conn, claim_then_steps)
    # Named by their parameters' types: keys text[], attempts int[], results jsonb[], leases float8[], ...
    complete, claim = "taskq_complete_1009_1007_3807_25_25", "taskq_claim_1009_1009_1009_1022_25_25_701"
    assert sent == [("Parse", claim), ("Bind", claim), ("Parse", complete)] + [
        ("Bind", complete),
        ("Bind", claim),
    ] * 3
    _terminate(db, _backend_pid(db))
    with pytest.raises(StoreUnavailableError, match="pipeline failed"):
        store.finish_and_claim([Finished("k3", 1, "completed")], [])
    assert db._conn is None
    assert store.get("other") is None  # a new kept connection
    sent = _prepared_and_bound(db._conn, lambda: steps(3))
    assert sent[:2] == [("Parse", complete), ("Parse", claim)]
    states = [row["state"] for row in map(store.get, [f"k{i}" for i in range(7)])]
    assert states == ["completed"] * 6 + ["running"]


def test_a_round_trip_whose_statement_fails_records_nothing_and_the_next_one_does(db: Database) -> None:
    # One transaction: a claim the server refuses (its lease overflows an interval) takes the completion
    # sent with it back too, and the completion is recorded by the next round trip.
    store = IdempotencyStore(db, owner="w", namespace="ns")
    store.claim([ClaimRequest("a", "a", "t", 60.0)])
    with pytest.raises(StoreUnavailableError, match="interval out of range"):
        store.finish_and_claim([Finished("a", 1, "completed")], [ClaimRequest("b", "b", "t", 1e300)])
    row = store.get("a")
    assert row is not None and row["state"] == "running" and store.get("b") is None
    assert store.finish_and_claim([Finished("a", 1, "completed")], []) == (set(), [])
    row = store.get("a")
    assert row is not None and row["state"] == "completed"


def test_a_round_trip_sends_what_its_statements_take_and_reads_back_what_they_answer(db: Database) -> None:
    # Parameters in binary, built by hand: text and jsonb beyond ASCII, NULL and large elements of integer
    # arrays; rows read by their columns' types.
    a = IdempotencyStore(db, owner="w", namespace="ns")
    b = IdempotencyStore(db, owner="w2", namespace="ns")
    keys = ["ключ-é", "d", "f", "held"]
    a.claim([ClaimRequest(k, f"id-{k}", "t", 60.0) for k in keys])
    held = [ClaimRequest("held", "id-held", "t", 30.0)]
    lost, claims = b.finish_and_claim([Finished("held", 1, "completed")], held)
    assert lost == {"held"} and [(c.outcome, c.attempts) for c in claims] == [("running", 1)]
    assert 50 < claims[0].lease_left <= 60
    result = {"s": "é ✓", "n": [1, 2.5, None], "t": True}
    finished = [
        Finished("ключ-é", 1, "completed", result=result),
        Finished("d", 1, "dead", error="bad input ✗", dlq=(3, 2**40)),
        Finished("f", 1, "failed", error="boom"),
    ]
    assert a.finish_and_claim(finished, [ClaimRequest("f", "id-f", "t", 60.0)]) == (
        set(),
        [Claim("f", "claimed", 2)],
    )
    row = a.get("ключ-é")
    assert row is not None and (row["state"], row["result"]) == ("completed", result)
    row = a.get("d")
    assert row is not None and (row["state"], row["last_error"]) == ("dead", "bad input ✗")
    assert (row["dlq_partition"], row["dlq_offset"]) == (3, 2**40)


def test_the_store_records_claims_and_outcomes_under_the_owners_lease(db: Database) -> None:
    store = Store(db)
    requests = [ClaimRequest("a", "1", "t", 60), ClaimRequest("b", "2", "t", 60)]
    claims = store.claim("ns", "w1", requests, stale_after=10.0)
    assert [(c.idempotency_key, c.outcome, c.attempts) for c in claims] == [
        ("a", "claimed", 1),
        ("b", "claimed", 1),
    ]
    [held] = store.claim("ns", "w2", [ClaimRequest("a", "1", "t", 60)], stale_after=10.0)
    assert held.outcome == "running" and 0 < held.lease_left <= 60
    assert store.complete("ns", "w2", [Finished("a", 1, "completed")]) == set()  # not w2's lease
    assert store.complete("ns", "w1", [Finished("a", 1, "completed", result={"ok": True})]) == {"a"}
    assert store.fail("ns", "w1", [Finished("b", 1, "dead", error="boom")]) == {"b"}
    row = store.get("ns", "a")
    assert row is not None and (row["state"], row["result"]) == ("completed", {"ok": True})
    assert store.counts("ns") == {"completed": 1, "dead": 1}
    assert store.reset_for_replay("ns", "b") and not store.reset_for_replay("ns", "a")
    [again] = store.claim("ns", "w2", [ClaimRequest("b", "2", "t", 60)], stale_after=10.0)
    assert (again.outcome, again.attempts) == ("claimed", 1)
    assert store.retries("ns") == (0, 0)
    assert store.purge("ns", -60, batch=10) == 1  # the completed key; b runs again
    granted, left, _ = store.take_tokens("ns:*:*", rate=10, capacity=5, want=3)
    assert (granted, left) == (3, 2)


def _updates(tx: Transaction) -> tuple[int, int]:
    """(rows updated, of which HOT) in taskq_tasks by the transaction so far."""
    row = tx.connection.execute(
        "SELECT pg_stat_get_xact_tuples_updated('taskq_tasks'::regclass) AS n, "
        "pg_stat_get_xact_tuples_hot_updated('taskq_tasks'::regclass) AS hot"
    ).fetchone()
    assert row is not None
    return int(row["n"]), int(row["hot"])


def test_a_batch_of_completions_are_hot_updates_that_touch_no_index(db: Database) -> None:
    # No index on a column a completion changes, and room on each page for the completed versions of the
    # rows claimed into it: every completion of a batch is a heap-only update. (A completion with a result
    # makes its row longer, and may not find the room.)
    store = Store(db)
    for b in range(3):
        keys = [f"k{b}-{i}" for i in range(500)]
        requests = [ClaimRequest(k, f"id-{k}", "t", 60.0) for k in keys]
        claims = store.claim("ns", "w", requests, stale_after=10.0)
        with db.transaction() as tx:
            done = [Finished(c.idempotency_key, c.attempts, "completed") for c in claims]
            assert store.complete("ns", "w", done, tx=tx) == set(keys)
            assert _updates(tx) == (500, 500)
    with db.transaction() as tx:
        failed = store.claim("ns", "w", [ClaimRequest("f", "id-f", "t", 60.0)], stale_after=10.0)
        assert store.fail("ns", "w", [Finished("f", failed[0].attempts, "failed", error="boom")]) == {"f"}
    assert store.completed_since("ns", 60) == 1500
    assert store.completed_since("other", 60) == 0


@pytest.fixture
def effects(db: Database) -> Database:
    with db.connection() as conn:
        conn.execute("CREATE TABLE effects (id text PRIMARY KEY)")
    return db


def _effects(db: Database) -> list[str]:
    with db.connection() as conn:
        return [r["id"] for r in conn.execute("SELECT id FROM effects ORDER BY id")]


def test_a_handler_transaction_commits_its_writes_with_the_completion(effects: Database) -> None:
    store = IdempotencyStore(effects, owner="w1", namespace="ns")
    try:
        [claim] = store.claim([ClaimRequest("k", "1", "t", 60)])
        with store.transaction("k", claim.attempts, result=7) as conn:
            conn.execute("INSERT INTO effects (id) VALUES ('k')")
        row = store.get("k")
        assert row is not None and (row["state"], row["result"]) == ("completed", 7)
        assert _effects(effects) == ["k"]
    finally:
        store.close()


def test_a_handler_transaction_whose_lease_was_taken_over_rolls_back(effects: Database) -> None:
    store = IdempotencyStore(effects, owner="w1", namespace="ns")
    try:
        store.claim([ClaimRequest("k", "1", "t", 0.0)])  # a lease that has expired already
        [taken] = IdempotencyStore(effects, owner="w2", namespace="ns").claim([ClaimRequest("k", "1", "t", 60)])
        assert (taken.outcome, taken.attempts) == ("claimed", 2)
        with pytest.raises(LeaseLostError), store.transaction("k", 1) as conn:
            conn.execute("INSERT INTO effects (id) VALUES ('k')")
        assert _effects(effects) == []
        row = store.get("k")
        assert row is not None and (row["state"], row["lease_owner"]) == ("running", "w2")
    finally:
        store.close()


def test_a_thread_keeps_its_handler_connection_and_replaces_a_broken_one(effects: Database) -> None:
    store = IdempotencyStore(effects, owner="w1", namespace="ns")
    try:
        store.claim([ClaimRequest(k, k, "t", 60) for k in ("a", "b", "c")])
        with pytest.raises(ValueError), store.transaction("a", 1) as conn:
            first = conn
            conn.execute("INSERT INTO effects (id) VALUES ('a')")
            raise ValueError("the handler failed")
        assert _effects(effects) == []
        with store.transaction("b", 1) as conn:
            assert conn is first  # rolled back and idle: kept for the next task
            pid = conn.info.backend_pid
        _terminate(effects, pid)
        with pytest.raises(psycopg.OperationalError), store.transaction("c", 1) as conn:
            conn.execute("INSERT INTO effects (id) VALUES ('c')")
        with store.transaction("c", 1) as conn:
            assert conn is not first and not conn.closed
            conn.execute("INSERT INTO effects (id) VALUES ('c')")
        assert _effects(effects) == ["c"]
    finally:
        store.close()


def _plan(db: Database, name: str, **params: object) -> str:
    """EXPLAIN of a named query on the kept connection (the one the worker's claims and completions use)."""
    from taskq._core.db import queries

    db.all("counts", namespace="ns")  # open the kept connection
    assert db._conn is not None
    rows = db._conn.execute("EXPLAIN " + queries()[name], params).fetchall()
    return "\n".join(str(next(iter(r.values()))) for r in rows)


def test_claims_and_completions_reach_rows_by_key_on_a_new_unanalyzed_table(db: Database) -> None:
    # A new deployment: a table of some thousands of rows and no statistics yet. Planned by default, the
    # completion of a batch is a nested loop over a scan of the whole table (50 ms per 500 keys at 30,000).
    store = Store(db)
    for b in range(8):
        keys = [f"k{b}-{i}" for i in range(500)]
        store.claim("ns", "w", [ClaimRequest(k, k, "t", 60.0) for k in keys], stale_after=10.0)
        store.complete("ns", "w", [Finished(k, 1, "completed") for k in keys])
    keys = [f"new-{i}" for i in range(500)]
    claim = _plan(db, "claim", namespace="ns", stale_after=10.0, keys=keys, task_ids=keys, task_types=keys, leases=[60.0] * 500, owner="w")
    complete = _plan(db, "complete", namespace="ns", keys=keys, attempts=[1] * 500, results=[None] * 500, owner="w")
    fail = _plan(db, "fail", namespace="ns", keys=keys, attempts=[1] * 500, states=["dead"] * 500, errors=[""] * 500, owner="w",
                 dlq_partitions=[0] * 500, dlq_offsets=list(range(500)))
    for plan in (claim, complete, fail):
        assert "Seq Scan on taskq_tasks" not in plan, plan
        assert "Join Filter" not in plan, plan  # a nested loop comparing every key with every row
    assert "Index Scan using taskq_tasks_pkey" in claim, claim
    # Each key is its own probe of the primary key, not a scan of the namespace's whole range filtered by key.
    for plan in (complete, fail):
        assert "Index Cond: ((idempotency_key = ANY" in plan, plan


def _group_store(db: Database) -> IdempotencyStore:
    with db.connection() as conn:
        # Deferred: a duplicate is found only at commit, which is how a commit can fail after every member ran.
        conn.execute("CREATE TABLE group_effects (k text, CONSTRAINT once UNIQUE (k) DEFERRABLE INITIALLY DEFERRED)")
    store = IdempotencyStore(db, owner="w", namespace="ns")
    store.claim([ClaimRequest(k, k, "t", 60.0) for k in ("a", "b", "c")])
    return store


def _insert(value: str, *, then_raise: bool = False) -> Any:
    def call(conn: Any) -> None:
        conn.execute("INSERT INTO group_effects (k) VALUES (%s)", (value,))
        if then_raise:
            raise ValueError(f"member {value} failed after its write")

    return call


def _group_effects(db: Database) -> list[str]:
    with db.connection() as conn:
        return sorted(r["k"] for r in conn.execute("SELECT k FROM group_effects").fetchall())


def test_a_group_commit_records_the_members_that_returned_and_rolls_back_the_one_that_raised(
    db: Database,
) -> None:
    store = _group_store(db)
    members = [
        Member("a", 1, _insert("a")),
        Member("b", 1, _insert("b", then_raise=True)),
        Member("c", 1, _insert("c")),
    ]
    store.run_group(members)
    assert [type(m.error).__name__ if m.error else None for m in members] == [None, "ValueError", None]
    assert _group_effects(db) == ["a", "c"]  # the raising member's write rolled back to its savepoint, alone
    assert [store.get(k)["state"] for k in ("a", "b", "c")] == ["completed", "running", "completed"]
    store.close()


def _traced(conn: Any, run: Any) -> str:
    """libpq's trace of what `run()` sent on `conn` and got back: the wire as the server saw it."""
    with tempfile.TemporaryFile() as trace:
        conn.pgconn.trace(trace.fileno())
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            run()
        finally:
            conn.pgconn.untrace()
        trace.seek(0)
        return trace.read().decode()


def _statements_sent(conn: Any, run: Any) -> list[str]:
    """The statements `run()` sent on `conn` (their first lines), read from libpq's trace."""
    lines = _traced(conn, run).splitlines()
    return [line.split('"')[3] for line in lines if line.startswith("F") and "\tParse\t" in line]


def _a_group_connection(store: IdempotencyStore) -> Any:
    """The connection this thread's groups run on (a first group opens it)."""
    conns: list[Any] = []
    store.run_group([Member("a", 1, lambda conn: conns.append(conn))])
    return conns[0]


def test_a_group_whose_members_all_return_sends_no_savepoint(db: Database) -> None:
    # A savepoint per member was a statement and a subtransaction per task, a quarter of an exactly-once
    # task's cost; with no member raising, nothing needs rolling back alone.
    store = _group_store(db)
    store.claim([ClaimRequest(k, k, "t", 60.0) for k in ("d", "e")])
    conn = _a_group_connection(store)
    sent = _statements_sent(conn, lambda: store.run_group([Member(k, 1, _insert(k)) for k in ("b", "c", "d")]))
    assert not [s for s in sent if "SAVEPOINT" in s], sent
    assert sent.count("INSERT INTO group_effects (k) VALUES ($1)") == 3
    assert _group_effects(db) == ["b", "c", "d"]
    assert [store.get(k)["state"] for k in ("a", "b", "c", "d")] == ["completed"] * 4
    store.close()


def test_a_member_that_raises_costs_its_group_a_second_pass_with_savepoints(db: Database) -> None:
    # Its writes cannot be rolled back alone without a savepoint: the pass is dropped, and the group runs
    # again with one per member. The members before it and itself are called twice in that attempt; only
    # the second calls' writes count.
    store = _group_store(db)
    conn = _a_group_connection(store)
    calls: list[str] = []

    def member(key: str, *, then_raise: bool = False) -> Member:
        insert = _insert(key, then_raise=then_raise)

        def call(conn: Any) -> None:
            calls.append(key)
            insert(conn)

        return Member(key, 1, call)

    members = [member("b"), member("c", then_raise=True), member("d")]
    store.claim([ClaimRequest("d", "d", "t", 60.0)])
    sent = _statements_sent(conn, lambda: store.run_group(members))
    assert calls == ["b", "c", "b", "c", "d"]
    assert [type(m.error).__name__ if m.error else None for m in members] == [None, "ValueError", None]
    assert _group_effects(db) == ["b", "d"]
    assert [store.get(k)["state"] for k in ("b", "c", "d")] == ["completed", "running", "completed"]
    assert [s for s in sent if s.startswith("SAVEPOINT")] == [f"SAVEPOINT taskq_member_{i}" for i in range(3)]
    store.close()


def test_a_member_that_raises_before_sending_a_statement_is_called_once_and_its_group_goes_on(
    db: Database,
) -> None:
    # Nothing of it is in the transaction, so nothing needs rolling back: no second pass, and each attempt
    # is one call (a handler that fails on its input, or on a service it calls before writing, the usual way).
    store = _group_store(db)
    conn = _a_group_connection(store)
    calls: list[str] = []

    def member(key: str, *, raise_first: bool = False) -> Member:
        insert = _insert(key)

        def call(conn: Any) -> None:
            calls.append(key)
            if raise_first:
                raise ValueError(f"member {key} failed before writing")
            insert(conn)

        return Member(key, 1, call)

    members = [member("b"), member("c", raise_first=True)]
    store.claim([ClaimRequest("d", "d", "t", 60.0)])
    members.append(member("d"))
    sent = _statements_sent(conn, lambda: store.run_group(members))
    assert calls == ["b", "c", "d"]
    assert [type(m.error).__name__ if m.error else None for m in members] == [None, "ValueError", None]
    assert _group_effects(db) == ["b", "d"]
    assert [store.get(k)["state"] for k in ("b", "c", "d")] == ["completed", "running", "completed"]
    assert not [s for s in sent if "SAVEPOINT" in s], sent
    store.close()


def test_groups_keep_savepoints_while_members_keep_raising_and_drop_them_once_they_stop(db: Database) -> None:
    # Where most groups have a member that raises after writing, a first pass without savepoints is mostly
    # wasted: the store sends them from the start until groups stop raising.
    store = _group_store(db)
    keys = [f"k{i}" for i in range(40)]
    store.claim([ClaimRequest(k, k, "t", 60.0) for k in keys])
    conn = _a_group_connection(store)

    def raising_group(key: str) -> int:
        calls: list[str] = []

        def call(conn: Any) -> None:
            calls.append(key)
            _insert(key, then_raise=True)(conn)

        store.run_group([Member(key, 1, call)])
        return len(calls)

    assert raising_group(keys[0]) == 2  # the first pass, without savepoints, and the second, with
    passes = [raising_group(k) for k in keys[1:6]]
    assert passes[-1] == 1, passes  # raising groups no longer pay a first pass
    sent = _statements_sent(conn, lambda: store.run_group([Member(keys[6], 1, _insert(keys[6]))]))
    assert "SAVEPOINT taskq_member_0" in sent  # nor does a clean group right after them
    for k in keys[7:30]:
        store.run_group([Member(k, 1, _insert(k))])
    sent = _statements_sent(conn, lambda: store.run_group([Member(keys[30], 1, _insert(keys[30]))]))
    assert not [s for s in sent if "SAVEPOINT" in s], sent  # clean groups again: no savepoints
    store.close()


def test_a_failed_group_commit_leaves_no_effect_and_no_completion(db: Database) -> None:
    store = _group_store(db)
    members = [Member("a", 1, _insert("x")), Member("b", 1, _insert("y")), Member("c", 1, _insert("x"))]
    with pytest.raises(psycopg.errors.UniqueViolation):
        store.run_group(members)  # every member returned; the commit itself fails
    assert _group_effects(db) == []
    assert [store.get(k)["state"] for k in ("a", "b", "c")] == ["running"] * 3
    # The connection is usable again for the next group.
    store.run_group([Member("a", 1, _insert("a"))])
    assert _group_effects(db) == ["a"]
    store.close()


def test_a_group_whose_member_lost_its_lease_records_nothing(db: Database) -> None:
    store = _group_store(db)
    store.release([("b", 1)])
    IdempotencyStore(db, owner="other", namespace="ns").claim([ClaimRequest("b", "b", "t", 60.0)])
    members = [Member("a", 1, _insert("a")), Member("b", 1, _insert("b"))]
    with pytest.raises(LeaseLostError) as lost:
        store.run_group(members)
    assert lost.value.keys == {"b"}
    assert _group_effects(db) == [] and store.get("a")["state"] == "running"
    store.close()


def test_a_groups_statements_are_answered_together_not_one_by_one(db: Database) -> None:
    # Pipelined: a member's INSERT is sent, not waited for (one round trip per group, not per statement).
    store = _group_store(db)
    answered: list[bool] = []

    def call(conn: Any) -> None:
        answered.append(conn.execute("INSERT INTO group_effects (k) VALUES ('a')").pgresult is not None)

    store.run_group([Member("a", 1, call)])
    assert answered == [False]
    assert _group_effects(db) == ["a"] and store.get("a")["state"] == "completed"
    store.close()


def test_a_group_sends_one_begin_not_a_second_one_the_server_warns_about(db: Database) -> None:
    # A second BEGIN cost a statement and a server log line per group ("there is already a transaction in
    # progress"), thousands a second under load.
    store = _group_store(db)
    notices: list[str | None] = []
    conns: list[Any] = []

    def call(conn: Any) -> None:
        conns.append(conn)
        conn.execute("INSERT INTO group_effects (k) VALUES ('a')")

    store.run_group([Member("a", 1, call)])
    conns[0].add_notice_handler(lambda diag: notices.append(diag.message_primary))
    store.run_group([Member("b", 1, _insert("b")), Member("c", 1, _insert("c"))])
    assert notices == []
    assert _group_effects(db) == ["a", "b", "c"]
    assert conns[0].autocommit is False  # as a single transactional handler's transaction expects
    store.close()


def test_a_member_whose_statement_fails_at_the_server_fails_alone(db: Database) -> None:
    # Its error comes back only when the group's statements are answered: the group runs again one member
    # at a time, so the others' effects are recorded once and the failing one's error is its own.
    store = _group_store(db)
    calls: list[str] = []

    def bad(conn: Any) -> None:
        calls.append("b")
        conn.execute("INSERT INTO group_effects (k) VALUES ('b'::int::text)")

    members = [Member("a", 1, _insert("a")), Member("b", 1, bad), Member("c", 1, _insert("c"))]
    store.run_group(members)
    assert [type(m.error).__name__ if m.error else None for m in members] == [None, "InvalidTextRepresentation", None]
    assert _group_effects(db) == ["a", "c"]
    assert [store.get(k)["state"] for k in ("a", "b", "c")] == ["completed", "running", "completed"]
    assert calls == ["b", "b"]  # the pipelined pass, then the one answered member by member
    store.close()


def test_a_server_failure_read_during_a_later_members_call_fails_only_its_own_member(db: Database) -> None:
    # The driver reads answers as they arrive: when the failure comes back while a later member runs, that
    # member's call raises it. The pass must still be dropped cleanly (its pipeline answered before the
    # rollback) and the group run again, where the later member succeeds.
    store = _group_store(db)

    def bad(conn: Any) -> None:
        conn.execute("INSERT INTO group_effects (k) VALUES ('b'::int::text)")

    def late(conn: Any) -> None:
        # Wait until the failure is on the connection's socket, so the next statement's send reads it.
        select.select([conn.pgconn.socket], [], [], 5.0)
        conn.execute("INSERT INTO group_effects (k) VALUES ('c')")

    members = [Member("a", 1, _insert("a")), Member("b", 1, bad), Member("c", 1, late)]
    store.run_group(members)
    assert [type(m.error).__name__ if m.error else None for m in members] == [None, "InvalidTextRepresentation", None]
    assert _group_effects(db) == ["a", "c"]
    assert [store.get(k)["state"] for k in ("a", "b", "c")] == ["completed", "running", "completed"]
    store.close()


def test_a_member_not_started_stays_so_when_its_group_runs_again(db: Database) -> None:
    # Its partition was being revoked at its turn: the second pass (after a server-side failure) must not
    # start it once the revocation is over.
    store = _group_store(db)
    turns = iter([True])

    def bad(conn: Any) -> None:
        conn.execute("INSERT INTO group_effects (k) VALUES ('a'::int::text)")

    members = [Member("a", 1, bad), Member("b", 1, _insert("b"), skip=lambda: next(turns, False))]
    store.run_group(members)
    assert [type(m.error).__name__ for m in members] == ["InvalidTextRepresentation", "NotStarted"]
    assert _group_effects(db) == [] and store.get("b")["state"] == "running"
    store.close()


def test_a_failure_that_comes_back_while_the_completions_are_sent_reruns_the_group(db: Database) -> None:
    # The driver reads answers as they arrive: a member's failed statement answered before the group's
    # completions go out is raised while sending them. It is a member's failure like any other: the group
    # runs again member by member, and the others complete.
    store = _group_store(db)

    def bad_then_answered(conn: Any) -> None:
        conn.execute("INSERT INTO group_effects (k) VALUES ('a'::int::text)")
        # Wait until the server's answer (the error) is on the socket.
        select.select([conn.pgconn.socket], [], [], 10)

    members = [Member("b", 1, _insert("b")), Member("a", 1, bad_then_answered)]  # the last member fails
    store.run_group(members)
    assert [type(m.error).__name__ for m in members] == ["NoneType", "InvalidTextRepresentation"]
    assert _group_effects(db) == ["b"] and store.get("b")["state"] == "completed"
    store.close()


def test_a_member_can_catch_its_own_statements_error_under_a_savepoint(db: Database) -> None:
    # The usual idempotent insert: a unique violation caught around a nested transaction block.
    with db.connection() as conn:
        conn.execute("CREATE TABLE seen (k text PRIMARY KEY)")
        conn.execute("INSERT INTO seen VALUES ('dup')")
    store = _group_store(db)
    caught: list[str] = []

    def insert_once(value: str) -> Any:
        def call(conn: Any) -> None:
            try:
                with conn.transaction():
                    conn.execute("INSERT INTO seen (k) VALUES (%s)", (value,))
            except psycopg.errors.UniqueViolation:
                caught.append(value)

        return call

    members = [Member("a", 1, insert_once("new")), Member("b", 1, insert_once("dup")), Member("c", 1, _insert("c"))]
    store.run_group(members)
    assert [m.error for m in members] == [None, None, None]
    assert caught == ["dup"]
    assert [store.get(k)["state"] for k in ("a", "b", "c")] == ["completed"] * 3
    with db.connection() as conn:
        assert sorted(r["k"] for r in conn.execute("SELECT k FROM seen").fetchall()) == ["dup", "new"]
    assert _group_effects(db) == ["c"]
    store.close()


def _migrated_up_to(settings: Settings, count: int) -> Database:
    """A database in a schema of its own with only the first `count` migrations applied, as an older
    release left it."""
    from taskq._core.db import migrations

    db = Database(settings.database_url, schema="t" + uuid.uuid4().hex[:10])
    with db.connection() as conn:
        conn.execute(f'CREATE SCHEMA "{db.schema}"')
        conn.execute(
            "CREATE TABLE taskq_migrations (version integer PRIMARY KEY, name text NOT NULL, "
            "applied_at timestamptz NOT NULL DEFAULT now())"
        )
        for version, name, sql in migrations()[:count]:
            conn.execute(sql.encode())
            conn.execute("INSERT INTO taskq_migrations (version, name) VALUES (%s, %s)", (version, name))
    return db


def test_migrating_keeps_older_records_under_the_namespace_of_the_migrating_process(
    base_settings: Settings,
) -> None:
    # A database as 0002 left it: records keyed by idempotency key alone.
    db = _migrated_up_to(base_settings, 2)
    try:
        with db.connection() as conn:
            conn.execute(
                "INSERT INTO taskq_tasks (idempotency_key, task_id, task_type, state, attempts) "
                "VALUES ('done', 't1', 't', 'completed', 1), ('dead', 't2', 't', 'dead', 3)"
            )
        assert "0003_tasks_by_namespace" in db.migrate(namespace="shop")
        shop, other = (IdempotencyStore(db, owner="w", namespace=ns) for ns in ("shop", "other"))
        assert shop.counts() == {"completed": 1, "dead": 1} and other.counts() == {}
        assert shop.reset_for_replay("dead") and shop.get("dead")["attempts"] == 0
        claims = shop.claim([ClaimRequest("done", "t3", "t", 60), ClaimRequest("dead", "t4", "t", 60)])
        # Kept: 'done' is not run again, and the replayed 'dead' starts over.
        assert [(c.outcome, c.attempts) for c in claims] == [("completed", 1), ("claimed", 1)]
        assert [c.outcome for c in other.claim([ClaimRequest("done", "t5", "t", 60)])] == ["claimed"]
        shop.close()
        other.close()
    finally:
        db.close()
        db.drop_schema()


def test_migrating_to_takeovers_keeps_each_key_as_near_the_poison_pill_rule_as_it_was(
    base_settings: Settings,
) -> None:
    # A database as 0008 left it: every takeover from a dead worker counted as an interruption.
    db = _migrated_up_to(base_settings, 8)
    try:
        with db.connection() as conn:
            conn.execute(
                "INSERT INTO taskq_tasks (namespace, idempotency_key, task_id, task_type, state, attempts, "
                "interruptions) VALUES ('shop', 'never', 't1', 't', 'completed', 1, 0), "
                "('shop', 'once', 't2', 't', 'completed', 1, 1), ('shop', 'twice', 't3', 't', 'dead', 1, 2)"
            )
        assert "0009_takeovers" in db.migrate(namespace="shop")
        with db.connection() as conn:
            rows = conn.execute(
                "SELECT idempotency_key, takeovers, interruptions, started FROM taskq_tasks ORDER BY 1"
            ).fetchall()
        # The rule counts the first takeover plus the interruptions: 0, 1 and 2 runs, as before.
        assert [(r["idempotency_key"], r["takeovers"], r["interruptions"], r["started"]) for r in rows] == [
            ("never", 0, 0, False),
            ("once", 1, 0, False),
            ("twice", 2, 1, False),
        ]
    finally:
        db.close()
        db.drop_schema()


def test_migrating_a_table_of_a_million_records_to_hot_completions_keeps_every_record_and_rule(
    base_settings: Settings,
) -> None:
    # A database as 0009 left it, holding 1M records of two namespaces: keys 1-10,000 finished in 2020, keys
    # 10,001-10,100 first claimed in 2020 but finished a minute ago, the rest claimed and finished lately. Of
    # every hundred keys one failed, one is dead, one is running under an expired lease, the rest completed.
    db = _migrated_up_to(base_settings, 9)
    try:
        with db.connection() as conn:
            conn.execute(
                """
                INSERT INTO taskq_tasks (namespace, idempotency_key, task_id, task_type, state, attempts,
                                         lease_owner, lease_expires_at, created_at, updated_at, completed_at)
                SELECT CASE WHEN i % 10 = 0 THEN 'other' ELSE 'shop' END, 'k' || i, 't' || i, 'shop.Order',
                       COALESCE((ARRAY['failed', 'dead', 'running'])[i % 100], 'completed'), 1,
                       CASE WHEN i % 100 = 3 THEN 'gone' END,
                       CASE WHEN i % 100 = 3 THEN now() - interval '1 minute' END,
                       CASE WHEN i <= 10100 THEN timestamptz '2020-01-01' + i * interval '1 s' ELSE at END,
                       at, CASE WHEN i % 100 NOT IN (1, 2, 3) THEN at END
                FROM generate_series(1, 1000000) AS i,
                     LATERAL (SELECT CASE WHEN i <= 10000 THEN timestamptz '2020-01-02' + i * interval '1 s'
                                          WHEN i <= 10100 THEN now() - interval '1 minute'
                                          ELSE now() - interval '1 hour' + i * interval '1 ms' END AS at) t
                """
            )
        assert db.migrate(namespace="shop")[:3] == [
            "0010_hot_completions",
            "0011_status_and_cancellation",
            "0012_workflows",
        ]
        with db.connection() as conn:
            (n,) = conn.execute("SELECT count(*) AS n FROM taskq_tasks").fetchone().values()
            indexes = {
                r["indexname"]: r["indexdef"]
                for r in conn.execute(
                    "SELECT indexname, indexdef FROM pg_indexes "
                    "WHERE tablename = 'taskq_tasks' AND schemaname = current_schema()"
                )
            }
            (options,) = conn.execute(
                "SELECT reloptions FROM pg_class WHERE oid = 'taskq_tasks'::regclass"
            ).fetchone().values()
        assert n == 1_000_000
        assert set(indexes) == {"taskq_tasks_pkey", "taskq_tasks_created_at"}
        assert indexes["taskq_tasks_pkey"].endswith("(idempotency_key, namespace)")
        assert options[0] == "fillfactor=50"

        store = Store(db)
        # The records claim as they did: completed and dead (its own task) are answered, failed, a new task of
        # a dead key and an expired lease are claimed again, a new key is claimed; each namespace its own.
        asked = [("k4", "t4"), ("k1", "t1"), ("k2", "t2"), ("k102", "new"), ("k3", "t3"), ("fresh", "f")]
        claims = store.claim(
            "shop", "w", [ClaimRequest(k, t, "shop.Order", 60.0) for k, t in asked], stale_after=10.0
        )
        assert [(c.idempotency_key, c.outcome, c.attempts) for c in claims] == [
            ("k4", "completed", 1),
            ("k1", "claimed", 2),
            ("k2", "dead", 1),
            ("k102", "claimed", 2),
            ("k3", "claimed", 2),
            ("fresh", "claimed", 1),
        ]
        [other] = store.claim("other", "w", [ClaimRequest("k4", "t4", "shop.Order", 60.0)], stale_after=10.0)
        assert other.outcome == "claimed"  # k4 of 'other' does not exist; k10 does
        claimed = [c for c in claims if c.outcome == "claimed"]
        done = [Finished(c.idempotency_key, c.attempts, "completed") for c in claimed]
        assert store.complete("shop", "w", done) == {"k1", "k102", "k3", "fresh"}
        # Still unanalyzed, the completion reaches its rows by key, and the purge by created_at.
        keys = [f"k{i}" for i in range(20_000, 20_500)]
        complete = _plan(
            db, "complete", namespace="shop", keys=keys, attempts=[1] * 500, results=[None] * 500, owner="w"
        )
        assert "Index Cond: ((idempotency_key = ANY" in complete, complete
        purge = _plan(db, "purge", namespace="shop", ttl_seconds=7 * 86400.0, keep=[], batch=10_000)
        assert "taskq_tasks_created_at" in purge, purge
        # Purged: the shop's keys finished in 2020 (9,000 of the first 10,000, less 100 failed, 100 running,
        # k102 completed just now and k5 kept); not those first claimed in 2020 but finished a minute ago.
        purged = IdempotencyStore(db, owner="w", namespace="shop").purge(7 * 86400.0, keep=["k5"])
        assert purged == 9_000 - 100 - 100 - 1 - 1
        assert store.get("shop", "k5") is not None and store.get("shop", "k6") is None
        assert store.get("shop", "k10001") is not None and store.get("other", "k20") is not None
    finally:
        db.close()
        db.drop_schema()


def test_migrating_a_populated_table_sets_autovacuum_by_counts_of_rows_and_keeps_every_record(
    base_settings: Settings,
) -> None:
    # A database as 0012 left it, holding 50,000 finished records.
    db = _migrated_up_to(base_settings, 12)
    try:
        with db.connection() as conn:
            conn.execute(
                "INSERT INTO taskq_tasks (namespace, idempotency_key, task_id, task_type, state, attempts) "
                "SELECT 'shop', 'k' || i, 't' || i, 'shop.Order', 'completed', 1 "
                "FROM generate_series(1, 50000) AS i"
            )
        assert db.migrate(namespace="shop")[:1] == ["0013_tasks_autovacuum"]
        with db.connection() as conn:
            (options,) = conn.execute(
                "SELECT reloptions FROM pg_class WHERE oid = 'taskq_tasks'::regclass"
            ).fetchone().values()
            query = "SELECT count(*) FROM taskq_tasks WHERE state = 'completed'"
            (n,) = conn.execute(query).fetchone().values()
        assert n == 50_000
        # Vacuumed after 10,000 + 1% of the rows are dead or new, analyzed after 10,000 + 2% changed; the
        # fillfactor of migration 0010 stays.
        assert sorted(options) == [
            "autovacuum_analyze_scale_factor=0.02",
            "autovacuum_analyze_threshold=10000",
            "autovacuum_vacuum_insert_scale_factor=0.01",
            "autovacuum_vacuum_insert_threshold=10000",
            "autovacuum_vacuum_scale_factor=0.01",
            "autovacuum_vacuum_threshold=10000",
            "fillfactor=50",
        ]
        assert db.migrate(namespace="shop") == []
    finally:
        db.close()
        db.drop_schema()
