"""Scaling out (invariant 8): workers that join, leave or die mid-run never stall a tier, and every member of
the group runs a fair share of the busy tier.

Each round loads one tier (`normal`, 6 partitions) with Ledger tasks, changes the group's membership while
they run, and checks that every task took effect exactly once, every offset was committed, and that every
member ran at least a fifth of what completed in a stretch that starts when the tier is split evenly over
the members and ends while all of them still have work (a stretch that ran until the queue drained would
judge how the backlog happened to be spread over partitions, not the assignment).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable

import pytest

from taskq.producer.producer import TaskSpec
from tests.acceptance.conftest import App
from tests.acceptance.helpers import WorkerProcess, all_committed, wait_until

#: Only a stall breaks this: the slowest round (a kill -9) needs the session timeout plus one lease.
STALL = 90.0
#: Each member's least share of the tasks completed while it belonged to the group.
FAIR = 1 / 5
#: The cases, repeated: rebalances are timing-dependent, so one lucky round proves little.
ROUNDS = [
    *(("together", r) for r in range(3)),
    *(("join", r) for r in range(3)),
    *(("join_and_leave", r) for r in range(2)),
    *(("kill_9", r) for r in range(2)),
    # Brokers older than Kafka 4.0 run the classic protocol, where range rebalances revoke everything.
    ("join_classic", 0),
]


class Round:
    """One round's load, its workers, and the ledger rows completed between membership changes."""

    def __init__(self, app: App, tasks: int, sleep: float, protocol: str = "consumer") -> None:
        self.app = app
        self.protocol = protocol
        self.keys = [f"r{i:05d}" for i in range(tasks)]
        specs = [
            TaskSpec(
                task_type=app.type("Ledger"),
                payload={"key": k, "amount": i, "sleep": sleep},
                idempotency_key=f"ledger:{k}",
                priority="normal",
            )
            for i, k in enumerate(self.keys)
        ]
        for start in range(0, len(specs), 500):
            app.producer.enqueue_many(specs[start : start + 500])
        app.producer.flush(60)

    def spawn(self) -> WorkerProcess:
        return self.app.spawn("--concurrency", "4", TASKQ_GROUP_PROTOCOL=self.protocol)

    def done(self) -> int:
        return int(self.app.scalar("SELECT count(*) FROM ledger"))

    def seq(self) -> int:
        return int(self.app.scalar("SELECT COALESCE(max(seq), 0) FROM ledger"))

    def wait(self, check: Callable[[], object], what: str) -> None:
        """wait_until, up to STALL, with the workers' logs in the failure."""
        try:
            wait_until(check, timeout=STALL, what=what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.app.logs()}") from None

    def wait_done(self, n: int, what: str) -> None:
        self.wait(lambda: self.done() >= n, f"{what} ({n} tasks done)")

    def wait_split(self, *members: WorkerProcess) -> int:
        """Wait until the busy tier's 6 partitions are split evenly over `members` (what each owns now, from
        their logs); return the ledger's seq then, where a stretch judged for fairness starts."""

        def split() -> bool:
            owned = [owned_busy_partitions(w) for w in members]
            return sorted(len(o) for o in owned) == [6 // len(members)] * len(members) and len(
                set().union(*owned)
            ) == 6

        self.wait(split, f"the busy tier to be split over {[w.log.name for w in members]}")
        return self.seq()

    def assert_fair(self, start: int, end: int, members: list[WorkerProcess], what: str) -> None:
        """Each member ran at least FAIR of the tasks completed with seq in (start, end]."""
        rows = self.app.query("SELECT worker FROM ledger WHERE seq > %s AND seq <= %s", start, end)
        by_worker = Counter(r["worker"] for r in rows)
        total = len(rows)
        assert total >= 50, f"{what}: only {total} tasks completed in the stretch; the round is too short"
        for w in members:
            share = by_worker[w.proc.pid] / total
            assert share >= FAIR, (
                f"{what}: {w.log.name} ran {by_worker[w.proc.pid]} of {total} tasks ({share:.0%}), "
                f"less than {FAIR:.0%}; by pid: {dict(by_worker)}\n{self.app.logs()}"
            )

    def assert_exactly_once(self) -> None:
        self.wait_done(len(self.keys), "every task")
        self.wait(lambda: all_committed(self.app.settings), "every offset committed")
        self.app.assert_once_each(self.keys)
        assert self.done() == len(self.keys)


def owned_busy_partitions(worker: WorkerProcess, tier: str = "normal") -> set[int]:
    """The partitions of a tier (the busy one unless told) a worker owns now, replaying its assignment and
    revocation logs."""
    owned: set[int] = set()
    for line in worker.output().splitlines():
        match = re.search(r" (assigned|revoked) (.*)", line)
        if match:
            parts = {int(p) for p in re.findall(rf"\.{tier}\[(\d+)\]", match[2])}
            owned = owned | parts if match[1] == "assigned" else owned - parts
    return owned


@pytest.mark.partitions(6)
@pytest.mark.parametrize(("case", "round_"), ROUNDS, ids=[f"{c}-{r}" for c, r in ROUNDS])
def test_membership_changes_never_stall_a_tier_and_share_it_fairly(app: App, case: str, round_: int) -> None:
    if case == "together":
        # Two workers started at once: each gets half of the busy tier. Judged over the whole run: the
        # first to join runs its half while the second is still being assigned the other.
        r = Round(app, tasks=600, sleep=0.05)
        a, b = r.spawn(), r.spawn()
        r.wait_split(a, b)
        r.assert_exactly_once()
        r.assert_fair(0, r.seq(), [a, b], "two workers started together")
    elif case in ("join", "join_classic"):
        # A second worker joins while the first is busy: the first keeps running what it keeps.
        r = Round(app, tasks=1200, sleep=0.05, protocol="classic" if case == "join_classic" else "consumer")
        a = r.spawn()
        r.wait_done(60, "the first worker to be busy")
        b = r.spawn()
        start = r.wait_split(a, b)
        # Started one after the other, each holds half of every tier's partitions, not only the busy one's.
        for tier in ("critical", "high", "low"):
            r.wait(
                lambda t=tier: [len(owned_busy_partitions(w, t)) for w in (a, b)] == [3, 3],
                f"the {tier} tier to be split over both workers",
            )
        r.wait_done(r.done() + 300, "two workers to share the tier")
        r.assert_fair(start, r.seq(), [a, b], "after a second worker joined")
        r.assert_exactly_once()
    elif case == "join_and_leave":
        # A third worker joins mid-run, then one of the first two leaves (SIGTERM) mid-run.
        r = Round(app, tasks=2400, sleep=0.05)
        a, b = r.spawn(), r.spawn()
        r.wait_split(a, b)
        r.wait_done(100, "two workers to be busy")
        c = r.spawn()
        start = r.wait_split(a, b, c)
        r.wait_done(r.done() + 250, "three workers to share the tier")
        end = r.seq()
        a.terminate()
        assert a.wait(60) == 0, a.output()[-3000:]
        r.assert_fair(start, end, [a, b, c], "with three workers")
        start = r.wait_split(b, c)
        r.wait_done(r.done() + 250, "two workers to share the tier again")
        r.assert_fair(start, r.seq(), [b, c], "after one of three left")
        r.assert_exactly_once()
    else:
        # kill -9 of one of two workers: the survivor takes its partitions over after the session timeout.
        r = Round(app, tasks=800, sleep=0.05)
        a, b = r.spawn(), r.spawn()
        start = r.wait_split(a, b)
        r.wait_done(r.done() + 200, "two workers to share the tier")
        end = r.seq()
        a.kill()
        r.assert_fair(start, end, [a, b], "before the kill")
        r.assert_exactly_once()
        assert b.proc.poll() is None, b.output()[-3000:]


@pytest.mark.partitions(6)
def test_a_worker_stopped_while_a_rebalance_is_in_flight_commits_what_it_finished(app: App) -> None:
    # SIGTERM reaches the first worker just as a second one joins: it finishes what it runs while the group
    # rebalances around it, and must still answer the rebalance and commit what it finished before it leaves
    # (tests/unit/test_worker_on_fakes.py pins down the hand-over itself).
    r = Round(app, tasks=1500, sleep=0.05)
    a = r.spawn()
    r.wait_done(100, "the first worker to be busy")
    b = r.spawn()
    r.wait(lambda: "handler(s), group" in b.output(), "the second worker to start joining")
    a.terminate()
    assert a.wait(60) == 0, a.output()[-3000:]
    assert "commit failed" not in a.output(), a.output()[-3000:]
    r.assert_exactly_once()
