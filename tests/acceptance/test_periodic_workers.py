"""A periodic task under three workers, one of them killed: one effect per slot, no slot missing."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from datetime import datetime, timedelta

from tests.acceptance.conftest import App
from tests.acceptance.helpers import all_committed, wait_until


def slots(app: App) -> dict[datetime, int]:
    """Each slot that ran (from its idempotency key, periodic:<name>:<slot time>) and how many times."""
    rows = app.query("SELECT slot, count(*) AS n FROM ticks GROUP BY slot")
    return {datetime.fromisoformat(r["slot"].split(":", 2)[2]): r["n"] for r in rows}


def test_each_slot_runs_once_while_workers_come_and_go(app: App) -> None:
    workers = [app.spawn("--concurrency", "2", TASKQ_TEST_PERIODIC="2s") for _ in range(3)]
    wait_until(lambda: len(slots(app)) >= 3, timeout=90, what=f"the first slots to run\n{app.logs()}")
    workers[0].kill()  # kill -9 mid-run: its schedule lock, staged rows and claims are left behind

    def spanned() -> bool:
        ran = sorted(slots(app))
        return ran[-1] - ran[0] >= timedelta(seconds=20)

    wait_until(spanned, timeout=120, what=f"20 s of slots\n{app.logs()}")
    for w in workers[1:]:
        w.terminate()
        assert w.wait(60) == 0
    # A worker that schedules nothing relays and runs whatever was staged or published before the stop.
    app.spawn("--concurrency", "2")
    wait_until(
        lambda: app.scalar("SELECT count(*) FROM taskq_outbox") == 0 and all_committed(app.settings),
        timeout=60,
        what=f"the last staged slots to run\n{app.logs()}",
    )
    ran = slots(app)
    assert all(n == 1 for n in ran.values()), {s: n for s, n in ran.items() if n != 1}
    times = sorted(ran)
    gaps = [b - a for a, b in itertools.pairwise(times) if b - a != timedelta(seconds=2)]
    assert not gaps, f"slots missing between {times[0]} and {times[-1]}: {gaps}"
    assert times[-1] - times[0] >= timedelta(seconds=20)
    listed = subprocess.run(
        [sys.executable, "-m", "taskq.cli", "periodic", "list", "--json"],
        env=app.env_of(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    [row] = json.loads(listed.stdout)
    assert (row["name"], row["schedule"]) == (app.type("Tick"), "2s")
    assert datetime.fromisoformat(row["last_slot"]) == times[-1]
    assert datetime.fromisoformat(row["next_slot"]) > times[-1]
