"""Ordered task types with real workers: each key's effects land in enqueue order, through retries."""

from __future__ import annotations

from taskq.producer.producer import TaskSpec
from tests.acceptance.conftest import App
from tests.acceptance.helpers import all_committed, wait_until


def test_fifty_keys_of_twenty_tasks_take_effect_in_order_through_two_workers(app: App) -> None:
    accounts = [f"acct-{i}" for i in range(50)]
    # Enqueued interleaved, key by key per round, so every partition mixes many keys.
    specs = [
        TaskSpec(task_type=app.type("Ordered"), payload={"account": a, "seq": seq}, key=a)
        for seq in range(20)
        for a in accounts
    ]
    for start in range(0, len(specs), 500):
        app.producer.enqueue_many(specs[start : start + 500])
    app.producer.flush(60)
    for _ in range(2):
        app.spawn("--concurrency", "8")
    wait_until(
        lambda: app.scalar("SELECT count(*) FROM ordered_log") == 1000 and all_committed(app.settings),
        timeout=180,
        what=f"1,000 ordered effects\n{app.logs()}",
    )
    rows = app.query("SELECT account, seq, worker FROM ordered_log ORDER BY n")
    by_account: dict[str, list[int]] = {}
    for row in rows:
        by_account.setdefault(row["account"], []).append(row["seq"])
    out_of_order = {a: seqs for a, seqs in by_account.items() if seqs != list(range(20))}
    assert not out_of_order, f"{len(out_of_order)} keys out of order, e.g. {list(out_of_order.items())[:2]}"
    assert len({row["worker"] for row in rows}) == 2  # both workers took part
    retried = app.scalar("SELECT count(*) FROM taskq_tasks WHERE attempts > 1")
    assert retried == 150  # seq 3, 10 and 17 of every key failed once and ran again, in place
