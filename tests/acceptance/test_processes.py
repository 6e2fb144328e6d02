"""`taskq worker --processes N`: a supervisor and its worker processes, run as real processes."""

from __future__ import annotations

import os
import re
import signal

from tests.acceptance.conftest import App
from tests.acceptance.helpers import WorkerProcess, all_committed, process_gone, uncommitted, wait_until
from tests.acceptance.test_worker_ops import _free_port, _get, _sample


def _children(supervisor: WorkerProcess) -> dict[int, int]:
    """The pid of each worker process the supervisor started last, by process number."""
    started = re.findall(r"worker process (\d+) started: pid (\d+)", supervisor.output())
    return {int(n): int(pid) for n, pid in started}


def _owners(supervisor: WorkerProcess) -> set[int]:
    """Pids of the worker processes that have been assigned partitions."""
    return {int(pid) for pid in re.findall(r"taskq\.worker\[(\d+)\]: assigned \S", supervisor.output())}


def _done(app: App) -> int:
    return int(app.scalar("SELECT count(DISTINCT key) FROM ledger"))


def test_two_processes_share_the_work_and_one_metrics_endpoint_sums_them(app: App) -> None:
    port = _free_port()
    supervisor = app.spawn("--processes", "2", "--concurrency", "2", "--metrics-port", str(port))
    wait_until(lambda: len(_owners(supervisor)) == 2, timeout=60, what="both processes to own partitions")
    keys = [f"p{i:04d}" for i in range(200)]
    app.enqueue_ledger(keys, copies=2, sleep=0.01)
    wait_until(lambda: _done(app) == len(keys), timeout=90, what=f"{len(keys)} ledger keys")
    wait_until(lambda: all_committed(app.settings), timeout=60, what="the group to commit every offset")
    app.assert_once_each(keys)
    children = set(_children(supervisor).values())
    assert {r["worker"] for r in app.query("SELECT DISTINCT worker FROM ledger")} == children
    assert len(children) == 2

    base = f"http://127.0.0.1:{port}"
    labels = f'task_type="{app.type("Ledger")}"'
    # Each process counts only its own attempts: one series of the sum, over both.
    wait_until(
        lambda: _sample(_get(base + "/metrics")[1], "taskq_tasks_succeeded_total", labels) == len(keys),
        timeout=30,
        what=f"taskq_tasks_succeeded_total == {len(keys)}",
    )
    status, body = _get(base + "/metrics")
    assert status == 200
    assert body.count(f"taskq_tasks_succeeded_total{{{labels}}}") == 1, body
    assert _sample(body, "taskq_tasks_started_total", labels) == len(keys)
    ratios = re.findall(r'^taskq_slot_utilisation_ratio\{pid="(\d+)"\}', body, re.M)
    assert {int(pid) for pid in ratios} == children, body
    assert _get(base + "/healthz")[0] == 200

    supervisor.terminate()
    assert supervisor.wait(60) == 0, supervisor.output()[-3000:]
    assert all(process_gone(pid) for pid in children)


def test_a_killed_process_is_restarted_and_each_key_takes_effect_once(app: App) -> None:
    keys = [f"k{i:04d}" for i in range(300)]
    app.enqueue_ledger(keys, copies=2, sleep=0.02)
    supervisor = app.spawn("--processes", "2", "--concurrency", "2")
    wait_until(lambda: _done(app) >= 50, timeout=90, what="progress before the kill")
    victim = _children(supervisor)[1]
    os.kill(victim, signal.SIGKILL)
    wait_until(
        lambda: _children(supervisor)[1] != victim, timeout=30, what="worker process 1 to be restarted"
    )
    died = rf"worker process 1 \(pid {victim}\) died after .*: killed by SIGKILL; restarting it in 1 s"
    assert re.search(died, supervisor.output()), supervisor.output()[-3000:]
    wait_until(lambda: _done(app) == len(keys), timeout=120, what="every key after the kill")
    wait_until(lambda: all_committed(app.settings), timeout=60, what="the group to commit every offset")
    app.assert_once_each(keys)
    assert app.scalar("SELECT count(*) FROM ledger") == len(keys)
    assert supervisor.proc.poll() is None, supervisor.output()[-3000:]


def test_sigterm_stops_every_process_gracefully_and_what_ran_is_committed(app: App) -> None:
    n = 200
    app.enqueue_ledger([f"s{i:04d}" for i in range(n)], copies=1, sleep=0.2)
    supervisor = app.spawn("--processes", "2", "--concurrency", "2")
    # Both processes running tasks when the signal comes: one slow to start (a busy machine) would be
    # stopped before it had anything to finish.
    wait_until(lambda: len(_owners(supervisor)) == 2, timeout=60, what="both processes to own partitions")
    wait_until(lambda: _done(app) >= 8, timeout=90, what="tasks running")
    children = set(_children(supervisor).values())
    supervisor.terminate()
    assert supervisor.wait(60) == 0, supervisor.output()[-3000:]
    out = supervisor.output()
    assert len(re.findall(r"taskq\.worker\[\d+\]: SIGTERM: stopping", out)) == 2, out[-3000:]
    assert len(re.findall(r"worker process \d \(pid \d+\) stopped: exit code 0", out)) == 2, out[-3000:]
    assert all(process_gone(pid) for pid in children)
    # Each process finished what it ran and committed it: what is left is what never ran, plus what ran
    # after a task of its partition that was given back unstarted (offsets commit contiguously; such a
    # task is skipped as a duplicate when it is read again).
    done = _done(app)
    left = uncommitted(app.settings)
    assert left is not None and sum(left.values()) >= n - done, (left, done)
    assert app.scalar("SELECT count(*) FROM ledger") == done
    # Nothing lost, nothing doubled: another worker runs the rest, each task once.
    app.spawn("--concurrency", "4")
    wait_until(lambda: _done(app) == n, timeout=120, what="the rest on another worker")
    wait_until(lambda: all_committed(app.settings), timeout=60, what="every offset committed")
    app.assert_once_each([f"s{i:04d}" for i in range(n)])


def test_a_process_that_keeps_dying_at_start_makes_the_supervisor_give_up_in_one_line(app: App) -> None:
    # A deployment with a wrong database URL: the handlers import, but every worker process dies at start.
    supervisor = app.spawn("--processes", "2", TASKQ_DATABASE_URL="postgresql://postgres@127.0.0.1:1/taskq")
    # The fifth death comes about 20 s in (restarts after 1, 2, 4 and 8 s); the other process then has the
    # shutdown timeout (30 s) and its margin (15 s) to stop before it is killed. Once, under the full suite,
    # it hung in its start (closing its consumer after Postgres refused it) and the supervisor waited on it.
    assert supervisor.wait(90) == 2, supervisor.output()[-3000:]
    last = supervisor.output().strip().splitlines()[-1]
    assert re.fullmatch(
        r"taskq: error: worker process \d died 5 times within 60 s \(last: pid \d+, exit code 2\); "
        r"stopped the others and gave up",
        last,
    ), supervisor.output()[-3000:]
    assert all(process_gone(pid) for pid in _children(supervisor).values())


def test_a_worker_process_that_ignores_the_stop_is_killed_past_the_shutdown_timeout(app: App) -> None:
    # A worker process that never answers SIGTERM (hung in a C call, say): once the shutdown timeout and its
    # margin (15 s) have passed, the supervisor kills it and exits, instead of waiting for it for ever. (A
    # supervisor giving up after a process kept dying stops the others the same way.)
    argv = ("worker", "tests.apps.hangs_in_workers:handlers", "--processes", "2", "--shutdown-timeout", "1")
    supervisor = WorkerProcess.command(app.env_of(), app.tmp_path / "hung.log", *argv)
    try:
        wait_until(lambda: len(_children(supervisor)) == 2, timeout=30, what="both worker processes to start")
        supervisor.terminate()
        assert supervisor.wait(45) == 1, supervisor.output()[-3000:]
        overdue = r"worker process \d \(pid \d+\) did not stop within 16 s: killing it"
        killed = re.findall(overdue, supervisor.output())
        assert len(killed) == 2, supervisor.output()[-3000:]
        assert all(process_gone(pid) for pid in _children(supervisor).values())
    finally:
        supervisor.close()
