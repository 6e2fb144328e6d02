"""`taskq chaos` as users run it: a short run with workers killed passes its checks, and the checks find a
lost effect, a doubled one, a task never committed and a DLQ missing a task meant to fail.

Broker and Postgres restarts (`--restart-kafka-cmd`, `--restart-postgres-cmd`) are left out here: the stack
is shared with every other test of the session. They are run by hand against a private stack
(docs/explanation/failure-modes.md).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable

from taskq._core.db import Database
from taskq._core.envelope import Envelope, Topics
from taskq._core.kafka import Admin, Sink
from taskq._core.settings import Settings
from taskq.consumer.routing import dead_letter_record
from taskq.producer.producer import TaskProducer
from taskq.schemas import Registry
from taskq.tools.chaos import (
    CREATE_LEDGER,
    LEDGER_TABLE,
    SCHEMA,
    TASK_TYPE,
    ChaosReport,
    _check,
    _Task,
    check_ledger,
    uncommitted,
)
from tests.acceptance.helpers import tier_records, wait_until

TASKQ_CHAOS = (sys.executable, "-m", "taskq.cli", "chaos")


def _figure(report: str, label: str) -> int:
    found = re.search(rf"^  {label}\s+(\d+)", report, re.MULTILINE)
    assert found, f"no {label!r} line in the report:\n{report}"
    return int(found[1])


def test_chaos_run_with_workers_killed_loses_and_doubles_nothing(
    settings: Settings, env_of: Callable[..., dict[str, str]]
) -> None:
    out = subprocess.run(
        # Seed 31 plans one poison pill (task 58) at the default 3 per thousand.
        [*TASKQ_CHAOS, "--duration", "20", "--workers", "2", "--kill-every", "4", "--seed", "31"],
        env=env_of(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    report = out.stdout
    assert out.returncode == 0, f"exit {out.returncode}\n{report}\n{out.stderr[-5000:]}"
    assert _figure(report, "lost") == 0, report
    assert _figure(report, "duplicated") == 0, report
    assert _figure(report, "unexpected effects") == 0, report
    assert _figure(report, "uncommitted") == 0, report
    assert _figure(report, "kills") >= 1, report  # a kill every ~4 s over 20 s
    assert _figure(report, "enqueued") > 0, report
    assert re.search(r"DLQ\s+\d+ records .*: (\d+) of \1 meant to fail, 0 missing, 0 others", report), report
    assert re.search(r"poison pills\s+1: 1 dead-lettered for their workers' deaths, 0 other", report), report
    assert report.rstrip().endswith("result: PASS")

    # The run's namespace is gone: topics and Postgres schema.
    ns = re.search(r"namespace (chaos-\d+)", report)
    assert ns, report
    # A deletion the controller accepted reaches the broker's metadata a moment later (longer on a busy
    # machine): wait for the metadata to drop the topics, as it must.
    topics = Topics(ns[1]).priority_topics
    wait_until(
        lambda: Admin(settings).partitions(topics) == {}, timeout=30, what=f"the topics of {ns[1]} gone"
    )
    db = Database(settings.database_url, schema=settings.database_schema)
    with db.connection() as conn:
        left = conn.execute(
            "SELECT count(*) AS n FROM pg_namespace WHERE nspname = %s", (ns[1].replace("-", "_"),)
        ).fetchone()
    assert left is not None and left["n"] == 0


def test_checks_report_lost_doubled_and_unexpected_effects_an_uncommitted_task_and_a_dlq_gap(
    settings: Settings,
) -> None:
    db = Database(settings.database_url, schema=settings.database_schema)
    tasks = {t.key: t for t in (_Task(1, "ok", None), _Task(2, "retry", None), _Task(3, "delayed", 2.0))}
    tasks["chaos:4"] = _Task(4, "fail", None)
    with db.connection() as conn:
        conn.execute(CREATE_LEDGER)
        for key in ("chaos:1", "chaos:2", "chaos:3"):
            conn.execute(f"INSERT INTO {LEDGER_TABLE} (key, attempt) VALUES (%s, 1)", (key,))
    effects = ["chaos:1", "chaos:2", "chaos:3"]
    assert check_ledger(db, effects).ok

    # Tampered with: chaos:2's effect lost, chaos:3's doubled, one of a key nobody enqueued.
    with db.connection() as conn:
        conn.execute(f"DELETE FROM {LEDGER_TABLE} WHERE key = 'chaos:2'")
        conn.execute(f"INSERT INTO {LEDGER_TABLE} (key, attempt) VALUES ('chaos:3', 2), ('chaos:99', 1)")
    check = check_ledger(db, effects)
    assert (check.lost, check.duplicated, check.unexpected) == (["chaos:2"], {"chaos:3": 2}, ["chaos:99"])
    assert not check.ok

    # A task on a tier that no worker ran: the commit check finds it (a transaction marker would not count).
    assert uncommitted(settings) == {}
    with Registry.from_settings(settings) as registry:
        registry.register(SCHEMA)
    with TaskProducer(settings) as producer:
        receipt = producer.enqueue(TASK_TYPE, {"i": 5, "kind": "ok"}, idempotency_key="chaos:5", wait=True)
    lag = uncommitted(settings)
    assert lag == {(receipt.topic, receipt.partition): 1}

    # The run's report over the same table and the namespace's (empty) DLQ: chaos:4 never reached it.
    report = ChaosReport(settings.namespace, 0, 1, 1.0, 1.0, enqueued=4, drained=True)
    _check(report, settings, db, tasks, lag)
    assert report.uncommitted == 1
    assert (report.lost, report.duplicated, report.unexpected_effects) == (1, 1, 1)
    assert (report.meant_to_fail, report.dlq_missing, report.dlq_unexpected) == (1, 1, 0)
    assert not report.passed
    text = report.text()
    assert re.search(r"^  lost\s+1$", text, re.MULTILINE)
    assert re.search(r"^  duplicated\s+1$", text, re.MULTILINE)
    assert "e.g. missing from the DLQ: chaos:4" in text
    assert text.endswith("result: FAIL")

    # A healthy task dead-lettered for a worker's death, as a pill is: only pills may be (invariant 10).
    with TaskProducer(settings) as producer:
        producer.enqueue(TASK_TYPE, {"i": 1, "kind": "ok"}, idempotency_key="chaos:1", wait=True)
    (record,) = [r for r in tier_records(settings) if Envelope.of(r).idempotency_key == "chaos:1"]
    out = dead_letter_record(
        record,
        reason="gave up after 2 run(s) ended with their worker's death",
        error_type="taskq.PoisonPill",
        traceback="",
        attempts=1,
        worker_id="host:1:abc",
        topics=Topics(settings.namespace),
    )
    sink = Sink(settings)
    sink.send(out.topic, out.value, key=out.key, headers=out.headers)
    assert sink.flush(30) == 0
    blamed = ChaosReport(settings.namespace, 0, 1, 1.0, 1.0, enqueued=4, drained=True)
    _check(blamed, settings, db, tasks, {})
    assert (blamed.pills, blamed.blamed_for_deaths) == (0, 1) and not blamed.passed
    assert "dead-lettered for a worker's death, not a pill: chaos:1" in blamed.text()
