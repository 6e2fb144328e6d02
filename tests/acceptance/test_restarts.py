"""Restarts of Postgres and of the broker under load, on a private stack: workers ride them out, once each.

The shared stack serves every other test, so these tests start their own (`compose/stack up` in a temporary
state dir, on other ports) and restart its services while worker processes run.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from taskq._core.db import Database
from taskq._core.envelope import Envelope
from taskq._core.errors import StoreUnavailableError
from taskq._core.kafka import KafkaBroker, Record, RecordSink, RecordSource, TopicAdmin
from taskq._core.settings import Settings
from taskq.consumer.forwarder import Forwarder
from taskq.consumer.store import ClaimRequest, IdempotencyStore, SlotRequest, WorkerRecord
from taskq.producer.admin import create_topics
from taskq.schemas import Registry
from taskq.schemas.errors import RegistryUnavailableError
from tests.acceptance.conftest import App
from tests.acceptance.helpers import (
    WorkerProcess,
    all_committed,
    private_ports,
    tier_records,
    uncommitted,
    wait_until,
)
from tests.conftest import REPO

STACK = REPO / "compose" / "stack"
#: Port variables of compose/stack; a private stack takes consecutive free ports of its xdist worker's own.
_PORTS = (
    "TASKQ_STACK_KAFKA_PORT",
    "TASKQ_STACK_KAFKA_CONTROLLER_PORT",
    "TASKQ_STACK_KAFKA_SASL_PORT",
    "TASKQ_STACK_REGISTRY_PORT",
    "TASKQ_STACK_REGISTRY_MANAGEMENT_PORT",
    "TASKQ_STACK_POSTGRES_PORT",
)
#: The module's tests share one private stack (module-scoped): under xdist they run on one worker, in order.
pytestmark = pytest.mark.xdist_group("restarts")


class PrivateStack:
    """A compose/stack of this module's own: its state dir, its ports, and its TASKQ_* exports."""

    def __init__(self, state_dir: Path) -> None:
        base = private_ports(len(_PORTS))
        self.stack_env = {
            **os.environ,
            "TASKQ_STACK_DIR": str(state_dir),
            **{name: str(base + i) for i, name in enumerate(_PORTS)},
        }
        self.exports: dict[str, str] = {}
        self.started_in = 0.0

    def run(self, *args: str, timeout: float = 600) -> str:
        """`compose/stack ARGS` against this stack; its stdout (export lines), failing with its stderr."""
        out = subprocess.run(
            [str(STACK), *args],
            env=self.stack_env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert out.returncode == 0, f"compose/stack {' '.join(args)} failed ({out.returncode}):\n{out.stderr}"
        return out.stdout

    def up(self) -> None:
        """Start every service and read the exports."""
        started = time.monotonic()
        for line in self.run("up").splitlines():
            if line.startswith("export ") and "=" in line:
                name, _, value = line[len("export ") :].partition("=")
                self.exports[name] = value.strip().strip("'\"")
        self.started_in = time.monotonic() - started

    def settings(self, ns: str) -> Settings:
        """Settings of this stack in a namespace (topic prefix, group and database schema)."""
        return Settings.from_env(
            {k: v for k, v in self.exports.items() if k.startswith("TASKQ_")},
            namespace=ns,
            database_schema=ns,
        )


@pytest.fixture(scope="module")
def private_stack() -> Iterator[PrivateStack]:
    """A stack of this module's own, started once and always stopped, whatever the tests did to it."""
    # Not under pytest's tmp dir: it is private to this user, and Postgres runs as another when we are root.
    state = Path(tempfile.mkdtemp(prefix="taskq-restarts-"))
    state.chmod(0o755)
    stack = PrivateStack(state)
    try:
        stack.up()
        yield stack
    finally:
        # `down` stops what the state dir records as running; a service a test left stopped is skipped.
        subprocess.run(
            [str(STACK), "down"],
            env=stack.stack_env,
            check=False,
            timeout=300,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture
def private_app(private_stack: PrivateStack, tmp_path: Path) -> Iterator[App]:
    """The test app in a fresh namespace on the private stack, its topics created and its schema migrated."""
    private_stack.run("up")  # idempotent: restarts whatever an earlier failed test left stopped
    ns = "r" + uuid.uuid4().hex[:10]
    settings = private_stack.settings(ns)
    create_topics(settings, partitions=3)
    db = Database(settings.database_url, schema=settings.database_schema)
    db.migrate()

    def env_of(**extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TASKQ_", "PG"))}
        return {
            **env,
            **private_stack.exports,
            "TASKQ_NAMESPACE": settings.namespace,
            "TASKQ_DATABASE_SCHEMA": settings.database_schema,
            "PYTHONPATH": str(REPO),
            **extra,
        }

    def make_app() -> App | None:
        try:
            return App(settings, env_of, tmp_path)
        except RegistryUnavailableError:
            # After a Postgres restart the registry fails requests on stale pooled connections for a while.
            return None

    app = wait_until(make_app, timeout=60, what="the registry to take the app's schemas", every=1.0)
    try:
        yield app
    finally:
        app.close()
        try:  # the stack may be the thing a failed test left broken: clean up what still answers
            db.drop_schema()
        except Exception:
            pass


def _done(app: App) -> int:
    """Keys with a ledger row; 0 while Postgres is down (the test's own reads ride out the outage too)."""
    try:
        return int(app.scalar("SELECT count(DISTINCT key) FROM ledger"))
    except Exception:
        return 0


def _alive(app: App) -> None:
    dead = [(w.log.name, w.proc.returncode) for w in app.workers if w.proc.poll() is not None]
    assert not dead, f"workers died: {dead}\n{app.logs()}"


def _logged(app: App, *needles: str, every_worker: bool = False) -> bool:
    seen = [any(n in w.output() for n in needles) for w in app.workers]
    return all(seen) if every_worker else any(seen)


#: What a worker logs when Postgres is away: its claims or records, its heartbeat, its read of the pauses.
_NOTICED_OUTAGE = ("store unavailable", "heartbeat not written", "cannot read pauses")


def _postgres_down(app: App) -> bool:
    try:
        app.db.connect().close()
    except Exception:
        return True
    return False


#: The classic protocol's session timeout of the processes whose session must time out during an outage: the
#: least the broker accepts (group.min.session.timeout.ms), so the outage that outlasts it is 6 s, not 15 s.
CLASSIC_SESSION = {"TASKQ_GROUP_PROTOCOL": "classic", "TASKQ_KAFKA_SESSION_TIMEOUT_MS": "6000"}


def _start_run(
    app: App, prefix: str, progress: int = 30, args: tuple[str, ...] = (), **env: str
) -> list[str]:
    """300 keys, each enqueued twice (all on the broker before any outage), two workers making progress
    (KIP-848 unless `env` says otherwise)."""
    keys = [f"{prefix}{i:04d}" for i in range(300)]
    app.enqueue_ledger(keys, copies=2, sleep=0.05)
    for _ in range(2):
        app.spawn("--concurrency", "4", *args, **{"TASKQ_GROUP_PROTOCOL": "consumer", **env})
    wait_until(lambda: _done(app) >= progress, timeout=180, what="progress before the outage")
    return keys


def _finish_run(app: App, keys: list[str], what: str) -> None:
    """Every key done once, every offset committed, every worker still alive."""
    wait_until(lambda: _done(app) == len(keys), timeout=180, what=what)
    try:
        wait_until(lambda: all_committed(app.settings), timeout=120, what="the group to commit every offset")
    except AssertionError as exc:
        # What says where the records are, from anywhere in the logs: a record holding back its partition's
        # commits is named (after a minute) with the stage it is in, and the group's changes of assignment.
        telling = "\n".join(
            f"{w.log.name}: {line}"
            for w in app.workers
            for line in w.output().splitlines()
            if "held back" in line or "assigned" in line or "revoked" in line
        )
        raise AssertionError(
            f"{exc}: uncommitted records {uncommitted(app.settings)}\n{telling}\n{app.logs()}"
        ) from None
    app.assert_once_each(keys)
    assert app.scalar("SELECT count(*) FROM ledger") == len(keys)
    _alive(app)


def test_workers_ride_out_a_postgres_restart_and_each_key_takes_effect_once(
    private_stack: PrivateStack, private_app: App
) -> None:
    app = private_app
    keys = _start_run(app, "pg")
    private_stack.run("stop", "postgres")
    assert _postgres_down(app)
    # The outage lasts until the workers' claims or records failed, every worker noticed it, and a moment
    # longer. A worker notices through its tasks when it has some in flight; one that drained its
    # partitions notices through its heartbeat (a second or two), and must not hold the outage forever.
    wait_until(
        lambda: _logged(app, "store unavailable") and _logged(app, *_NOTICED_OUTAGE, every_worker=True),
        timeout=60,
        what="the workers to notice the outage",
    )
    time.sleep(3)
    _alive(app)
    private_stack.run("start", "postgres")
    _finish_run(app, keys, "every key after the Postgres restart")


@contextlib.contextmanager
def _out_of_reach(app: App) -> Iterator[None]:
    """Postgres out of reach without a restart (a network partition, a pooler restarted, a failover to a
    standby started long before): new connections refused and everyone else's ended, until the block exits.
    Its start time does not move."""
    with psycopg.connect(app.settings.database_url, autocommit=True) as keeper:  # ours: stays open throughout
        hba = Path(keeper.execute("SHOW hba_file").fetchone()[0])  # type: ignore[index]
        allowed = hba.read_text()
        try:
            hba.write_text("host all all 0.0.0.0/0 reject\nhost all all ::/0 reject\n" + allowed)
            keeper.execute("SELECT pg_reload_conf()")
            keeper.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE pid <> pg_backend_pid() AND backend_type = 'client backend'"
            )
            yield
        finally:
            hba.write_text(allowed)
            keeper.execute("SELECT pg_reload_conf()")


def _judges(app: App, stale: float, *owners: str) -> list[IdempotencyStore]:
    """Stores of the app's namespace, as the workers (or tools) `owners` claim through them."""
    ns = app.settings.namespace
    return [IdempotencyStore(app.db, owner=o, namespace=ns, stale_after=stale) for o in owners]


def _record(store: IdempotencyStore) -> WorkerRecord:
    """The liveness record of the worker claiming through `store`."""
    return WorkerRecord(store.owner, store.namespace, "g", "h", 1, 4, datetime.now(UTC))


def _answered(call: Callable[[], Any]) -> Any:
    """`call()`, or None where a connection an outage ended failed it (the next call reconnects)."""
    try:
        return call()
    except StoreUnavailableError:
        return None


def test_workers_ride_out_postgres_out_of_reach_without_a_restart_and_take_no_key_of_one_another(
    private_stack: PrivateStack, private_app: App
) -> None:
    # Every worker's heartbeat is stale when the outage ends and none of them died: none may take the
    # others' keys over (whether one would without the rule is a race with the others' first beats; the test
    # below makes the case arise for certain).
    app = private_app
    stale = 6.0  # the least --stale-after allows (twice the 3 s heartbeat)
    keys = _start_run(app, "po", args=("--stale-after", str(stale)))
    with _out_of_reach(app):
        wait_until(
            lambda: _logged(app, *_NOTICED_OUTAGE, every_worker=True),
            timeout=60,
            what="the workers to notice the outage",
        )
        time.sleep(stale + 3)  # every heartbeat is older than --stale-after when it ends
        _alive(app)
    _finish_run(app, keys, "every key after Postgres is in reach again")
    taken = app.scalar("SELECT coalesce(sum(takeovers), 0) FROM taskq_tasks")
    assert taken == 0, f"{taken} key(s) taken over from live workers\n{app.logs()}"


def test_after_postgres_was_out_of_reach_no_worker_is_presumed_dead_until_its_judge_has_beaten_again(
    private_stack: PrivateStack, private_app: App
) -> None:
    # The case for certain: a holds a key (an hour's lease) and a slot, Postgres goes out of reach for longer
    # than stale_after and comes back without a restart, and b claims first. Judged by the heartbeats and
    # the server's start alone, a was dead (its key taken over, its slot given away).
    stale = 3.0
    a, b = _judges(private_app, stale, "a", "b")
    request = [ClaimRequest("k", "id-k", "t.Task", 3600.0)]
    slot, other = ([SlotRequest(k, "t.Call", "partner", 1, 3600.0)] for k in ("k2", "k3"))
    try:
        for store in (a, b):
            store.enter(_record(store), lambda pid: True)
        assert a.claim(request)[0].outcome == "claimed"
        assert a.acquire_slots(slot) == {"k2"}
        with _out_of_reach(private_app):
            time.sleep(stale + 1)
        first = wait_until(
            lambda: _answered(lambda: b.claim(request)[0]), timeout=60, what="a claim after it"
        )
        assert (first.outcome, first.takeovers) == ("running", 0), first
        assert _answered(lambda: b.acquire_slots(other)) == set()  # a's slot still counts
        # b beats again: a, alive, would beat within stale_after of that.
        b.beat(_record(b), 0)
        assert b.claim(request)[0].outcome == "running"

        # A worker that beats no more is presumed dead once its judge has beaten for stale_after.
        def taken_over() -> Any:
            b.beat(_record(b), 0)
            return (c := b.claim(request)[0]).outcome == "claimed" and c

        assert wait_until(taken_over, timeout=30, what="a takeover").takeovers == 1
        assert b.acquire_slots(other) == {"k3"}
    finally:
        a.close()
        b.close()


def test_workers_ride_out_a_broker_restart_and_each_key_takes_effect_once(
    private_stack: PrivateStack, private_app: App
) -> None:
    app = private_app
    keys = _start_run(app, "kb")
    private_stack.run("restart", "kafka")
    _finish_run(app, keys, "every key after the broker restart")


def test_workers_ride_out_a_broker_outage_past_their_session_timeout_and_each_key_takes_effect_once(
    private_stack: PrivateStack, private_app: App
) -> None:
    app = private_app
    # The classic protocol, whose client times its session out while the broker is away. (Under KIP-848 the
    # broker keeps the session and re-arms it when it restarts: that is the broker restart test above.)
    # A member's session can only time out once it has one: both must be assigned and then run for a
    # while (heartbeats every second) before the broker goes away, or neither may ever time out.
    keys = _start_run(app, "ko", progress=30, **CLASSIC_SESSION)
    wait_until(
        lambda: all(re.search(r"assigned \S", w.output()) for w in app.workers),
        timeout=60,
        what="both workers to own partitions",
    )
    steady = min(_done(app) + 60, len(keys) - 20)  # about a second of work at two workers' pace
    wait_until(lambda: _done(app) >= steady, timeout=60, what="steady progress with both workers")
    private_stack.run("stop", "kafka")
    # Down long enough that a group session times out: that worker's partitions are lost, not revoked.
    # (Not necessarily every worker's: one caught mid-rebalance has no session to time out.)
    wait_until(
        lambda: _logged(app, "SESSTMOUT", "session timed out"),
        timeout=90,
        what="a worker's group session to time out",
    )
    _alive(app)
    private_stack.run("start", "kafka")
    _finish_run(app, keys, "every key after the broker restart")


def _assert_released_once(
    app: App, task_ids: set[str], *, timeout: float, alive: Callable[[], bool] = lambda: True
) -> None:
    """Wait until the tiers hold as many released tasks as `task_ids`, then: each of them, once.
    `alive`: whether the forwarder still runs (the wait fails at once when it stopped)."""

    def released() -> Counter[str] | None:
        assert alive(), f"the forwarder stopped\n{app.logs()}"
        try:
            counts = _released(app)
        except Exception:
            return None  # the broker is still coming back
        return counts if sum(counts.values()) >= len(task_ids) else None

    wait_until(released, timeout=timeout, what="every delayed task released", every=1.0)
    counts = _released(app)
    assert set(counts) == task_ids, f"missing {len(task_ids - set(counts))}\n{app.logs()}"
    doubled = [t for t, c in counts.items() if c > 1]
    assert not doubled, f"{len(doubled)} tasks released twice, e.g. {doubled[:5]}\n{app.logs()}"


def _released(app: App) -> Counter[str]:
    """Task ids of every committed record on the priority topics, counted."""
    return Counter(Envelope.from_headers(r.headers).task_id for r in tier_records(app.settings))


def test_the_forwarder_releases_each_delayed_task_once_across_a_broker_restart(
    private_stack: PrivateStack, private_app: App
) -> None:
    app = private_app
    n = 600
    receipts = [
        app.producer.enqueue(app.type("Flaky"), {"key": f"d{i}"}, delay=timedelta(seconds=3 + i % 3))
        for i in range(n)
    ]
    app.producer.flush(60)
    # Classic protocol: its client times the session out during the outage (see the worker outage test).
    forwarder = WorkerProcess.command(
        app.env_of(**CLASSIC_SESSION), app.tmp_path / "forwarder.log", "forwarder"
    )
    app.workers.append(forwarder)
    # Stop the broker while the forwarder is mid-way: some tasks released, the others held or fetched.
    wait_until(
        lambda: sum(_released(app).values()) >= 1, timeout=60, what="the forwarder to release some tasks"
    )
    private_stack.run("stop", "kafka")
    # Down while tasks come due, and long enough that the forwarder's group session times out.
    wait_until(
        lambda: _logged(app, "SESSTMOUT", "session timed out"),
        timeout=90,
        what="the forwarder's group session to time out",
    )
    _alive(app)
    private_stack.run("start", "kafka")

    _assert_released_once(app, {r.task_id for r in receipts}, timeout=180)
    _alive(app)


class _OutageAtFirstBatch:
    """The forwarder's real broker clients, with the broker stopped the moment its source first returns
    records: the transaction that forwards them starts with no broker to answer it."""

    def __init__(self, stack: PrivateStack, settings: Settings) -> None:
        self.real = KafkaBroker(settings)
        self.stack = stack
        self.stopped = threading.Event()

    def source(self, **kw: Any) -> RecordSource:
        source = self.real.source(**kw)
        poll = source.poll

        def poll_then_stop(max_records: int, timeout: float) -> list[Record]:
            records = poll(max_records, timeout)
            if records and not self.stopped.is_set():
                self.stack.run("stop", "kafka")
                self.stopped.set()
            return records

        source.poll = poll_then_stop  # type: ignore[method-assign]
        return source

    def sink(self, **kw: Any) -> RecordSink:
        return self.real.sink(**kw)

    def admin(self) -> TopicAdmin:
        return self.real.admin()


def test_a_forwarding_transaction_the_broker_never_answers_is_given_up_and_each_task_released_once(
    private_stack: PrivateStack, private_app: App
) -> None:
    app = private_app
    n = 100
    flaky, due = app.type("Flaky"), timedelta(seconds=1)
    receipts = [app.producer.enqueue(flaky, {"key": f"t{i}"}, delay=due) for i in range(n)]
    app.producer.flush(60)
    broker = _OutageAtFirstBatch(private_stack, app.settings)
    events: queue.SimpleQueue[tuple[str, dict[str, Any]]] = queue.SimpleQueue()
    forwarder = Forwarder(
        app.settings, broker=broker, on_event=lambda *event: events.put(event), transaction_timeout=5
    )
    thread = threading.Thread(target=forwarder.run, daemon=True)
    thread.start()
    try:
        wait_until(broker.stopped.is_set, timeout=60, what="the forwarder's first batch")
        # Every transactional call is bounded: with the broker away the transaction is given up, not waited
        # on for ever (librdkafka's own timeout on adding offsets is not always kept).
        kind, data = events.get(timeout=30)
        assert kind == "transaction_failed", (kind, data)
        private_stack.run("start", "kafka")

        _assert_released_once(app, {r.task_id for r in receipts}, timeout=120, alive=thread.is_alive)
    finally:
        forwarder.stop()
        thread.join(60)
    assert not thread.is_alive()


def test_a_long_lived_store_reports_a_postgres_restart_as_unavailable_and_then_reconnects(
    private_stack: PrivateStack, private_app: App
) -> None:
    from taskq._core.errors import StoreUnavailableError
    from taskq.consumer.store import IdempotencyStore

    store = IdempotencyStore(private_app.db, owner="restarts-test", namespace=private_app.settings.namespace)
    try:
        for call in (store.counts, lambda: store.purge(3600), lambda: store.get("nothing")):
            assert call() in ({}, 0, None)  # a connection is open and idle
            private_stack.run("restart", "postgres")

            def answered(call: Callable[[], object] = call) -> bool:
                try:
                    call()  # the stale connection fails as the store's own error, never the driver's
                except StoreUnavailableError:
                    return False
                return True

            wait_until(answered, timeout=60, what="the store to reconnect after the restart")
    finally:
        store.close()


def test_the_registry_answers_within_seconds_of_a_postgres_restart(
    private_stack: PrivateStack, private_app: App
) -> None:
    # The registry's connection pool (20 connections) holds only dead ones after the restart: without a check
    # as each is borrowed, every request on one failed with HTTP 500 until each had failed once.
    def answers(registry: Registry) -> bool:
        try:
            return bool(registry.subjects())  # never cached: every call asks the registry's database
        except RegistryUnavailableError:
            return False

    with Registry.from_settings(private_app.settings) as registry:
        assert answers(registry)  # its pool is open
        private_stack.run("restart", "postgres")
        wait_until(lambda: answers(registry), timeout=5, every=0.5, what="the registry to answer")


def test_right_after_a_postgres_restart_no_worker_is_presumed_dead_until_it_could_have_beaten(
    private_stack: PrivateStack, private_app: App
) -> None:
    # No worker can write its heartbeat while Postgres is down. Counted from the last beat, every worker was
    # stale the moment Postgres came back: a live worker's keys were taken over by the first claim of another
    # (its outcome then refused, its run redone, and an interruption charged to a key it ran in quarantine,
    # two of which dead-letter a healthy task). Staleness counts from the server's start at the earliest.
    stale = 5.0
    # A claimer without a liveness record of its own (a tool) judges by the heartbeats and the restart alone:
    # b, a worker, also waits until it has beaten again for stale_after (the outage left its record stale).
    a, b, tool = _judges(private_app, stale, "a", "b", "tool")
    request = [ClaimRequest("k", "id-k", "t.Task", 3600.0)]

    # And the concurrency slots, whose holders count while they are alive: a key with a limit of one slot.
    slot = [SlotRequest("k2", "t.Call", "partner", 1, 3600.0)]
    other = [SlotRequest("k3", "t.Call", "partner", 1, 3600.0)]

    def claim(store: IdempotencyStore) -> Any:
        return _answered(lambda: store.claim(request)[0])

    def slot_taken(store: IdempotencyStore) -> bool | None:
        return _answered(lambda: bool(store.acquire_slots(other)))

    try:
        for store in (a, b):
            store.enter(_record(store), lambda pid: True)
        assert a.claim(request)[0].outcome == "claimed"  # leased for an hour, by a worker alive throughout
        assert a.acquire_slots(slot) == {"k2"}
        private_stack.run("stop", "postgres")
        time.sleep(stale)  # the outage outlasts stale_after: a's last beat is older than that when it ends
        private_stack.run("start", "postgres")
        first = wait_until(lambda: claim(b), timeout=60, what="a claim after the restart")
        slot_first = slot_taken(b)
        by_tool = wait_until(lambda: claim(tool), timeout=60, what="a tool's claim after the restart")
        slot_by_tool = slot_taken(tool)
        since_start = private_app.scalar("SELECT extract(epoch FROM now() - pg_postmaster_start_time())")
        assert since_start < stale, f"the claims came {since_start:.1f} s after the restart: the case did not arise"
        assert (first.outcome, first.takeovers) == ("running", 0), first
        assert (by_tool.outcome, by_tool.takeovers) == ("running", 0), by_tool
        assert slot_first is False and slot_by_tool is False  # a's slot still counts
        # A worker that then beats no more is presumed dead once stale_after has passed since the restart (and
        # since its judge, which beats as a live worker does, began beating again).
        def taken_over() -> Any:
            _answered(lambda: b.beat(_record(b), 0))  # a failed beat: the claim below fails too
            return (c := claim(b)) is not None and c.outcome == "claimed" and c

        taken = wait_until(taken_over, timeout=30, what="a takeover")
        assert taken.takeovers == 1
        assert slot_taken(b)
    finally:
        a.close()
        b.close()
        tool.close()
