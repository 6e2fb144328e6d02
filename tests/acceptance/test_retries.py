"""Retries through delay topics, delayed tasks, and the forwarder's exactly-once release (processes)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from taskq._core.envelope import PRIORITIES as PRIORITY
from taskq._core.envelope import Envelope
from taskq._core.kafka import Admin, Source
from taskq.consumer.dlq import DeadLetters, DlqRecord
from taskq.consumer.retry import RetryPolicy
from tests.acceptance.conftest import App
from tests.acceptance.helpers import WorkerProcess, all_committed, process_gone, tier_records, wait_until


def test_a_task_failing_twice_then_succeeding_runs_three_times_with_backoff(app: App) -> None:
    app.producer.enqueue(app.type("Flaky"), {"key": "f1", "fail_times": 2}, idempotency_key="flaky-1")
    app.producer.flush(30)
    app.spawn("--concurrency", "2")
    wait_until(
        lambda: app.scalar("SELECT count(*) FROM ledger WHERE key = 'f1'") == 1,
        timeout=120,
        what="the flaky task to succeed",
    )
    attempts = app.query("SELECT attempt, at FROM attempt_log WHERE key = 'f1' ORDER BY at")
    assert [a["attempt"] for a in attempts] == [1, 2, 3], attempts
    policy = RetryPolicy()  # the handler's policy: defaults with max_attempts=5
    for i in (1, 2):
        gap = (attempts[i]["at"] - attempts[i - 1]["at"]).total_seconds()
        shortest = policy.base.total_seconds() * 2 ** (i - 1) * (1 - policy.jitter)
        assert gap >= shortest, f"retry {i} came after {gap:.3f}s, policy allows no less than {shortest:.3f}s"
    assert app.scalar("SELECT state FROM taskq_tasks WHERE idempotency_key = 'flaky-1'") == "completed"
    stats = subprocess.run(
        [sys.executable, "-m", "taskq.cli", "stats", "--json"],
        env=app.env_of(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert stats.returncode == 0, stats.stderr
    assert (json.loads(stats.stdout)["retries"], json.loads(stats.stdout)["retried_tasks"]) == (2, 1)


def test_a_delayed_task_starts_after_its_delay(app: App) -> None:
    # That it starts on time, not a tier later, is test_a_delayed_task_runs_at_its_due_time_not_a_tier_later
    # on the in-memory queue's clock: a wall-clock bound here failed whenever the machine was loaded.
    app.spawn("--concurrency", "2")
    enqueued = datetime.now(UTC)
    app.producer.enqueue(
        app.type("Flaky"), {"key": "d1"}, idempotency_key="delayed-1", delay=timedelta(seconds=5)
    )
    app.producer.flush(30)
    wait_until(
        lambda: app.scalar("SELECT count(*) FROM ledger WHERE key = 'd1'") == 1,
        timeout=60,
        what="the delayed task",
    )
    started = app.scalar("SELECT at FROM attempt_log WHERE key = 'd1'")
    waited = (started - enqueued).total_seconds()
    assert waited >= 5.0, f"started {waited:.3f}s after enqueue, before its 5 s delay"


def _released(app: App) -> list[tuple[Envelope, int]]:
    """Every committed record on the priority topics: its envelope and broker timestamp (ms)."""
    admin = Admin(app.settings)
    topics = [app.producer.topics.tier(p) for p in ("critical", "high", "normal", "low")]
    end = admin.end_offsets(topics)
    source = Source(app.settings, group=f"{app.ns}.reader")
    source.assign([(t, p, 0) for (t, p) in end])
    out: list[tuple[Envelope, int]] = []
    try:
        idle = 0
        while idle < 3:
            records = source.poll(1000, 0.5)
            idle = 0 if records else idle + 1
            out += [(Envelope.from_headers(r.headers), r.timestamp_ms) for r in records]
    finally:
        source.close()
    return out


def test_kill_9_of_the_forwarder_neither_loses_nor_doubles_delayed_tasks(app: App) -> None:
    n = 1000
    receipts = [
        app.producer.enqueue(app.type("Flaky"), {"key": f"x{i}"}, delay=timedelta(seconds=2 + (i % 3)))
        for i in range(n)
    ]
    app.producer.flush(60)
    env = app.env_of()
    forwarder = WorkerProcess.command(env, app.tmp_path / "forwarder-1.log", "forwarder")
    app.workers.append(forwarder)
    wait_until(lambda: len(_released(app)) >= 100, timeout=60, what="the forwarder to release some tasks")
    forwarder.kill()
    again = WorkerProcess.command(env, app.tmp_path / "forwarder-2.log", "forwarder")
    app.workers.append(again)
    wait_until(lambda: len(_released(app)) >= n, timeout=120, what="every delayed task released")
    released = _released(app)
    counts = Counter(e.task_id for e, _ in released)
    assert set(counts) == {r.task_id for r in receipts}
    assert max(counts.values()) == 1, [t for t, c in counts.items() if c > 1][:5]
    early = [
        (e.task_id, ts, e.not_before)
        for e, ts in released
        if e.not_before and ts < e.not_before.timestamp() * 1000
    ]
    assert not early, f"{len(early)} tasks released before their time, e.g. {early[:3]}"


def test_a_task_that_kills_its_worker_every_time_ends_in_the_dlq_while_restarts_carry_on(app: App) -> None:
    keys = [f"p{i}" for i in range(40)]
    app.producer.enqueue(app.type("Die"), {"code": 9}, idempotency_key="poison")
    for i, k in enumerate(keys):
        app.producer.enqueue(app.type("Ledger"), {"key": k, "amount": i}, idempotency_key=f"ledger:{k}")
    app.producer.flush(30)

    def state() -> str | None:
        return app.scalar("SELECT state FROM taskq_tasks WHERE idempotency_key = 'poison'")

    deaths = 0
    deadline = time.monotonic() + 150
    while state() != "dead":
        assert time.monotonic() < deadline, f"poison pill not dead-lettered; state {state()}\n{app.logs()}"
        live = [w for w in app.workers if w.proc.poll() is None]
        deaths = sum(1 for w in app.workers if w.proc.poll() == 9)
        if not live:
            app.spawn("--concurrency", "2")  # the supervisor's restart
        time.sleep(0.2)
    # Max attempts is 2: three workers died running it. Each restart took the key over from its dead
    # predecessor as the same attempt. The first run, beside others, is charged nothing; the next two ran
    # alone in quarantine, marked started, so each death counted an interruption, and two parked the key.
    assert deaths == 3, app.logs()
    row = app.query(
        "SELECT attempts, takeovers, interruptions FROM taskq_tasks WHERE idempotency_key = 'poison'"
    )
    assert row == [{"attempts": 1, "takeovers": 3, "interruptions": 2}], row
    wait_until(
        lambda: app.scalar("SELECT count(DISTINCT key) FROM ledger") == len(keys),
        timeout=90,
        what="the other tasks, on restarted workers",
    )
    source = Source(app.settings, group=f"{app.ns}.dlq-reader")
    source.assign([(app.producer.topics.dlq, 0, 0)])
    try:
        records = wait_until(lambda: source.poll(10, 0.5), timeout=30, what="the DLQ record")
    finally:
        source.close()
    reason = (records[0].header("taskq-dlq-reason") or b"").decode()
    assert "2 run(s) ended with their worker's death" in reason, reason
    assert any(w.proc.poll() is None for w in app.workers), "no worker survives the poison pill"


def test_a_poison_pill_under_a_restarting_supervisor_reaches_the_dlq_within_a_minute(app: App) -> None:
    # Die takes its whole worker process down (os._exit); 3 attempts. The supervisor restarts the process,
    # which marks its dead predecessor dead at start, so the key is taken over as soon as its partition
    # comes back, without waiting for a lease.
    keys = [f"s{i}" for i in range(20)]
    app.producer.enqueue(app.type("Die"), {"code": 9}, idempotency_key="poison", max_attempts=3)
    for i, k in enumerate(keys):
        app.producer.enqueue(app.type("Ledger"), {"key": k, "amount": i}, idempotency_key=f"ledger:{k}")
    app.producer.flush(30)
    supervisor = app.spawn("--processes", "2", "--concurrency", "2")

    def state() -> str | None:
        return app.scalar("SELECT state FROM taskq_tasks WHERE idempotency_key = 'poison'")

    # Four deaths: the first, unmarked run's and three in quarantine; each moves the dead worker's
    # partitions after the broker's session timeout (10 s).
    wait_until(lambda: state() == "dead", timeout=60, what=f"the poison pill in the DLQ\n{app.logs()}")
    row = app.query(
        "SELECT attempts, takeovers, interruptions, last_error FROM taskq_tasks "
        "WHERE idempotency_key = 'poison'"
    )
    assert (row[0]["attempts"], row[0]["takeovers"], row[0]["interruptions"]) == (1, 4, 3), row
    assert "3 run(s) ended with their worker's death" in row[0]["last_error"], row
    wait_until(
        lambda: app.scalar("SELECT count(DISTINCT key) FROM ledger") == len(keys),
        timeout=90,
        what=f"the other tasks\n{app.logs()}",
    )
    app.assert_once_each(keys)
    assert supervisor.proc.poll() is None, app.logs()  # four deaths over two slots: below its give-up rule
    assert supervisor.output().count("died after") == 4, app.logs()


def test_an_always_failing_task_is_dead_lettered_then_replayed_once_after_the_fix(app: App) -> None:
    app.query("INSERT INTO broken VALUES ('w1') RETURNING key")
    app.producer.enqueue(app.type("Fragile"), {"key": "w1"}, idempotency_key="webhook:w1", max_attempts=2)
    app.producer.flush(30)
    app.spawn("--concurrency", "2")

    def state() -> str | None:
        return app.scalar("SELECT state FROM taskq_tasks WHERE idempotency_key = 'webhook:w1'")

    wait_until(lambda: state() == "dead", timeout=90, what="the task to exhaust its 2 attempts")
    assert app.scalar("SELECT attempts FROM taskq_tasks WHERE idempotency_key = 'webhook:w1'") == 2

    def taskq(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "taskq.cli", "dlq", *args],
            env=app.env_of(),
            capture_output=True,
            text=True,
            timeout=120,
        )

    listed = taskq("list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines() if line.strip()]
    assert [(r["idempotency_key"], r["attempts"]) for r in rows] == [("webhook:w1", 2)], rows
    assert "is down" in rows[0]["reason"], rows
    offset = str(rows[0]["offset"])

    app.query("DELETE FROM broken RETURNING key")  # the fix
    replayed = taskq("replay", offset)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    wait_until(
        lambda: app.scalar("SELECT count(*) FROM ledger WHERE key = 'w1'") == 1,
        timeout=60,
        what="the replayed task to run",
    )
    again = taskq("replay", offset)
    assert again.returncode != 0 and "replayed" in (again.stdout + again.stderr).lower(), again.stdout
    forced = taskq("replay", offset, "--force")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    wait_until(lambda: all_committed(app.settings), timeout=60, what="the forced replay to be consumed")
    assert app.scalar("SELECT count(*) FROM ledger WHERE key = 'w1'") == 1, (
        "a forced replay caused a second effect"
    )


# A forwarder killed in the middle of a transaction, as `kill -9` leaves one: its records are on a tier topic,
# the transaction neither committed nor aborted. The process sends them, then kills itself.
_KILLED_MID_TRANSACTION = """
import os, signal, sys
from taskq._core.kafka import Sink
from taskq._core.settings import Settings
sink = Sink(Settings.from_env(), transactional_id=sys.argv[1])
sink.init_transactions()
sink.begin()
for partition in range(int(sys.argv[3])):
    sink.send(sys.argv[2], b"unfinished", key=None, headers=[], partition=partition)
assert sink.flush(30) == 0
os.kill(os.getpid(), signal.SIGKILL)
"""


def _kill_mid_transaction(app: App, transactional_id: str, tier: str) -> None:
    """A forwarder killed mid-transaction: a process that opens a transaction under `transactional_id`,
    writes 3 records to `tier` in it, and dies by kill -9."""
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_MID_TRANSACTION, transactional_id, tier, "3"],
        env=app.env_of(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert killed.returncode == -9, killed.stderr


def test_a_restarted_worker_ends_the_open_transaction_of_its_killed_forwarder_at_once(app: App) -> None:
    # read_committed readers (the workers) stop at a transaction left open on their partition, until the
    # successor of its producer fences it, or the broker aborts it after transaction.timeout.ms (60 s).
    def worker_id(w: WorkerProcess) -> str | None:
        rows = app.query("SELECT worker_id FROM taskq_workers WHERE worker_id LIKE %s", f"%:{w.proc.pid}:%")
        return rows[0]["worker_id"] if rows else None

    first = app.spawn("--concurrency", "2")
    dead = wait_until(lambda: worker_id(first), timeout=60, what=f"the liveness record\n{app.logs()}")
    keys = [f"d{i}" for i in range(4)]
    for k in keys:  # delayed, sent before the kill
        app.producer.enqueue(app.type("Ledger"), {"key": k, "amount": 1}, delay=timedelta(seconds=1))
    first.kill()
    tier = app.producer.topics.tier("normal")
    _kill_mid_transaction(app, f"{app.ns}.forwarder.{dead}", tier)
    keys += [f"n{i}" for i in range(6)]
    for k in keys[4:]:  # behind the open transaction, from another producer
        app.producer.enqueue(app.type("Ledger"), {"key": k, "amount": 1}, priority="normal")
    app.producer.flush(30)
    second = app.spawn("--concurrency", "2")  # the supervisor's restart, on the same host
    wait_until(lambda: worker_id(second), timeout=60, what=f"the restarted worker's record\n{app.logs()}")
    wait_until(
        lambda: app.scalar("SELECT count(DISTINCT key) FROM ledger") == len(keys),
        timeout=15,  # the broker alone would abort the transaction about 50 s later
        what=f"every task, the open transaction ended\n{app.logs()}",
    )
    app.assert_once_each(keys)


def test_the_broker_ends_the_open_transaction_of_a_killed_forwarder_without_a_successor_within_35_s(
    app: App,
) -> None:
    # A `taskq forwarder` killed on a host where none restarts: no successor fences its transactional id,
    # and the broker's transaction timeout alone ends the wait of the records behind its transaction.
    tier = app.producer.topics.tier("normal")
    _kill_mid_transaction(app, f"{app.ns}.forwarder.gone", tier)
    receipts = [app.producer.enqueue(app.type("Ledger"), {"key": f"n{i}", "amount": 1}) for i in range(6)]
    app.producer.flush(30)
    wait_until(
        lambda: len(tier_records(app.settings)) == len(receipts),
        timeout=52,  # aborted 35-45 s after it began (the broker looks every 10 s); it was 60-70 s
        what="the records behind the killed forwarder's transaction",
        every=1.0,
    )


def _supervise(
    app: App, slots: list[WorkerProcess], *args: str, until: Callable[[], bool], timeout: float, what: str
) -> int:
    """Keep the worker processes of `slots` running, restarting the dead ones in their slots (as a
    supervisor would), until `until()`; the number of deaths."""
    deaths = 0
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}\n{app.logs()}"
        for i, w in enumerate(slots):
            if w.proc.poll() is not None:
                deaths += 1
                slots[i] = app.spawn(*args)
        time.sleep(0.2)
    return deaths


def _assert_dead_lettered_once_but_for_deaths(app: App, keys: list[str]) -> None:
    """The DLQ holds exactly `keys`, one record each, but for a worker killed between its DLQ record's
    acknowledgement and recording the key dead (the key is recorded dead only once the broker has the record,
    so the key's redelivery runs again and dead-letters it again: a duplicate delivery, never a lost one).
    Every record of a key but its last must then be the same dead-lettering (task, attempts) sent by a
    worker that died: a live worker never dead-letters a key twice."""
    with DeadLetters(app.settings) as dlq:
        records = dlq.list(include_replayed=True)
    by_key: dict[str, list[DlqRecord]] = {}
    for r in records:
        by_key.setdefault(r.idempotency_key or f"<no key: {r.offset}>", []).append(r)
    assert sorted(by_key) == sorted(keys), sorted(by_key)
    dead = {
        r["worker_id"]
        for r in app.query("SELECT worker_id, pid, dead_at FROM taskq_workers")
        if r["dead_at"] is not None or process_gone(r["pid"])
    }
    for key, copies in by_key.items():
        assert len({(r.task_id, r.attempts) for r in copies}) == 1, (key, copies)
        died = [r.worker for r in copies[:-1]]
        assert set(died) <= dead, f"{key} dead-lettered again by a worker that lived on: {died}, dead: {dead}"


def test_a_crashing_task_takes_no_healthy_task_to_the_dlq(app: App) -> None:
    # Transactional tasks under group commit, max_attempts=3: 20 flaky (attempts 1-2 fail), 10 that always
    # fail, 2 poison pills that kill their worker. Two workers, restarted when they die. Only the pills'
    # own deaths may count against them; the tasks that shared their groups and buffers run as if nothing
    # happened (invariant 10).
    flaky = [f"flaky:{i}" for i in range(20)]
    bad = [f"bad:{i}" for i in range(10)]
    pills = ["pill:0", "pill:1"]
    mixed = app.type("Mixed")
    for i, k in enumerate(flaky):
        app.producer.enqueue(mixed, {"key": k, "fail_times": 2}, idempotency_key=k, priority=PRIORITY[i % 4])
    for k in bad:
        app.producer.enqueue(mixed, {"key": k, "fail_times": 99}, idempotency_key=k)
    for k in pills:
        app.producer.enqueue(mixed, {"key": k, "exit_code": 17}, idempotency_key=k)
    app.producer.flush(30)
    args = ("--concurrency", "4")
    slots = [app.spawn(*args) for _ in range(2)]

    def states() -> dict[str, str]:
        return {
            r["idempotency_key"]: r["state"]
            for r in app.query("SELECT idempotency_key, state FROM taskq_tasks")
        }

    deaths = _supervise(
        app,
        slots,
        *args,
        until=lambda: all(states().get(k) == "dead" for k in pills),
        timeout=60,  # each death moves the dead worker's partitions after the session timeout (10 s)
        what="both poison pills in the DLQ",
    )
    deaths += _supervise(
        app,
        slots,
        *args,
        until=lambda: sum(1 for s in states().values() if s in ("completed", "dead")) == 32,
        timeout=120,
        what="every task to end",
    )
    final = states()
    assert sorted(k for k, s in final.items() if s == "dead") == sorted(bad + pills), (final, app.logs())
    app.assert_once_each(flaky)
    rows = {
        r["idempotency_key"]: r
        for r in app.query("SELECT idempotency_key, attempts, interruptions, last_error FROM taskq_tasks")
    }
    for k in pills:  # max(max_attempts, 2) = 3 deaths of its own, each in quarantine
        assert (
            rows[k]["interruptions"] == 3
            and "3 run(s) ended with their worker's death" in rows[k]["last_error"]
        )
    for k in bad:
        assert rows[k]["attempts"] == 3 and "failed 3 attempt(s)" in rows[k]["last_error"], rows[k]
    # Each pill kills the worker of its first, unmarked run (one death for both when they ran in one group)
    # and three in quarantine; nothing else kills.
    assert deaths in (7, 8), f"{deaths} deaths"
    _assert_dead_lettered_once_but_for_deaths(app, bad + pills)


def test_one_pill_among_200_healthy_tasks_dead_letters_only_itself_under_kills_and_restarts(app: App) -> None:
    # max_attempts=1: a healthy task charged for one death beside the pill would be dead-lettered.
    keys = [f"ok:{i}" for i in range(200)]
    mixed = app.type("Mixed")
    for i, k in enumerate(keys):
        app.producer.enqueue(mixed, {"key": k}, idempotency_key=k, max_attempts=1, priority=PRIORITY[i % 4])
        if i == 60:
            app.producer.enqueue(
                mixed, {"key": "pill", "exit_code": 17}, idempotency_key="pill", max_attempts=1
            )
    app.producer.flush(30)
    args = ("--concurrency", "8")
    slots = [app.spawn(*args) for _ in range(3)]
    ended = lambda: app.scalar("SELECT count(*) FROM taskq_tasks WHERE state IN ('completed', 'dead')")  # noqa: E731
    # A kill -9 of a healthy worker too, once work is under way: its keys are taken over uncharged.
    _supervise(app, slots, *args, until=lambda: ended() >= 50, timeout=120, what="50 tasks to end")
    next(w for w in slots if w.proc.poll() is None).kill()
    _supervise(app, slots, *args, until=lambda: ended() == 201, timeout=180, what="every task to end")
    app.assert_once_each(keys)
    dead = app.query("SELECT idempotency_key, last_error FROM taskq_tasks WHERE state = 'dead'")
    assert [r["idempotency_key"] for r in dead] == ["pill"], dead
    assert "2 run(s) ended with their worker's death" in dead[0]["last_error"], dead
    _assert_dead_lettered_once_but_for_deaths(app, ["pill"])
