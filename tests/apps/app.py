"""Handlers run by worker processes in the acceptance tests; task types live in the test's namespace."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import psycopg.types.json

from taskq import Handlers, Reject, Retry, RetryPolicy, TaskContext

NS = os.environ.get("TASKQ_NAMESPACE", "taskq")
handlers = Handlers()


def schemas(ns: str) -> dict[str, dict[str, Any]]:
    """The app's record schemas in a namespace, by record name."""
    sleep = [{"name": "seconds", "type": "double"}, {"name": "pid_file", "type": "string", "default": ""}]
    fields: dict[str, list[dict[str, Any]]] = {
        "Ledger": [
            {"name": "key", "type": "string"},
            {"name": "amount", "type": "long"},
            {"name": "sleep", "type": "double", "default": 0.0},
        ],
        "Sleep": sleep,
        "SleepProc": sleep,
        "Exit": [{"name": "code", "type": "int"}],
        "Die": [{"name": "code", "type": "int"}],
        "Mixed": [
            {"name": "key", "type": "string"},
            {"name": "fail_times", "type": "int", "default": 0},
            {"name": "exit_code", "type": "int", "default": 0},
        ],
        "Plain": [{"name": "key", "type": "string"}, {"name": "sleep", "type": "double", "default": 0.0}],
        "Fragile": [{"name": "key", "type": "string"}],
        "RejectProc": [{"name": "code", "type": "int"}],
        "Flaky": [{"name": "key", "type": "string"}, {"name": "fail_times", "type": "int", "default": 0}],
        "Tick": [{"name": "note", "type": "string", "default": ""}],
        "Ordered": [{"name": "account", "type": "string"}, {"name": "seq", "type": "long"}],
        "Hold": [{"name": "key", "type": "string"}, {"name": "seconds", "type": "double"}],
        "Noted": [{"name": "key", "type": "string"}, {"name": "fail_times", "type": "int", "default": 0}],
        "NotedProc": [{"name": "key", "type": "string"}],
        "Capped": [
            {"name": "partner", "type": "string"},
            {"name": "seq", "type": "long"},
            {"name": "seconds", "type": "double", "default": 0.0},
        ],
        "Answer": [
            {"name": "key", "type": "string"},
            {"name": "reject", "type": "boolean", "default": False},
            {"name": "pad", "type": "int", "default": 0},
        ],
        "Patient": [{"name": "key", "type": "string"}],
        "Collect": [{"name": "key", "type": "string"}],
        "Step": [{"name": "key", "type": "string"}, {"name": "fail_times", "type": "int", "default": 0}],
        "Paced": [
            {"name": "partner", "type": "string"},
            {"name": "seq", "type": "long"},
            {"name": "pause", "type": "double", "default": 0.0},
        ],
    }
    return {
        name: {"type": "record", "name": name, "namespace": ns, "fields": f} for name, f in fields.items()
    }


S = schemas(NS)

CREATE_LEDGER = """
CREATE TABLE IF NOT EXISTS ledger (
    seq bigserial PRIMARY KEY, key text NOT NULL, amount bigint NOT NULL, task_id text NOT NULL,
    priority text NOT NULL, worker int NOT NULL
);
CREATE TABLE IF NOT EXISTS broken (key text PRIMARY KEY);
CREATE TABLE IF NOT EXISTS ticks (slot text NOT NULL, worker int NOT NULL);
CREATE TABLE IF NOT EXISTS ordered_log (
    n bigserial PRIMARY KEY, account text NOT NULL, seq bigint NOT NULL, worker int NOT NULL
);
CREATE TABLE IF NOT EXISTS attempt_log (
    key text NOT NULL, attempt int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS limit_runs (
    id bigserial PRIMARY KEY, task_type text NOT NULL, partner text NOT NULL, seq bigint NOT NULL,
    attempt int NOT NULL, worker int NOT NULL, started_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended_at timestamptz
);
CREATE TABLE IF NOT EXISTS collected (
    key text NOT NULL, members int NOT NULL, states jsonb NOT NULL, worker int NOT NULL
);
CREATE TABLE IF NOT EXISTS steps (key text NOT NULL, attempt int NOT NULL, parent jsonb);
CREATE TABLE IF NOT EXISTS limit_pauses (
    partner text PRIMARY KEY, at timestamptz NOT NULL DEFAULT clock_timestamp()
)"""  # no unique constraint on key: a duplicate effect must be visible, not refused


@handlers.task(f"{NS}.Ledger", schema=S["Ledger"], transactional=True, timeout=4)
def ledger(payload: dict[str, Any], ctx: TaskContext) -> None:
    if payload["sleep"]:
        # Sent at once (the group's statements are pipelined): pg_stat_activity shows a ledger task in flight.
        ctx.db.execute("SELECT 'ledger task in flight'")
        time.sleep(payload["sleep"])
    ctx.db.execute(
        "INSERT INTO ledger (key, amount, task_id, priority, worker) VALUES (%s, %s, %s, %s, %s)",
        (payload["key"], payload["amount"], ctx.task_id, ctx.priority, os.getpid()),
    )


@handlers.task(f"{NS}.Sleep", schema=S["Sleep"], timeout=1, max_attempts=1)
def sleep_in_thread(payload: dict[str, Any], ctx: TaskContext) -> None:
    time.sleep(payload["seconds"])


@handlers.task(f"{NS}.SleepProc", schema=S["SleepProc"], timeout=1, max_attempts=1, isolation="process")
def sleep_in_process(payload: dict[str, Any], ctx: TaskContext) -> None:
    if payload["pid_file"]:
        Path(payload["pid_file"]).write_text(str(os.getpid()))
    time.sleep(payload["seconds"])


@handlers.task(f"{NS}.Exit", schema=S["Exit"], max_attempts=1, isolation="process")
def exit_process(payload: dict[str, Any], ctx: TaskContext) -> None:
    os._exit(payload["code"])


@handlers.task(f"{NS}.Flaky", schema=S["Flaky"], transactional=True, timeout=10, max_attempts=5)
def flaky(payload: dict[str, Any], ctx: TaskContext) -> None:
    # The attempt log is written outside the task's transaction, so failed attempts leave a trace.
    with psycopg.connect(
        os.environ["TASKQ_DATABASE_URL"],
        autocommit=True,
        options=f"-c search_path={os.environ.get('TASKQ_DATABASE_SCHEMA', 'public')}",
    ) as log:
        log.execute("INSERT INTO attempt_log (key, attempt) VALUES (%s, %s)", (payload["key"], ctx.attempt))
    if ctx.attempt <= payload["fail_times"]:
        raise RuntimeError(f"flaky failure on attempt {ctx.attempt}")
    ctx.db.execute(
        "INSERT INTO ledger (key, amount, task_id, priority, worker) VALUES (%s, 0, %s, %s, %s)",
        (payload["key"], ctx.task_id, ctx.priority, os.getpid()),
    )


@handlers.task(
    f"{NS}.Noted", schema=S["Noted"], retry=RetryPolicy(max_attempts=3, base=timedelta(seconds=0.1))
)
def noted(payload: dict[str, Any], ctx: TaskContext) -> None:
    ctx.log.info("noted %s", payload["key"], extra={"step": "note"})
    if ctx.attempt <= payload["fail_times"]:
        raise RuntimeError(f"noted failure on attempt {ctx.attempt}")


@handlers.task(f"{NS}.NotedProc", schema=S["NotedProc"], isolation="process")
def noted_in_process(payload: dict[str, Any], ctx: TaskContext) -> None:
    ctx.log.info("noted %s in a process", payload["key"], extra={"step": "note"})


@handlers.task(f"{NS}.Hold", schema=S["Hold"], transactional=True, max_attempts=1)
def hold(payload: dict[str, Any], ctx: TaskContext) -> None:
    # No timeout: its key is leased for the worker's default lease (300 s), however long that is.
    time.sleep(payload["seconds"])
    ctx.db.execute(
        "INSERT INTO ledger (key, amount, task_id, priority, worker) VALUES (%s, 0, %s, %s, %s)",
        (payload["key"], ctx.task_id, ctx.priority, os.getpid()),
    )


@handlers.task(f"{NS}.Die", schema=S["Die"], timeout=1, max_attempts=2)
def die_in_worker(payload: dict[str, Any], ctx: TaskContext) -> None:
    os._exit(payload["code"])  # takes the whole worker down: a poison pill unless attempts are counted first


@handlers.task(
    f"{NS}.Mixed", schema=S["Mixed"], transactional=True, timeout=10, max_attempts=3,
    retry=RetryPolicy(max_attempts=3, base=timedelta(seconds=0.2)),
)
def mixed(payload: dict[str, Any], ctx: TaskContext) -> None:
    # One transactional task type for healthy, flaky, failing and killing tasks, so they share group commits.
    if payload["exit_code"]:
        os._exit(payload["exit_code"])  # a poison pill: takes the whole worker process down
    with _log() as log:  # outside the task's transaction: failed attempts leave a trace too
        log.execute("INSERT INTO attempt_log (key, attempt) VALUES (%s, %s)", (payload["key"], ctx.attempt))
    if ctx.attempt <= payload["fail_times"]:
        raise RuntimeError(f"{payload['key']}: failure on attempt {ctx.attempt}")
    ctx.db.execute(
        "INSERT INTO ledger (key, amount, task_id, priority, worker) VALUES (%s, 0, %s, %s, %s)",
        (payload["key"], ctx.task_id, ctx.priority, os.getpid()),
    )


_plain_log = threading.local()


@handlers.task(f"{NS}.Plain", schema=S["Plain"], timeout=10)
def plain(payload: dict[str, Any], ctx: TaskContext) -> None:
    # Not transactional: the ledger row is written on a connection of the slot's own, after the work.
    if payload["sleep"]:
        time.sleep(payload["sleep"])
    if getattr(_plain_log, "conn", None) is None:
        _plain_log.conn = _log()
    _plain_log.conn.execute(
        "INSERT INTO ledger (key, amount, task_id, priority, worker) VALUES (%s, 0, %s, %s, %s)",
        (payload["key"], ctx.task_id, ctx.priority, os.getpid()),
    )


@handlers.task(f"{NS}.Fragile", schema=S["Fragile"], transactional=True, timeout=10, max_attempts=5)
def fragile(payload: dict[str, Any], ctx: TaskContext) -> None:
    # Fails while its key is marked broken: the "bug" an operator fixes before replaying from the DLQ.
    if ctx.db.execute("SELECT 1 FROM broken WHERE key = %s", (payload["key"],)).fetchone():
        raise ConnectionError(f"partner for {payload['key']} is down")
    ctx.db.execute(
        "INSERT INTO ledger (key, amount, task_id, priority, worker) VALUES (%s, 0, %s, %s, %s)",
        (payload["key"], ctx.task_id, ctx.priority, os.getpid()),
    )


@handlers.task(f"{NS}.RejectProc", schema=S["RejectProc"], max_attempts=5, isolation="process")
def reject_in_process(payload: dict[str, Any], ctx: TaskContext) -> None:
    raise Reject(f"code {payload['code']} can never be processed")


@handlers.task(f"{NS}.Answer", schema=S["Answer"], max_attempts=2)
def answer(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    # Its return value is the task's result; `pad` characters make one too large to store.
    if payload["reject"]:
        raise Reject(f"{payload['key']} can never be answered")
    return {"echo": payload["key"], "attempt": ctx.attempt, "pad": "x" * payload["pad"]}


@handlers.task(f"{NS}.Patient", schema=S["Patient"], timeout=60, max_attempts=1)
def patient(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    # Works until it is cancelled (cooperatively), then says what it saw.
    deadline = time.monotonic() + 50
    while not ctx.cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"cancelled": ctx.cancelled}


@handlers.task(f"{NS}.Collect", schema=S["Collect"], transactional=True, timeout=30)
def collect(payload: dict[str, Any], ctx: TaskContext) -> int:
    # A group's callback: what it saw of the members, recorded with its completion.
    results = ctx.group_results or []
    states: dict[str, int] = {}
    for member in results:
        states[member["state"]] = states.get(member["state"], 0) + 1
    ctx.db.execute(
        "INSERT INTO collected (key, members, states, worker) VALUES (%s, %s, %s, %s)",
        (payload["key"], len(results), psycopg.types.json.Jsonb(states), os.getpid()),
    )
    return len(results)


@handlers.task(
    f"{NS}.Step", schema=S["Step"], transactional=True, timeout=10,
    retry=RetryPolicy(max_attempts=5, base=timedelta(seconds=0.2)),
)
def step(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    # A chain's step: every attempt logged outside its transaction; fails its first `fail_times` attempts.
    with _log() as log:
        log.execute("INSERT INTO attempt_log (key, attempt) VALUES (%s, %s)", (payload["key"], ctx.attempt))
    if ctx.attempt <= payload["fail_times"]:
        raise RuntimeError(f"{payload['key']}: failure on attempt {ctx.attempt}")
    ctx.db.execute(
        "INSERT INTO steps (key, attempt, parent) VALUES (%s, %s, %s)",
        (payload["key"], ctx.attempt, psycopg.types.json.Jsonb(ctx.parent_result)),
    )
    return {"key": payload["key"], "attempt": ctx.attempt}


@handlers.task(f"{NS}.Tick", schema=S["Tick"], transactional=True)
def tick(payload: dict[str, Any], ctx: TaskContext) -> None:
    ctx.db.execute("INSERT INTO ticks (slot, worker) VALUES (%s, %s)", (ctx.idempotency_key, os.getpid()))


# Only the periodic test's workers schedule it (TASKQ_TEST_PERIODIC=<interval>).
if os.environ.get("TASKQ_TEST_PERIODIC"):
    handlers.periodic(every=os.environ["TASKQ_TEST_PERIODIC"], payload={"note": "tick"})(tick)


@handlers.task(f"{NS}.Ordered", schema=S["Ordered"], transactional=True, ordered=True)
def ordered(payload: dict[str, Any], ctx: TaskContext) -> None:
    if payload["seq"] % 7 == 3 and ctx.attempt == 1:  # an injected failure: retried in place
        raise RuntimeError(f"{payload['account']}#{payload['seq']}: first attempt fails")
    ctx.db.execute(
        "INSERT INTO ordered_log (account, seq, worker) VALUES (%s, %s, %s)",
        (payload["account"], payload["seq"], os.getpid()),
    )


def _log() -> psycopg.Connection[Any]:
    """A connection of the handler's own, outside any task transaction: every run leaves its trace."""
    return psycopg.connect(
        os.environ["TASKQ_DATABASE_URL"],
        autocommit=True,
        options=f"-c search_path={os.environ.get('TASKQ_DATABASE_SCHEMA', 'public')}",
    )


def _run_started(
    log: psycopg.Connection[Any], task_type: str, payload: dict[str, Any], ctx: TaskContext
) -> int:
    row = log.execute(
        "INSERT INTO limit_runs (task_type, partner, seq, attempt, worker) "
        "VALUES (%s, %s, %s, %s, %s) RETURNING id",
        (task_type, payload["partner"], payload["seq"], ctx.attempt, os.getpid()),
    ).fetchone()
    assert row is not None
    return int(row[0])


@handlers.task(
    f"{NS}.Capped",
    schema=S["Capped"],
    timeout=30,
    concurrency_limit=2,
    concurrency_key=lambda p: p["partner"],
)
def capped(payload: dict[str, Any], ctx: TaskContext) -> None:
    # Each run's start and end, on Postgres's clock: how many ran at once per partner is read from these.
    with _log() as log:
        run = _run_started(log, "Capped", payload, ctx)
        time.sleep(payload["seconds"])
        log.execute("UPDATE limit_runs SET ended_at = clock_timestamp() WHERE id = %s", (run,))


@handlers.task(
    f"{NS}.Paced",
    schema=S["Paced"],
    timeout=30,
    max_attempts=3,
    rate_limit=os.environ.get("TASKQ_TEST_RATE", "50/s"),
    rate_key=lambda p: p["partner"],
)
def paced(payload: dict[str, Any], ctx: TaskContext) -> None:
    with _log() as log:
        _run_started(log, "Paced", payload, ctx)
        if payload["pause"] and ctx.attempt == 1:
            # The partner's first run gets a 429 with Retry-After: `pause` seconds.
            told = log.execute(
                "INSERT INTO limit_pauses (partner) VALUES (%s) ON CONFLICT DO NOTHING RETURNING at",
                (payload["partner"],),
            ).fetchone()
            if told is not None:
                raise Retry(delay=payload["pause"], reason="429 Too Many Requests")


#: What a worker in share mode runs: the app's handlers but the ordered one (share groups keep no order,
#: and a share-mode worker refuses ordered task types).
share_handlers = Handlers()
share_handlers._specs = {spec.task_type: spec for spec in handlers if not spec.ordered}
