"""`make demo` (`python -m taskq.demo`): the whole system in one run, narrated. Also the handlers the demo's
workers run, and the demo's task types, whose `.avsc` files ship in this package.

Registers the demo task types, creates a fresh namespace's topics, enqueues a mix across the four tiers
(duplicate payment keys, a flaky report, a webhook whose partner is down, a delayed email), runs two workers
and the delay forwarder as real processes, prints what happened, then fixes the partner and replays the
dead-lettered webhook.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from importlib import resources
from typing import Any

from taskq.consumer.handlers import Handlers, TaskContext
from taskq.consumer.retry import RetryPolicy

#: The demo's task types: demo.SendEmail, demo.ChargePayment, demo.GenerateReport, demo.CallWebhook.
SCHEMA_FILES = ("send_email", "charge_payment", "generate_report", "call_webhook")


def schema(name: str) -> dict[str, Any]:
    """The Avro schema of one demo task type, by file name (`send_email`), read from the package data."""
    text = resources.files(__name__).joinpath(f"{name}.avsc").read_text(encoding="utf-8")
    parsed: dict[str, Any] = json.loads(text)
    return parsed

FAST_RETRIES = RetryPolicy(max_attempts=3, base=timedelta(milliseconds=500), cap=timedelta(seconds=5))

handlers = Handlers()

DEMO_TABLES = """
CREATE TABLE IF NOT EXISTS demo_effects (
    seq bigserial PRIMARY KEY, task_type text NOT NULL, key text NOT NULL, priority text NOT NULL,
    attempt int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS demo_outages (url text PRIMARY KEY);
"""


def _effect(ctx: TaskContext, key: str) -> None:
    # In the task's own transaction: the effect and the completion record commit together (exactly once).
    ctx.db.execute(
        "INSERT INTO demo_effects (task_type, key, priority, attempt) VALUES (%s, %s, %s, %s)",
        (ctx.task_type, key, ctx.priority, ctx.attempt),
    )


@handlers.task("demo.SendEmail", schema=schema("send_email"), transactional=True, timeout=10)
def send_email(payload: dict[str, Any], ctx: TaskContext) -> None:
    _effect(ctx, payload["to"])


@handlers.task("demo.ChargePayment", schema=schema("charge_payment"), transactional=True, timeout=10)
def charge_payment(payload: dict[str, Any], ctx: TaskContext) -> None:
    _effect(ctx, payload["payment_id"])


@handlers.task(
    "demo.GenerateReport",
    schema=schema("generate_report"),
    transactional=True,
    timeout=10,
    retry=FAST_RETRIES,
)
def generate_report(payload: dict[str, Any], ctx: TaskContext) -> None:
    if ctx.attempt <= payload["fail_times"]:
        raise TimeoutError(f"report database busy (attempt {ctx.attempt})")
    _effect(ctx, payload["report_id"])


@handlers.task(
    "demo.CallWebhook",
    schema=schema("call_webhook"),
    transactional=True,
    timeout=10,
    retry=FAST_RETRIES,
)
def call_webhook(payload: dict[str, Any], ctx: TaskContext) -> None:
    down = ctx.db.execute("SELECT 1 FROM demo_outages WHERE url = %s", (payload["url"],)).fetchone()
    if down:
        raise ConnectionError(f"{payload['url']} answered 503 Service Unavailable")
    _effect(ctx, payload["url"])


# ------------------------------------------------------------------------------------------------ the run
def _say(text: str = "") -> None:
    print(text, flush=True)


def _wait(check: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"demo: gave up waiting for {what} after {timeout:.0f}s")
        time.sleep(0.25)


def main() -> int:
    """Run the demo against the stack named by TASKQ_* variables."""
    from taskq._core.db import Database
    from taskq._core.settings import Settings
    from taskq.consumer.dlq import DeadLetters
    from taskq.consumer.store import IdempotencyStore
    from taskq.producer.admin import create_topics
    from taskq.producer.producer import TaskProducer, TaskSpec
    from taskq.schemas import Registry

    ns = f"demo{int(time.time())}"
    settings = Settings.from_env(namespace=ns, database_schema=ns)
    db = Database(settings.database_url, schema=ns)
    _say(f"== kafka-taskq demo, namespace {ns}")
    with Registry.from_settings(settings) as registry:
        for name in SCHEMA_FILES:
            reg = registry.register(schema(name))
            _say(f"   task type {reg.subject:<22} schema v{reg.version} (registry id {reg.schema_id})")
    created = create_topics(settings, partitions=3)
    tiers = len(settings.delay_tiers)
    _say(f"   {len(created)} topics: {ns}.critical|high|normal|low, {tiers} delay tiers, {ns}.dlq")
    db.migrate(namespace=ns)
    with db.connection() as conn:
        conn.execute(DEMO_TABLES)
        conn.execute("INSERT INTO demo_outages VALUES ('https://partner.example/hook')")

    tasks = [
        TaskSpec(
            task_type="demo.ChargePayment",
            payload={"payment_id": f"pay-{i}", "amount_cents": 1000 + i},
            idempotency_key=f"charge:pay-{i}",
            priority="critical",
        )
        for i in range(10)
    ]
    tasks += tasks  # every payment enqueued twice, as a retrying client would: one charge each
    tasks += [
        TaskSpec(
            task_type="demo.CallWebhook",
            payload={"url": "https://partner.example/hook", "event": "order.paid"},
            priority="high",
        )
    ]
    tasks += [
        TaskSpec(
            task_type="demo.SendEmail",
            payload={"to": f"user{i}@example.com", "subject": "Receipt"},
            priority="normal",
        )
        for i in range(30)
    ]
    tasks += [
        TaskSpec(
            task_type="demo.GenerateReport",
            payload={"report_id": f"r-{i}", "fail_times": 2 if i == 0 else 0},
            priority="low",
        )
        for i in range(8)
    ]
    with TaskProducer(settings) as producer:
        producer.enqueue_many(tasks)
        delayed = producer.enqueue(
            "demo.SendEmail", {"to": "later@example.com", "subject": "Reminder"}, delay=3.0
        )
        producer.flush()
    _say(f"== enqueued {len(tasks) + 1} tasks: 20 charges (10 payments, each twice), 1 webhook to a partner")
    _say("   that is down, 30 emails, 8 reports (one fails twice before it works), 1 email delayed by 3 s")

    env = {**os.environ, "TASKQ_NAMESPACE": ns, "TASKQ_DATABASE_SCHEMA": ns}
    cmd = [sys.executable, "-m", "taskq.cli"]
    procs = [
        subprocess.Popen(
            [*cmd, "worker", "taskq.demo:handlers", "--concurrency", "4", "--no-forwarder"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(2)
    ]
    procs.append(
        subprocess.Popen([*cmd, "forwarder"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    )
    _say("== started 2 workers (concurrency 4 each) and the delay forwarder")
    store = IdempotencyStore(db, owner="demo", namespace=ns)
    try:

        def counts() -> dict[str, int]:
            return store.counts()

        _wait(
            lambda: counts().get("completed", 0) >= 10 + 30 + 8 + 1 and counts().get("dead", 0) >= 1,
            "the tasks to finish",
        )
        with db.connection() as conn:
            per_tier = conn.execute(
                "SELECT priority, count(*) AS n FROM demo_effects GROUP BY priority ORDER BY min(seq)"
            ).fetchall()
            charged = conn.execute(
                "SELECT count(*) AS n FROM demo_effects WHERE task_type = 'demo.ChargePayment'"
            ).fetchall()[0]["n"]
            retried = conn.execute("SELECT key, attempt FROM demo_effects WHERE attempt > 1").fetchall()
            ran_at = conn.execute("SELECT at FROM demo_effects WHERE key = 'later@example.com'").fetchall()[
                0
            ]["at"]
        _say("== what happened")
        for row in per_tier:
            _say(f"   {row['priority']:<9} {row['n']:>3} task(s) completed")
        _say(f"   charges: 20 enqueued, {charged} charged: duplicates skipped by their idempotency key")
        for row in retried:
            _say(f"   retried: {row['key']} succeeded on attempt {row['attempt']} (backoff via delay tiers)")
        if delayed.not_before is not None:
            waited = (ran_at - (delayed.not_before - timedelta(seconds=3))).total_seconds()
            _say(f"   delayed: the reminder (task {delayed.task_id[:8]}) ran {waited:.1f} s after enqueue")
        with DeadLetters(settings) as dlq:
            records = dlq.list()
            _say(f"== the DLQ holds {len(records)} record(s)")
            for rec in records:
                _say(f"   offset {rec.offset}: {rec.task_type}, {rec.attempts} attempts: {rec.reason[:80]}")
            _say("== the partner is back up; replaying the DLQ")
            with db.connection() as conn:
                conn.execute("DELETE FROM demo_outages")
            for res in dlq.replay(all=True):
                what = f"replayed to {res.topic}" if res.replayed else f"refused: {res.refused}"
                _say(f"   offset {res.offset}: {what}, same task id {str(res.task_id)[:8]}, same key")
            _wait(lambda: counts().get("dead", 0) == 0, "the replayed webhook")
            _say("   the webhook ran once after the replay")
            for res in dlq.replay(offsets=[records[0].offset]) if records else []:
                what = f"refused: {res.refused}" if res.refused else "replayed"
                _say(f"   replaying offset {res.offset} again: {what}")
        _say(f"== done: {counts()}")
    finally:
        store.close()
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(40)
            except subprocess.TimeoutExpired:
                p.kill()
    _say("== workers stopped gracefully (SIGTERM: finish in-flight tasks, commit, leave the group)")
    return 0

