"""The producer side of the `taskq` CLI, run as a real process: topics, schemas, enqueue, bench."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from taskq._core.envelope import Envelope, Topics
from taskq._core.kafka import Admin, Source
from taskq._core.settings import Settings
from taskq.schemas import Registry

FIELDS = [{"name": "to", "type": "string"}, {"name": "n", "type": "int", "default": 0}]


def taskq(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """Run `taskq ARGS...` to completion."""
    return subprocess.run(
        [sys.executable, "-m", "taskq.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )


def _all_topics(settings: Settings) -> list[str]:
    t = Topics(settings.namespace, settings.delay_tiers)
    return [*t.priority_topics, *t.delay_topics, t.dlq]


@pytest.fixture
def other_namespace(settings: Settings) -> Iterator[Settings]:
    """A namespace whose topics do not exist yet; deleted afterwards."""
    other = settings.with_namespace(settings.namespace + "-cli")
    yield other
    admin = Admin(other)
    admin.delete_topics(list(admin.partitions(_all_topics(other))))


@pytest.fixture
def email_type(settings: Settings, task_schema: Callable[..., dict[str, Any]]) -> str:
    with Registry(settings.schema_registry_url) as registry:
        return registry.register(task_schema("SendEmail", FIELDS)).subject


def test_topics_create_is_idempotent(
    env_of: Callable[..., dict[str, str]], other_namespace: Settings
) -> None:
    env = env_of(TASKQ_NAMESPACE=other_namespace.namespace)
    expected = sorted(_all_topics(other_namespace))

    first = taskq(env, "topics", "create", "--partitions", "2")
    assert first.returncode == 0, first.stderr
    assert [line.split() for line in first.stdout.splitlines()] == [["created", t] for t in expected]
    assert Admin(other_namespace).partitions(expected) == {
        t: (1 if t.endswith(".dlq") else 2) for t in expected
    }

    second = taskq(env, "topics", "create", "--partitions", "2", "--json")
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout) == dict.fromkeys(expected, False)
    third = taskq(env, "topics", "create")
    assert [line.split() for line in third.stdout.splitlines()] == [["exists", t] for t in expected]


def test_schemas_register_then_check_tells_compatible_from_incompatible(
    env_of: Callable[..., dict[str, str]], task_schema: Callable[..., dict[str, Any]], tmp_path: Path, ns: str
) -> None:
    task_schema("Charge", [{"name": "payment_id", "type": "string"}], write_to="v1.avsc")
    task_schema(
        "Charge",
        [{"name": "payment_id", "type": "string"}, {"name": "currency", "type": "string", "default": "EUR"}],
        write_to="v2.avsc",
    )
    task_schema("Charge", [{"name": "payment_id", "type": "long"}], write_to="v3.avsc")
    env = env_of()

    registered = taskq(env, "schemas", "register", str(tmp_path / "v1.avsc"), "--json")
    assert registered.returncode == 0, registered.stderr
    (row,) = json.loads(registered.stdout)
    assert (row["subject"], row["version"]) == (f"{ns}.Charge", 1)

    compatible = taskq(env, "schemas", "check", str(tmp_path / "v2.avsc"))
    assert compatible.returncode == 0, compatible.stdout + compatible.stderr
    assert compatible.stdout.split()[:2] == ["compatible", f"{ns}.Charge"]

    incompatible = taskq(env, "schemas", "check", str(tmp_path / "v3.avsc"))
    assert incompatible.returncode == 1, incompatible.stdout + incompatible.stderr
    assert incompatible.stdout.split()[:2] == ["INCOMPATIBLE", f"{ns}.Charge"]

    both = taskq(env, "schemas", "check", str(tmp_path / "v2.avsc"), str(tmp_path / "v3.avsc"), "--json")
    assert both.returncode == 1
    assert [r["compatible"] for r in json.loads(both.stdout)] == [True, False]
    with Registry(env["TASKQ_SCHEMA_REGISTRY_URL"]) as registry:
        assert registry.versions(f"{ns}.Charge") == [1]  # check registers nothing

    missing = taskq(env, "schemas", "register", str(tmp_path / "nope.avsc"))
    assert missing.returncode != 0
    assert "nope.avsc" in missing.stderr


def test_enqueue_prints_the_task_id_and_topic(
    settings: Settings, env_of: Callable[..., dict[str, str]], email_type: str
) -> None:
    out = taskq(
        env_of(), "enqueue", email_type, "--json", '{"to": "a@example.com", "n": 3}', "--priority", "high"
    )
    assert out.returncode == 0, out.stderr
    task_id, topic = out.stdout.split()
    assert re.fullmatch(r"[0-9a-f]{32}", task_id)
    assert topic == f"{settings.namespace}.high"

    delayed = taskq(
        env_of(), "enqueue", email_type, "--json", '{"to": "b@example.com"}',
        "--delay", "20s", "--idempotency-key", "email:b", "--key", "cust-1", "--output-json",
    )  # fmt: skip
    assert delayed.returncode == 0, delayed.stderr
    receipt = json.loads(delayed.stdout)
    assert receipt["topic"] == f"{settings.namespace}.delay.30s"
    assert receipt["idempotency_key"] == "email:b"
    assert receipt["not_before"] is not None and receipt["offset"] is not None

    source = Source(settings, group=f"{settings.namespace}.cli-reader")
    try:
        source.assign([(t, p, 0) for t in (topic, receipt["topic"]) for p in range(3)])
        records = []
        for _ in range(60):
            records += source.poll(10, 0.5)
            if len(records) >= 2:
                break
    finally:
        source.close()
    by_id = {Envelope.from_headers(r.headers).task_id: r for r in records}
    assert by_id[task_id].topic == topic
    assert Envelope.from_headers(by_id[task_id].headers).priority == "high"
    assert by_id[receipt["task_id"]].key == b"cust-1"


def test_enqueue_refuses_bad_input_naming_the_problem(
    settings: Settings, env_of: Callable[..., dict[str, str]], email_type: str
) -> None:
    admin = Admin(settings)
    before = admin.end_offsets(_all_topics(settings))
    env = env_of()

    bad_json = taskq(env, "enqueue", email_type, "--json", '{"to": ')
    assert bad_json.returncode != 0
    assert "--json is not valid JSON" in bad_json.stderr

    bad_payload = taskq(env, "enqueue", email_type, "--json", '{"to": 5}')
    assert bad_payload.returncode != 0
    assert "field 'to' is 5, expected string" in bad_payload.stderr

    unknown_field = taskq(env, "enqueue", email_type, "--json", '{"to": "a", "cc": "b"}')
    assert unknown_field.returncode != 0
    assert "'cc' is not in the schema" in unknown_field.stderr

    unknown_type = taskq(env, "enqueue", f"{settings.namespace}.Nope", "--json", "{}")
    assert unknown_type.returncode != 0
    assert f"unknown task type '{settings.namespace}.Nope'" in unknown_type.stderr

    bad_delay = taskq(env, "enqueue", email_type, "--json", '{"to": "a"}', "--delay", "soon")
    assert bad_delay.returncode != 0
    assert "'soon'" in bad_delay.stderr

    bad_priority = taskq(env, "enqueue", email_type, "--json", '{"to": "a"}', "--priority", "urgent")
    assert bad_priority.returncode != 0
    assert "urgent" in bad_priority.stderr

    for out in (bad_json, bad_payload, unknown_field, unknown_type, bad_delay, bad_priority):
        assert "Traceback" not in out.stderr, out.stderr
    assert admin.end_offsets(_all_topics(settings)) == before


def test_bench_produce_prints_a_rate(settings: Settings, env_of: Callable[..., dict[str, str]]) -> None:
    out = taskq(env_of(), "--namespace", settings.namespace, "bench", "produce", "-n", "2000")
    assert out.returncode == 0, out.stderr
    match = re.search(r"^2000 tasks: (\d+) tasks/s acknowledged .* p50 (\d+) us", out.stdout, re.M)
    assert match, out.stdout
    assert int(match[1]) > 0
    ends = Admin(settings).end_offsets(Topics(settings.namespace).priority_topics)
    assert sum(ends.values()) == 2001  # the warm-up task and the 2000 measured


def test_enqueue_with_the_broker_away_fails_fast_in_one_line(
    env_of: Callable[..., dict[str, str]], email_type: str
) -> None:
    # Nothing listens on port 1: the registry answers (the schema is found), the broker never does.
    out = taskq(env_of(TASKQ_BOOTSTRAP_SERVERS="127.0.0.1:1"), "enqueue", email_type, "--json", '{"to": "a"}')
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("taskq: error:"), out.stderr[-3000:]
