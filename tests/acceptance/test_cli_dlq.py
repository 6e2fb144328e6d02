"""`taskq dlq list/show/replay` and `taskq stats` as real processes: output and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from taskq._core.db import Database
from taskq._core.envelope import Envelope
from taskq._core.kafka import Record
from taskq._core.settings import Settings
from taskq.consumer.store import IdempotencyStore
from taskq.schemas import Registry
from taskq._core.envelope import Topics
from taskq.consumer.routing import dead_letter_record
from taskq.producer.producer import TaskProducer
from tests.integration.test_dlq import FIELDS, dead_letter, publish, publish_garbage, read

Run = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def taskq(env_of: Callable[..., dict[str, str]], settings: Settings) -> Run:
    """Run `python -m consumer.cli --namespace NS ...` in the test's namespace."""

    def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "taskq.cli", "--namespace", settings.namespace, *args],
            env=env_of(**env),
            capture_output=True,
            text=True,
            timeout=120,
        )

    return run


@pytest.fixture
def dlq_records(settings: Settings, task_schema: Callable[..., dict[str, Any]]) -> Iterator[list[Record]]:
    """DLQ offsets 0 (SendEmail, failed 2 h ago), 1 (SendEmail, high), 2 (Report), 3 (garbage)."""
    with Registry(settings.schema_registry_url) as registry:
        email = registry.register(task_schema("SendEmail", FIELDS)).subject
        report = registry.register(task_schema("Report", FIELDS)).subject
    store = IdempotencyStore(Database(settings.database_url, schema=settings.database_schema), owner="w", namespace=settings.namespace)
    try:
        tasks = [
            dead_letter(settings, store, email, 1, failed_at=datetime.now(UTC) - timedelta(hours=2)),
            dead_letter(settings, store, email, 2, priority="high"),
            dead_letter(settings, store, report, 3),
        ]
        publish_garbage(settings)
        yield tasks
    finally:
        store.close()


def lines_of(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def listed(taskq: Run, *args: str) -> list[int]:
    """Offsets printed by `taskq dlq list --json ARGS`."""
    done = taskq("dlq", "list", "--json", *args)
    assert done.returncode == 0, done.stderr
    return [r["offset"] for r in lines_of(done.stdout)]


def test_list(taskq: Run, dlq_records: list[Record], settings: Settings) -> None:
    done = taskq("dlq", "list", "--json")
    assert done.returncode == 0, done.stderr
    rows = lines_of(done.stdout)
    assert [r["offset"] for r in rows] == [0, 1, 2, 3]
    for key in ("offset", "task_type", "idempotency_key", "attempts", "reason", "failed_at"):
        assert key in rows[1]
    env = Envelope.from_headers(dlq_records[1].headers)
    assert rows[1]["task_type"] == f"{settings.namespace}.SendEmail"
    assert rows[1]["idempotency_key"] == env.idempotency_key
    assert rows[1]["attempts"] == 3
    assert rows[1]["reason"] == "failed 3 attempt(s): ValueError: smtp down"
    assert datetime.fromisoformat(rows[1]["failed_at"]) > datetime.now(UTC) - timedelta(minutes=5)
    assert rows[3]["task_type"] is None and rows[3]["idempotency_key"] is None

    report = f"{settings.namespace}.Report"
    assert listed(taskq, "--type", report) == [2]
    assert listed(taskq, "--since", "1h") == [1, 2, 3]
    assert listed(taskq, "--limit", "1") == [0]

    table = taskq("dlq", "list")
    assert table.returncode == 0, table.stderr
    assert "IDEMPOTENCY KEY" in table.stdout and env.idempotency_key in table.stdout
    assert "4 DLQ record(s) not yet replayed" in table.stdout

    bad = taskq("dlq", "list", "--since", "yesterday")
    assert bad.returncode == 2 and "invalid duration" in bad.stderr


def test_show(taskq: Run, dlq_records: list[Record], settings: Settings) -> None:
    done = taskq("dlq", "show", "1", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["payload"] == {"to": "u2@example.com", "n": 2}
    assert data["headers"]["taskq-priority"] == "high"
    assert data["headers"]["taskq-dlq-attempts"] == "3"

    text = taskq("dlq", "show", "1")
    assert text.returncode == 0, text.stderr
    assert '"to": "u2@example.com"' in text.stdout
    assert "taskq-dlq-reason: failed 3 attempt(s)" in text.stdout
    assert "ValueError: smtp down" in text.stdout  # the traceback

    garbage = taskq("dlq", "show", "3")
    assert garbage.returncode == 0, garbage.stderr
    assert "cannot decode" in garbage.stdout and b"\x01garbage".hex() in garbage.stdout

    missing = taskq("dlq", "show", "42")
    assert missing.returncode == 2 and "no DLQ record at offset 42" in missing.stderr


def test_replay(taskq: Run, dlq_records: list[Record], settings: Settings) -> None:
    key = Envelope.from_headers(dlq_records[1].headers).idempotency_key
    done = taskq("dlq", "replay", "1")
    assert done.returncode == 0, done.stderr
    assert f"replayed  1  {key}  -> {settings.namespace}.high" in done.stdout
    assert listed(taskq) == [0, 2, 3]

    again = taskq("dlq", "replay", "1", "--json")
    assert again.returncode == 1
    [result] = lines_of(again.stdout)
    assert result["replayed"] is False and "already replayed" in result["refused"]

    forced = taskq("dlq", "replay", "1", "--force", "--json")
    assert forced.returncode == 0, forced.stderr
    assert lines_of(forced.stdout)[0]["replays"] == 2

    everything = taskq("dlq", "replay", "--all")
    assert everything.returncode == 1  # the garbage record is refused
    assert "replayed  0" in everything.stdout and "replayed  2" in everything.stdout
    assert "refused   3  -: not a task:" in everything.stdout
    assert listed(taskq) == [3]

    usage = taskq("dlq", "replay")
    assert usage.returncode == 2 and "give DLQ offsets or --all" in usage.stderr


def test_stats(taskq: Run, dlq_records: list[Record]) -> None:
    done = taskq("stats", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["dlq_depth"] == 4
    assert data["idempotency"] == {"dead": 3}
    assert sum(data["tiers"].values()) == 3  # nothing consumed the enqueued tasks
    assert (data["retries"], data["retried_tasks"]) == (0, 0)  # each dead key was claimed once

    text = taskq("stats")
    assert "DLQ depth (not replayed): 4" in text.stdout and "dead 3" in text.stdout
    assert "tier depth, estimated (offsets" in text.stdout  # markers count: the output says so


SECRETS = ("hunter2", "tok-123", "s-456", "Bearer abc-789", "c-000")


@pytest.fixture
def secret_record(settings: Settings, task_schema: Callable[..., dict[str, Any]]) -> None:
    """DLQ offset 0: a task whose payload and headers hold secrets (nested, in a map, by pattern)."""
    record = lambda name, *names: {  # noqa: E731
        "type": "record",
        "name": name,
        "fields": [{"name": n, "type": "string"} for n in names],
    }
    fields = [
        {"name": "to", "type": "string"},
        {"name": "auth", "type": record("Auth", "user", "password")},
        {"name": "card", "type": record("Card", "number", "holder")},
        {"name": "api_token", "type": "string"},
        {"name": "extra", "type": {"type": "map", "values": "string"}},
    ]
    with Registry(settings.schema_registry_url) as registry:
        signup = registry.register(task_schema("Signup", fields)).subject
    payload = {
        "to": "a@example.com",
        "auth": {"user": "ann", "password": "hunter2"},
        "card": {"number": "4111-1111", "holder": "Ann"},
        "api_token": "tok-123",
        "extra": {"Session-Secret": "s-456", "note": "\x1b[31mred"},
    }
    with TaskProducer(settings) as producer:
        receipt = producer.enqueue(signup, payload, wait=True)
    assert receipt.partition is not None and receipt.offset is not None
    [task] = read(settings, [(receipt.topic, receipt.partition, receipt.offset)], 1)
    headers = [
        *task.headers,
        ("authorization", b"Bearer abc-789"),
        ("Cookie", b"sid=c-000"),
        ("x-tenant", b"acme"),
        ("x-note", b"\x1b[2Jclear"),
    ]
    out = dead_letter_record(
        replace(task, headers=headers),
        reason="failed 1 attempt(s): ValueError: no",
        error_type="builtins.ValueError",
        traceback="",
        attempts=1,
        worker_id="w",
        topics=Topics(settings.namespace),
    )
    publish(settings, out)


def shown(taskq: Run, *args: str, **env: str) -> dict[str, Any]:
    done = taskq("dlq", "show", "0", "--json", *args, **env)
    assert done.returncode == 0, done.stderr
    data: dict[str, Any] = json.loads(done.stdout)
    return data


def test_show_hides_secret_headers_and_fields_by_default(taskq: Run, secret_record: None) -> None:
    data = shown(taskq)
    headers, payload = data["headers"], data["payload"]
    assert headers["authorization"] == "***" and headers["Cookie"] == "***"
    assert headers["x-tenant"] == "acme"
    assert headers["x-note"] == "\\x1b[2Jclear"  # control characters are still escaped
    assert payload["auth"] == {"user": "ann", "password": "***"}
    assert payload["api_token"] == "***"
    assert payload["extra"] == {"Session-Secret": "***", "note": "\x1b[31mred"}
    assert payload["card"] == {"number": "4111-1111", "holder": "Ann"}

    text = taskq("dlq", "show", "0")
    assert text.returncode == 0, text.stderr
    assert not [s for s in SECRETS if s in text.stdout], text.stdout
    assert "\x1b" not in text.stdout and "authorization: ***" in text.stdout


def test_show_redact_adds_fields_and_headers(taskq: Run, secret_record: None) -> None:
    data = shown(taskq, "--redact", "card.number", "--redact", "X-TENANT")
    assert data["payload"]["card"] == {"number": "***", "holder": "Ann"}
    assert data["headers"]["x-tenant"] == "***"
    assert data["payload"]["auth"]["password"] == "***"  # the defaults still apply
    assert shown(taskq, "--redact", "card")["payload"]["card"] == "***"  # a whole record

    bad = taskq("dlq", "show", "0", "--redact", "")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "must not be empty" in bad.stderr


def test_the_default_redact_list_is_a_setting(taskq: Run, secret_record: None) -> None:
    custom = shown(taskq, TASKQ_DLQ_REDACT="holder, x-*")
    assert custom["payload"]["card"] == {"number": "4111-1111", "holder": "***"}
    assert custom["headers"]["x-tenant"] == "***" and custom["headers"]["x-note"] == "***"
    assert custom["payload"]["auth"]["password"] == "hunter2"  # the list replaces the defaults

    everything = shown(taskq, TASKQ_DLQ_REDACT="")
    assert everything["payload"]["api_token"] == "tok-123"
    assert everything["headers"]["authorization"] == "Bearer abc-789"
