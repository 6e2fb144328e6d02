"""The outbox with real processes: workers relay by default, and a relay killed mid-batch loses nothing."""

from __future__ import annotations

import json
import subprocess
import sys

from taskq._core.envelope import Topics
from taskq._core.kafka import Admin
from taskq.producer.producer import TaskSpec
from tests.acceptance.conftest import App
from tests.acceptance.helpers import WorkerProcess, wait_until


def published(app: App) -> int:
    return sum(Admin(app.settings).end_offsets(Topics(app.ns).priority_topics).values())


def backlog(app: App) -> int:
    return int(app.scalar("SELECT count(*) FROM taskq_outbox WHERE namespace = %s", app.ns))


def test_a_worker_relays_what_a_committed_transaction_staged_and_nothing_of_a_rolled_back_one(
    app: App,
) -> None:
    worker = app.spawn("--concurrency", "4")  # relays by default
    with app.db.connect(autocommit=False) as conn:
        conn.execute("CREATE TABLE orders (id text PRIMARY KEY)")
        conn.commit()
        conn.execute("INSERT INTO orders VALUES ('o-1')")
        app.producer.enqueue(app.type("Ledger"), {"key": "rolled-back", "amount": 1}, conn=conn)
        conn.rollback()
        conn.execute("INSERT INTO orders VALUES ('o-2')")
        app.producer.enqueue(app.type("Ledger"), {"key": "committed", "amount": 2}, conn=conn)
        conn.commit()
    wait_until(
        lambda: app.scalar("SELECT count(*) FROM ledger WHERE key = 'committed'") == 1,
        timeout=60,
        what=f"the committed task's effect\n{app.logs()}",
    )
    assert backlog(app) == 0
    assert published(app) == 1  # the rolled-back task never reached Kafka, so it can never run
    assert app.scalar("SELECT count(*) FROM ledger") == 1
    worker.terminate()
    assert worker.wait(60) == 0


def test_a_relay_killed_while_publishing_loses_and_doubles_nothing(app: App) -> None:
    keys = [f"k{i}" for i in range(1000)]
    with app.db.connect(autocommit=False) as conn:
        for start in range(0, len(keys), 250):
            app.producer.enqueue_many(
                [
                    TaskSpec(
                        task_type=app.type("Ledger"),
                        payload={"key": k, "amount": 1},
                        idempotency_key=f"l:{k}",
                    )
                    for k in keys[start : start + 250]
                ],
                conn=conn,
            )
        conn.commit()
    # Small batches, so the relay is killed between publishing a batch and deleting it, or in the middle.
    relay = WorkerProcess.command(app.env_of(), app.tmp_path / "relay-1.log", "relay", "--batch", "10")
    app.workers.append(relay)
    # Watched in Postgres, every 5 ms: the relay publishes 1,000 records in a fraction of a second on a quiet
    # machine, faster than reading the topics' end offsets (a new admin client each time) can see it.
    wait_until(
        lambda: backlog(app) <= 900, timeout=60, every=0.005, what=f"the relay to publish\n{relay.output()}"
    )
    relay.kill()
    left = backlog(app)
    assert 0 < left < 1000, f"the relay was killed after it had published everything ({left} left)"
    stats = subprocess.run(
        [sys.executable, "-m", "taskq.cli", "stats", "--json"],
        env=app.env_of(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(stats.stdout)["outbox"]["waiting"] == left
    again = WorkerProcess.command(app.env_of(), app.tmp_path / "relay-2.log", "relay")
    app.workers.append(again)
    app.spawn("--concurrency", "8", "--no-relay")
    wait_until(
        lambda: app.scalar("SELECT count(DISTINCT key) FROM ledger") == 1000,
        timeout=120,
        what=f"every staged task's effect\n{app.logs()}",
    )
    assert backlog(app) == 0
    assert published(app) >= 1000  # a batch published twice is possible, and harmless
    app.assert_once_each(keys)
