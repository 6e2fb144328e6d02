"""Per-key concurrency caps and execution-time rate limits, shared by two worker processes in Postgres."""

from __future__ import annotations

import itertools
from datetime import datetime
from typing import Any

from taskq.producer.producer import TaskSpec
from tests.acceptance.conftest import App
from tests.acceptance.helpers import all_committed, wait_until


def start_two_workers(app: App, **env: str) -> None:
    """Two workers of one group, both with partitions before anything is enqueued."""
    workers = [app.spawn("--concurrency", "8", **env) for _ in range(2)]
    wait_until(
        lambda: all(" assigned " in w.output() for w in workers),
        timeout=90,
        what=f"both workers to be assigned partitions\n{app.logs()}",
    )


def enqueue(app: App, name: str, payloads: list[dict[str, Any]]) -> None:
    app.producer.enqueue_many([TaskSpec(task_type=app.type(name), payload=p) for p in payloads])
    app.producer.flush(60)


def runs(app: App, task_type: str) -> list[dict[str, Any]]:
    return app.query(
        "SELECT partner, seq, attempt, worker, started_at, ended_at FROM limit_runs WHERE task_type = %s "
        "ORDER BY started_at",
        task_type,
    )


def wait_done(app: App, task_type: str, n: int) -> None:
    wait_until(
        lambda: (
            app.scalar(
                "SELECT count(*) FROM taskq_tasks WHERE task_type = %s AND state = 'completed'",
                app.type(task_type),
            )
            == n
            and all_committed(app.settings)
        ),
        timeout=120,
        what=f"{n} {task_type} tasks completed\n{app.logs()}",
    )


def most_at_once(intervals: list[tuple[datetime, datetime]]) -> int:
    """The largest number of intervals open at one instant (an end at the instant of a start closes first)."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = most = 0
    for _, step in events:
        running += step
        most = max(most, running)
    return most


def test_at_most_two_tasks_of_a_partner_run_at_once_across_two_workers(app: App) -> None:
    start_two_workers(app)
    partners = ["p0", "p1", "p2"]
    enqueue(app, "Capped", [{"partner": p, "seq": i, "seconds": 0.3} for i in range(12) for p in partners])
    wait_done(app, "Capped", 36)
    rows = runs(app, "Capped")
    assert len(rows) == 36 and all(r["ended_at"] is not None for r in rows)
    by_partner: dict[str, list[tuple[datetime, datetime]]] = {}
    for r in rows:
        by_partner.setdefault(r["partner"], []).append((r["started_at"], r["ended_at"]))
    most = {p: most_at_once(intervals) for p, intervals in by_partner.items()}
    # Two workers of concurrency 8 could run all 12 of a partner at once: the cap holds them at 2.
    assert most == dict.fromkeys(partners, 2), most
    assert len({r["worker"] for r in rows}) == 2  # both workers ran them, sharing each partner's slots
    assert app.scalar("SELECT max(attempts) FROM taskq_tasks WHERE task_type = %s", app.type("Capped")) == 1
    assert app.scalar("SELECT count(*) FROM taskq_slots") == 0  # every slot given back


def test_a_bucket_of_50_a_second_shared_by_two_workers_lets_through_at_most_its_rate_and_burst(
    app: App,
) -> None:
    start_two_workers(app, TASKQ_TEST_RATE="50/s")
    enqueue(app, "Paced", [{"partner": "api", "seq": i} for i in range(300)])
    wait_done(app, "Paced", 300)
    starts = [r["started_at"] for r in runs(app, "Paced")]
    assert len(starts) == 300
    # Over any stretch of starts: at most 50 a second plus the burst of 50. The slack covers the tokens a
    # worker leases ahead (3 at 50/s) and a dispatch's tasks starting a moment after their tokens were
    # granted (up to its 8 slots), per worker; a machine's slowness only spreads starts further apart.
    slack = 2 * (3 + 8)
    worst = max(
        (j - i + 1) - (50 * (starts[j] - starts[i]).total_seconds() + 50)
        for i in range(len(starts))
        for j in range(i, len(starts))
    )
    assert worst <= slack, f"{worst:.1f} starts beyond 50/s + 50 over some stretch"
    # Unlimited, two workers of 8 run 300 empty tasks in well under a second: the limit made them wait.
    assert (starts[-1] - starts[0]).total_seconds() >= (300 - 50 - slack) / 50
    assert app.scalar("SELECT max(attempts) FROM taskq_tasks WHERE task_type = %s", app.type("Paced")) == 1
    assert len({r["worker"] for r in runs(app, "Paced")}) == 2


def test_a_retry_delay_pauses_its_partner_for_both_workers_while_another_partner_runs_on(app: App) -> None:
    start_two_workers(app, TASKQ_TEST_RATE="10/s")
    payloads = [{"partner": p, "seq": i, "pause": 3.0 if p == "a" else 0.0} for i in range(40) for p in "ab"]
    enqueue(app, "Paced", payloads)
    wait_done(app, "Paced", 80)
    (paused_at,) = [r["at"] for r in app.query("SELECT at FROM limit_pauses WHERE partner = 'a'")]
    rows = runs(app, "Paced")
    # a's first attempts after its 429 (the retried task's second one would come after its own delay anyway):
    # perhaps a few granted before the pause reached Postgres, then none for the pause's 3 s, then the rest,
    # on both workers. Unlimited, all 40 start within a second, with no gap.
    a_after = [r for r in rows if r["partner"] == "a" and r["attempt"] == 1 and r["started_at"] > paused_at]
    times = [paused_at] + [r["started_at"] for r in a_after]
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(times)]
    gap = max(range(len(gaps)), key=gaps.__getitem__)
    assert gaps[gap] >= 2.8, f"a's longest pause after the 429 was {gaps[gap]:.2f} s"
    gap_start, gap_end = times[gap], times[gap + 1]
    assert len({r["worker"] for r in a_after if r["started_at"] >= gap_end}) == 2  # both had a's tasks
    b_during = [r for r in rows if r["partner"] == "b" and gap_start < r["started_at"] < gap_end]
    assert len(b_during) >= 10, f"b ran {len(b_during)} task(s) while a was paused"
    attempts = app.query(
        "SELECT attempts, count(*) AS n FROM taskq_tasks WHERE task_type = %s GROUP BY attempts",
        app.type("Paced"),
    )
    assert {r["attempts"]: r["n"] for r in attempts} == {1: 79, 2: 1}  # only the task told to retry


def test_a_capped_key_whose_slots_a_killed_worker_held_runs_again_elsewhere_within_15_s(app: App) -> None:
    first = app.spawn("--concurrency", "4")
    wait_until(lambda: " assigned " in first.output(), timeout=90, what=f"the first worker\n{app.logs()}")
    # Both of p's slots, for 25 s each; leased for 50 s (timeout 30 s): far beyond the 15 s waited below.
    enqueue(app, "Capped", [{"partner": "p", "seq": i, "seconds": 25.0} for i in range(2)])

    def started_on(pid: int) -> int:
        return int(app.scalar("SELECT count(*) FROM limit_runs WHERE partner = 'p' AND worker = %s", pid))

    wait_until(lambda: started_on(first.proc.pid) == 2, timeout=60, what=f"p's two runs\n{app.logs()}")
    second = app.spawn("--concurrency", "4")
    wait_until(lambda: " assigned " in second.output(), timeout=90, what=f"the second worker\n{app.logs()}")
    enqueue(app, "Capped", [{"partner": "p", "seq": 2, "seconds": 0.0}])
    first.kill()
    # p's slots are held by a dead worker, leased for 50 s. Once its heartbeat is stale (10 s) they count no
    # more, and the runs taken over from it replace their own slots: the second worker runs p's tasks.
    wait_until(lambda: started_on(second.proc.pid) >= 1, timeout=15, what=f"p to run again\n{app.logs()}")
