"""Workflows with workers as processes on the real stack: each next step exactly once (issue 23)."""

from __future__ import annotations

import os
import re
import signal
import urllib.request

from taskq import TaskSpec, chain, group
from taskq._core.envelope import WORKFLOW_HEADER
from tests.acceptance.conftest import App
from tests.acceptance.helpers import WorkerProcess, console_process, tier_records, wait_until


def _children(supervisor: WorkerProcess) -> dict[int, int]:
    started = re.findall(r"worker process (\d+) started: pid (\d+)", supervisor.output())
    return {int(n): int(pid) for n, pid in started}


def _kill_and_wait_restart(app: App, supervisor: WorkerProcess, done: int) -> None:
    """kill -9 worker process 1 once `done` members took effect, and wait for the supervisor's restart."""
    wait_until(lambda: app.scalar("SELECT count(*) FROM ledger") >= done, timeout=60, what=f"{done} members")
    victim = _children(supervisor)[1]
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: _children(supervisor)[1] != victim, timeout=30, what="worker process 1 to restart")


def test_a_group_of_200_calls_back_once_with_every_member_while_a_worker_is_killed_twice(
    app: App,
) -> None:
    # Looped 5 times by hand when written; one run here keeps the suite short.
    members = [
        TaskSpec(task_type=app.type("Ledger"), payload={"key": f"m{i:03d}", "amount": i, "sleep": 0.1})
        for i in range(200)
    ]
    callback = TaskSpec(task_type=app.type("Collect"), payload={"key": "done"})
    receipt = app.producer.enqueue_workflow(group(*members, then=callback))
    supervisor = app.spawn("--processes", "3", "--concurrency", "2")
    _kill_and_wait_restart(app, supervisor, 40)
    _kill_and_wait_restart(app, supervisor, 100)
    wait_until(lambda: receipt.status().done, timeout=90, what="the workflow to end")

    collected = app.query("SELECT members, states FROM collected")
    assert collected == [{"members": 200, "states": {"completed": 200}}], supervisor.output()[-3000:]
    app.assert_once_each([f"m{i:03d}" for i in range(200)])
    status = receipt.status()
    assert (status.state, status.counts) == ("completed", {"completed": 201})
    # Staged once: the callback's record is in the tiers once, whatever the kills redelivered.
    callback = f"{receipt.workflow_id}:201".encode()
    staged = [r for r in tier_records(app.settings) if dict(r.headers).get(WORKFLOW_HEADER) == callback]
    assert len(staged) == 1
    assert len(re.findall(r"killed by SIGKILL; restarting it", supervisor.output())) == 2


def test_a_chain_whose_middle_step_fails_twice_runs_its_last_step_once_with_the_middle_result(
    app: App,
) -> None:
    steps = [
        TaskSpec(task_type=app.type("Step"), payload={"key": "s1"}),
        TaskSpec(task_type=app.type("Step"), payload={"key": "s2", "fail_times": 2}),
        TaskSpec(task_type=app.type("Step"), payload={"key": "s3"}),
    ]
    receipt = app.producer.enqueue_workflow(chain(*steps))
    app.spawn("--concurrency", "2")
    wait_until(lambda: receipt.status().done, timeout=40, what="the chain to end")

    assert receipt.status().state == "completed"
    runs = app.query("SELECT key, attempt FROM attempt_log ORDER BY key, attempt")
    assert [(r["key"], r["attempt"]) for r in runs] == [("s1", 1), ("s2", 1), ("s2", 2), ("s2", 3), ("s3", 1)]
    effects = app.query("SELECT key, attempt, parent FROM steps ORDER BY key")
    assert effects == [
        {"key": "s1", "attempt": 1, "parent": None},
        {"key": "s2", "attempt": 3, "parent": {"key": "s1", "attempt": 1}},
        {"key": "s3", "attempt": 1, "parent": {"key": "s2", "attempt": 3}},
    ]
    # The console shows the workflow's tree with each node's state.
    with console_process(app.env_of(), app.tmp_path / "console.log", probe="/") as url:
        with urllib.request.urlopen(f"{url}/workflows?id={receipt.workflow_id}", timeout=30) as r:
            page = r.read().decode()
    assert re.search(r'id="workflow-state">completed<', page), page
    assert page.count('class="badge completed"') == 5, page  # the chain, its three steps, the workflow
