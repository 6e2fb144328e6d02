"""Workers as real processes: one effect per key through crashes and rebalances; tiers, timeouts, SIGTERM."""

from __future__ import annotations

import itertools
import os
import time
from collections import Counter
from pathlib import Path

import pytest

from taskq._core.envelope import PRIORITIES
from taskq._core.store import Store
from taskq.consumer.scheduler import PriorityScheduler
from taskq.producer.admin import create_topics
from taskq.producer.producer import TaskSpec
from tests.acceptance.conftest import App
from tests.acceptance.helpers import WorkerProcess, all_committed, wait_until


def test_each_key_takes_effect_once_across_three_workers(app: App) -> None:
    keys = [f"k{i:05d}" for i in range(2000)]
    app.enqueue_ledger(keys, copies=2)
    for _ in range(3):
        app.spawn("--concurrency", "4")
    wait_until(
        lambda: app.scalar("SELECT count(DISTINCT key) FROM ledger") == len(keys),
        timeout=240,
        what="2000 ledger keys",
    )
    wait_until(lambda: all_committed(app.settings), timeout=60, what="the group to commit every offset")
    app.assert_once_each(keys)
    assert app.scalar("SELECT count(*) FROM ledger") == len(keys)


def test_kill_9_and_rebalances_keep_one_effect_per_key(app: App) -> None:
    keys = [f"c{i:05d}" for i in range(1500)]
    app.enqueue_ledger(keys, copies=2, sleep=0.002)
    done = lambda: app.scalar("SELECT count(DISTINCT key) FROM ledger")  # noqa: E731
    first = app.spawn("--concurrency", "4")
    wait_until(lambda: done() >= 150, timeout=120, what="the first worker to make progress")
    second = app.spawn("--concurrency", "4")  # joins: a rebalance
    wait_until(lambda: done() >= 500, timeout=120, what="progress with two workers")
    first.kill()  # kill -9 mid-run: its claims stay leased until they expire
    third = app.spawn("--concurrency", "4")
    wait_until(lambda: done() >= 900, timeout=120, what="progress after the kill")
    second.terminate()  # leaves gracefully: another rebalance
    assert second.wait(60) == 0, second.output()[-3000:]
    app.spawn("--concurrency", "4")  # the restart
    wait_until(lambda: done() == len(keys), timeout=240, what="every key after kill -9 and restarts")
    wait_until(lambda: all_committed(app.settings), timeout=90, what="the group to commit every offset")
    app.assert_once_each(keys)
    assert third.proc.poll() is None, "a surviving worker died"


def test_namespaces_sharing_a_database_each_run_their_own_task_of_one_key_once(app: App) -> None:
    # A second namespace in the same database schema: its own topics, workers and task types.
    other_settings = app.settings.with_namespace(f"{app.ns}.other")
    create_topics(other_settings, partitions=3)
    other = App(
        other_settings,
        lambda **env: app.env_of(**{"TASKQ_NAMESPACE": other_settings.namespace, **env}),
        app.tmp_path / "other",
    )
    (app.tmp_path / "other").mkdir()
    try:
        for a in (app, other):
            a.enqueue_ledger(["shared"], copies=2)  # idempotency key 'ledger:shared' in both namespaces
            a.spawn("--concurrency", "2")
        ran = lambda: app.scalar("SELECT count(*) FROM ledger WHERE key = 'shared'")  # noqa: E731
        wait_until(lambda: ran() >= 2, timeout=90, what=f"both namespaces' tasks to run\n{app.logs()}")
        for a in (app, other):
            wait_until(lambda a=a: all_committed(a.settings), timeout=60, what=f"{a.ns} to commit")
            for w in a.workers:
                w.terminate()
                assert w.wait(60) == 0, w.output()[-3000:]
        assert ran() == 2  # once in each namespace
        states = app.query("SELECT namespace, state, attempts FROM taskq_tasks ORDER BY namespace")
        assert states == [
            {"namespace": app.ns, "state": "completed", "attempts": 1},
            {"namespace": other.ns, "state": "completed", "attempts": 1},
        ]
    finally:
        other.close()


def test_a_worker_keeps_a_liveness_record_while_it_runs_and_removes_it_on_a_clean_stop(app: App) -> None:
    def record(w: WorkerProcess) -> dict[str, object] | None:
        rows = app.query(
            "SELECT namespace, worker_group, pid, concurrency, heartbeat_at, dead_at FROM taskq_workers "
            "WHERE worker_id LIKE %s",
            f"%:{w.proc.pid}:%",
        )
        return rows[0] if rows else None

    stopped, killed = app.spawn("--concurrency", "2"), app.spawn("--concurrency", "3", "--no-forwarder")
    first = wait_until(lambda: record(stopped), timeout=60, what=f"the liveness record\n{app.logs()}")
    assert (first["namespace"], first["worker_group"], first["pid"], first["concurrency"]) == (
        app.ns,
        f"{app.ns}.workers",
        stopped.proc.pid,
        2,
    )
    wait_until(
        lambda: (r := record(stopped)) is not None and r["heartbeat_at"] > first["heartbeat_at"],
        timeout=15,
        what="a heartbeat",
    )
    wait_until(lambda: record(killed), timeout=60, what="the second worker's record")
    stopped.terminate()
    assert stopped.wait(60) == 0, stopped.output()[-3000:]
    assert record(stopped) is None  # a clean stop: every key was completed, failed or released
    killed.kill()
    late = record(killed)
    assert late is not None and late["dead_at"] is None  # kept: it goes stale, and its keys are taken over
    restarted = app.spawn("--concurrency", "1", "--no-forwarder")  # on the same host: the process is gone
    wait_until(lambda: record(restarted), timeout=60, what="the restarted worker's record")
    wait_until(
        lambda: (r := record(killed)) is not None and r["dead_at"] is not None,
        timeout=15,
        what="the restarted worker to mark its dead predecessor",
    )


def test_keys_of_a_killed_worker_run_again_elsewhere_within_15_s_whatever_their_lease(app: App) -> None:
    # Hold has no timeout: its keys are leased for 300 s (plus the claim wait). Max attempts 1: a task that
    # was merely in flight, or claimed ahead, on the killed worker must not be dead-lettered for it.
    keys = [f"h{i:02d}" for i in range(24)]
    for k in keys:
        app.producer.enqueue(app.type("Hold"), {"key": k, "seconds": 1.5}, idempotency_key=f"hold:{k}")
    app.producer.flush(30)
    first = app.spawn("--concurrency", "3", "--no-forwarder")
    second = app.spawn("--concurrency", "3", "--no-forwarder")

    def held_by(w: WorkerProcess) -> set[str]:
        rows = app.query(
            "SELECT idempotency_key FROM taskq_tasks WHERE state = 'running' AND lease_owner LIKE %s",
            f"%:{w.proc.pid}:%",
        )
        return {r["idempotency_key"] for r in rows}

    wait_until(lambda: held_by(first) and held_by(second), timeout=90, what=f"both workers to hold keys\n{app.logs()}")
    first.kill()
    held = held_by(first)
    assert held

    def moved_on() -> bool:
        rows = app.query(
            "SELECT idempotency_key, state, lease_owner FROM taskq_tasks WHERE idempotency_key = ANY(%s)",
            sorted(held),
        )
        return all(r["state"] == "completed" or f":{first.proc.pid}:" not in (r["lease_owner"] or "") for r in rows)

    wait_until(moved_on, timeout=15, what=f"another worker to take over {sorted(held)}\n{app.logs()}")
    wait_until(
        lambda: app.scalar("SELECT count(DISTINCT key) FROM ledger") == len(keys),
        timeout=120,
        what=f"every Hold task\n{app.logs()}",
    )
    app.assert_once_each(keys)
    states = app.query("SELECT state, count(*) AS n, max(attempts) AS attempts FROM taskq_tasks GROUP BY state")
    assert states == [{"state": "completed", "n": len(keys), "attempts": 1}], states  # none dead-lettered
    wait_until(lambda: all_committed(app.settings), timeout=60, what="the group to commit every offset")


def test_tasks_claimed_ahead_on_two_killed_workers_run_once_with_one_attempt(app: App) -> None:
    # Hold has max_attempts=1. Its type is paused, so each worker claims its tasks ahead and holds them in
    # its buffer, unstarted: two such workers killed in turn must leave them to run, not dead-lettered.
    keys = [f"a{i:02d}" for i in range(12)]
    for k in keys:
        app.producer.enqueue(app.type("Hold"), {"key": k, "seconds": 0.0}, idempotency_key=f"hold:{k}")
    app.producer.flush(30)
    store = Store(app.db)
    store.pause(app.ns, "task_type", app.type("Hold"))

    def held_by(w: WorkerProcess) -> int:
        return int(
            app.scalar(
                "SELECT count(*) FROM taskq_tasks WHERE state = 'running' AND lease_owner LIKE %s",
                f"%:{w.proc.pid}:%",
            )
        )

    for _ in range(2):
        w = app.spawn("--concurrency", "2", "--no-forwarder")
        wait_until(
            lambda w=w: held_by(w) == len(keys), timeout=60, what=f"a worker to claim them all\n{app.logs()}"
        )
        w.kill()  # kill -9: the next worker takes its keys over at once (it finds the process gone)
    store.resume(app.ns, "task_type", app.type("Hold"))
    app.spawn("--concurrency", "2", "--no-forwarder")
    wait_until(
        lambda: app.scalar("SELECT count(*) FROM taskq_tasks WHERE state <> 'running'") == len(keys),
        timeout=60,
        what=f"every Hold task to end\n{app.logs()}",
    )
    rows = app.query(
        "SELECT state, attempts, takeovers, interruptions, count(*) AS n FROM taskq_tasks GROUP BY 1, 2, 3, 4"
    )
    assert rows == [{"state": "completed", "attempts": 1, "takeovers": 2, "interruptions": 0, "n": len(keys)}]
    app.assert_once_each(keys)


@pytest.mark.quiet  # judges the order tasks completed in, which a starved CPU blurs
def test_tiers_share_one_slot_by_weight_without_starving_low(app: App) -> None:
    per_tier = 120
    specs = [
        TaskSpec(
            task_type=app.type("Ledger"),
            payload={"key": f"{p}-{i}", "amount": i, "sleep": 0.01},
            priority=p,
        )
        for p in PRIORITIES
        for i in range(per_tier)
    ]
    app.producer.enqueue_many(specs)
    app.producer.flush(60)
    app.spawn("--concurrency", "1", "--weights", "8,4,2,1")
    wait_until(lambda: app.scalar("SELECT count(*) FROM ledger") >= 150, timeout=120, what="150 completions")
    order = [r["priority"] for r in app.query("SELECT priority FROM ledger ORDER BY seq LIMIT 150")]
    # The first few picks may come before every tier's partitions were fetched; judge the steady state.
    window = order[15:150]
    shares = Counter(window)
    expected = {"critical": 8 / 15, "high": 4 / 15, "normal": 2 / 15, "low": 1 / 15}
    for tier, share in expected.items():
        got = shares[tier] / len(window)
        assert abs(got - share) <= 0.05, (
            f"{tier}: {got:.3f} of completions, expected {share:.3f} ± 0.05: {shares}"
        )
    # Low keeps moving: at least one low completion in every 30 consecutive completions of the window.
    for start in range(0, len(window) - 30, 15):
        assert "low" in window[start : start + 30], f"low starved in completions {start + 15}..{start + 45}"


WEIGHTS = {"critical": 8, "high": 4, "normal": 2, "low": 1}


@pytest.mark.quiet  # 8 slots' completions on a CPU starved by other tests drift out of their dispatch order
@pytest.mark.parametrize("concurrency", [1, 8])
@pytest.mark.parametrize("kind", ["Ledger", "Plain"])
def test_dispatch_follows_the_weights_over_every_window_of_150_completions(
    app: App, kind: str, concurrency: int
) -> None:
    # 600 tasks a tier, the lowest enqueued first; a handler of about 4 ms, transactional (group commit) or
    # not. While every tier has work, each tier's share of the first 600 completions, and of every 150 of
    # them, is within 15 % of its weight (invariant 4).
    per_tier = 600
    extra = {"amount": 0} if kind == "Ledger" else {}
    for p in reversed(PRIORITIES):
        app.producer.enqueue_many(
            [
                TaskSpec(
                    task_type=app.type(kind),
                    payload={"key": f"{p}-{i}", "sleep": 0.004, **extra},
                    priority=p,
                )
                for i in range(per_tier)
            ]
        )
    app.producer.flush(60)
    app.spawn("--concurrency", str(concurrency))
    wait_until(lambda: app.scalar("SELECT count(*) FROM ledger") >= 600, timeout=120, what="600 completions")
    order = [r["priority"] for r in app.query("SELECT priority FROM ledger ORDER BY seq LIMIT 600")]
    total = sum(WEIGHTS.values())

    # Eight slots finish their tasks up to eight places out of their dispatch order, so each of a window's
    # two edges may take in or leave out as many tasks of a tier as eight consecutive picks of the weighted
    # order hold: for low (10 of 150) 1 an edge, more than 15 %; for normal (20 of 150) 2 an edge, whose
    # picks are 7 and 8 apart. A drift is far beyond either (normal at twice its share was the regression
    # this test was made for).
    # Group commits deal a wave's picks to its groups in turn, and the groups run side by side member by
    # member, so effects land in pick order while the groups keep pace. A group a member behind its peers (its
    # thread waiting on two busy cores while the loop takes in the first buffer) lands its members' effects a
    # round (eight places) late, and an edge may take in or leave out two rounds' picks: 3 of normal's. Seen
    # once in 15 clean-clone runs: normal 4 ahead of its weight after the first wave's 30th effect and level
    # by its 60th, so 15 of 20 in the windows starting at 27-30; every tier within 1 of its weight after.
    rounds = 2 if kind == "Ledger" else 1
    edges = {t: 2.0 * _most_in_a_row(t, rounds * concurrency) if concurrency > 1 else 0.0 for t in WEIGHTS}

    def off(window: list[str]) -> dict[str, tuple[int, float]]:
        counts = Counter(window)
        expected = {t: len(window) * w / total for t, w in WEIGHTS.items()}
        return {
            t: (counts[t], e) for t, e in expected.items() if abs(counts[t] - e) > max(0.15 * e, edges[t])
        }

    assert not off(order), f"shares of the first 600 completions: {Counter(order)}; order: {''.join(t[0] for t in order)}"
    # A tier whose buffer ran dry while Kafka still held its records (a fetch that came back late: a broker
    # paused for longer than the tier's buffered work) gives its turns to the tiers that have work, as it
    # must: slots are not left idle. Weighted dispatch alone never leaves critical out of more than 2 picks
    # in a row, nor high out of more than 3; with eight slots (their groups dealt the picks in turn) the
    # longest absences in 48 runs were critical's 4-8 and high's 7-13 completions, and 27-33 three times. A
    # longer absence than 6 or 14 is taken for a dry spell; counting an ordinary one as a spell only spares
    # its windows. One is tolerated in 600 completions, and only the windows that take it in are
    # not judged; more than one, or a long one, fails (a worker that refetches too late).
    longest = {"critical": 6, "high": 14} if concurrency > 1 else {"critical": 3, "high": 4}
    spells = _absences(order, longest)
    assert len(spells) <= 1 and sum(end - start for start, end in spells) <= 50, (
        f"dry spells (first, last completion) {spells}; order: {''.join(t[0] for t in order)}"
    )
    bad = {
        start: off(order[start : start + 150])
        for start in range(0, 451)
        if not any(first < start + 150 and last >= start for first, last in spells)
    }
    bad = {start: v for start, v in bad.items() if v}
    assert not bad, (
        f"{len(bad)} windows of 150 off their weights, e.g. at {min(bad)}: {bad[min(bad)]} "
        f"(tier: (completions, expected)); order: {''.join(t[0] for t in order)}"
    )


def _most_in_a_row(tier: str, picks: int) -> int:
    """The most tasks of `tier` among `picks` consecutive picks of the weighted order (two of its periods
    popped from the worker's own scheduler)."""
    period = sum(WEIGHTS.values())
    scheduler: PriorityScheduler[str] = PriorityScheduler(weights=WEIGHTS, capacity=8 * period)
    for t in PRIORITIES:
        for _ in range(2 * WEIGHTS[t]):
            scheduler.push(t, t)
    order = [scheduler.pop() for _ in range(2 * period)]
    return max(order[i : i + picks].count(tier) for i in range(2 * period - picks + 1))


def _absences(order: list[str], longest: dict[str, int]) -> list[tuple[int, int]]:
    """Stretches (first, last index) in which a tier of `longest` is absent for more than its count,
    merged where they overlap."""
    found: list[tuple[int, int]] = []
    for tier, most in longest.items():
        seen = [-1] + [i for i, t in enumerate(order) if t == tier] + [len(order)]
        found += [(a + 1, b - 1) for a, b in itertools.pairwise(seen) if b - a - 1 > most and b < len(order)]
    merged: list[tuple[int, int]] = []
    for first, last in sorted(found):
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    return merged


def test_timeouts_fail_the_attempt_and_crashes_spare_the_worker(app: App) -> None:
    pid_file = str(app.tmp_path / "child.pid")
    app.producer.enqueue(app.type("Sleep"), {"seconds": 4.0}, idempotency_key="sleep-thread")
    app.producer.enqueue(
        app.type("SleepProc"), {"seconds": 60.0, "pid_file": pid_file}, idempotency_key="sleep-proc"
    )
    app.producer.enqueue(app.type("Exit"), {"code": 3}, idempotency_key="exit")
    app.producer.enqueue(app.type("RejectProc"), {"code": 7}, idempotency_key="reject-proc")
    app.producer.enqueue(app.type("Ledger"), {"key": "after", "amount": 1}, idempotency_key="after")
    app.producer.flush(30)
    worker = app.spawn("--concurrency", "4")

    def state(key: str) -> str | None:
        return app.scalar("SELECT state FROM taskq_tasks WHERE idempotency_key = %s", key)

    for key in ("sleep-thread", "sleep-proc", "exit", "reject-proc"):
        wait_until(lambda key=key: state(key) == "dead", timeout=90, what=f"{key} to fail its only attempt")
    errors = {r["idempotency_key"]: r["last_error"] for r in app.query("SELECT * FROM taskq_tasks")}
    assert "timed out" in errors["sleep-thread"].lower(), errors
    assert "timed out" in errors["sleep-proc"].lower(), errors
    assert "exit code 3" in errors["exit"], errors
    # Reject raised in a child process still means "never retry": one attempt of its five.
    assert "rejected" in errors["reject-proc"] and "code 7" in errors["reject-proc"], errors
    assert app.scalar("SELECT attempts FROM taskq_tasks WHERE idempotency_key = 'reject-proc'") == 1
    child = int(
        wait_until(lambda: os.path.exists(pid_file) and Path(pid_file).read_text(), timeout=10, what="pid")
    )

    def child_gone() -> bool:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return True
        return False

    wait_until(child_gone, timeout=30, what="the timed-out child process to be killed")
    wait_until(lambda: state("after") == "completed", timeout=60, what="the task behind the crash")
    assert worker.proc.poll() is None, worker.output()[-3000:]


def test_sigterm_finishes_in_flight_tasks_and_the_rest_run_once_elsewhere(app: App) -> None:
    keys = [f"s{i}" for i in range(8)]
    app.enqueue_ledger(keys, copies=1, sleep=1.5)
    shutdown_timeout = 10
    first = app.spawn("--concurrency", "2", "--shutdown-timeout", str(shutdown_timeout))
    # A task in flight: a handler running in its group's transaction, its marker the last statement
    # (pipelined, perhaps not yet answered: the session is 'active') - a key in state 'running' is only
    # claimed, possibly still waiting in the buffer.
    wait_until(
        lambda: app.scalar(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE state IN ('active', 'idle in transaction') AND query = %s AND application_name = %s",
            "SELECT 'ledger task in flight'",
            app.ns,  # the worker's sessions (env_of's PGAPPNAME), not those of tests running beside this one
        )
        >= 1,
        timeout=60,
        what="tasks in flight",
    )
    started = time.monotonic()
    first.terminate()
    assert first.wait(shutdown_timeout + 20) == 0, first.output()[-3000:]
    assert time.monotonic() - started < shutdown_timeout + 15
    finished_by_first = app.scalar("SELECT count(*) FROM ledger")
    assert finished_by_first >= 1, first.output()[-3000:]
    app.spawn("--concurrency", "4")
    wait_until(
        lambda: app.scalar("SELECT count(DISTINCT key) FROM ledger") == len(keys),
        timeout=120,
        what="the rest on another worker",
    )
    app.assert_once_each(keys)


def test_a_second_signal_exits_at_once(app: App) -> None:
    app.enqueue_ledger(["slow"], copies=1, sleep=3.0)
    worker = app.spawn("--concurrency", "1", "--shutdown-timeout", "60")
    wait_until(
        lambda: app.scalar(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE state IN ('active', 'idle in transaction') AND query = %s AND application_name = %s",
            "SELECT 'ledger task in flight'",
            app.ns,  # the worker's sessions (env_of's PGAPPNAME), not those of tests running beside this one
        )
        == 1,
        timeout=60,
        what="the slow task in flight",
    )
    worker.terminate()
    wait_until(lambda: "stopping" in worker.output(), timeout=30, what="the worker to start its shutdown")
    worker.terminate()
    # Graceful shutdown exits 0 after the task; the second signal skips it: 128 + SIGTERM.
    assert worker.wait(30) == 128 + 15, worker.output()[-3000:]
