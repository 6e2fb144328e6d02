"""Invariant 6 on the fakes: records with hostile envelope headers go to the DLQ with the reason, and the
worker and the forwarder carry on with the good tasks behind them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from taskq import Handlers, TaskContext
from taskq._core.envelope import Envelope
from taskq._core.errors import ConfigurationError, InvalidTaskError
from taskq._core.kafka import TopicSpec
from taskq.schemas import avro
from taskq.testing import InMemoryQueue

JOB = {"type": "record", "name": "Job", "namespace": "unit", "fields": [{"name": "n", "type": "long"}]}

#: header -> hostile value, and what the DLQ reason must name.
HOSTILE = {
    "max-attempts 0": ("taskq-max-attempts", b"0", "taskq-max-attempts"),
    "timeout inf": ("taskq-timeout", b"inf", "taskq-timeout"),
    "timeout nan": ("taskq-timeout", b"nan", "taskq-timeout"),
    "timeout 1e308": ("taskq-timeout", b"1e308", "taskq-timeout"),
    "enqueued-at 400 nines": ("taskq-enqueued-at", b"9" * 400, "taskq-enqueued-at"),
    "not-before overflow": ("taskq-not-before", b"99999999999999999999", "taskq-not-before"),
    "attempt -1": ("taskq-attempt", b"-1", "taskq-attempt"),
    "huge task type": ("taskq-task-type", b"unit.Job" + b"x" * 5000, "over the 4096-byte limit"),
    "NUL in the key": ("taskq-idempotency-key", b"bad\x00", "contains a NUL byte"),
    "NUL in the task id": ("taskq-task-id", b"\x00bad", "contains a NUL byte"),
    # A step's workflow header names its node as `<workflow id>:<node>`; its outcome is recorded by it.
    "workflow header without a node": ("taskq-workflow", b"garbage", "taskq-workflow"),
    "workflow header with a bad node": ("taskq-workflow", b"wf-1:x", "taskq-workflow"),
    "NUL in the workflow header": ("taskq-workflow", b"wf\x00:1", "taskq-workflow"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_header_is_dead_lettered_and_the_tasks_behind_it_run(case: str) -> None:
    header, value, named = HOSTILE[case]
    handlers, ran = Handlers(), []

    @handlers.task("unit.Job", schema=JOB, timeout=5)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        ran.append(payload["n"])

    with InMemoryQueue(handlers, namespace="unit") as q:
        schema_id = q.registry.latest("unit.Job").schema_id
        frame = avro.frame(schema_id, avro.encode(avro.parse(JOB), {"n": -1}))
        env = Envelope(task_id="bad", task_type="unit.Job", idempotency_key="bad", priority="normal")
        headers = [(k, v) for k, v in env.to_headers() if k != header] + [(header, value)]
        sink = q.broker.sink()
        for topic in ("unit.normal", "unit.delay.1s"):  # a tier topic, and a delay topic for the forwarder
            sink.send(topic, frame, key=b"k", headers=headers, partition=0)
        sink.flush()
        for i in range(5):
            q.producer.enqueue("unit.Job", {"n": i}, idempotency_key=f"good-{i}")
        q.run_until_idle()
        assert sorted(ran) == list(range(5))
        reasons = [d.reason for d in q.dead_letters]
        assert len(reasons) == 2 and all(named in r for r in reasons), reasons


BLOB = {"type": "record", "name": "Blob", "namespace": "unit", "fields": [{"name": "data", "type": "string"}]}


def raw(q: InMemoryQueue, topic: str, task_type: str, value: bytes, **fields: str) -> None:
    """Write a record the broker accepted, bypassing the producer's checks (and its size limit)."""
    env = Envelope(task_id=f"raw-{task_type}", task_type=task_type, idempotency_key=f"raw-{task_type}",
                   priority="normal")  # fmt: skip
    headers = [(k, v) for k, v in env.to_headers() if k[len("taskq-") :] not in fields]
    headers += [(f"taskq-{k}", v.encode()) for k, v in fields.items()]
    sink = q.broker.sink(**{"message.max.bytes": 10_000_000})
    sink.send(topic, value, key=b"k", headers=headers, partition=0)
    sink.flush()


def test_a_record_too_large_to_republish_gets_a_bounded_dlq_record_and_the_worker_moves_on() -> None:
    handlers, ran = Handlers(), []

    @handlers.task("unit.Job", schema=JOB)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        ran.append(payload["n"])

    @handlers.task("unit.Blob", schema=BLOB, max_attempts=3)
    def blob(payload: dict[str, Any], ctx: TaskContext) -> None:
        raise ConnectionError("downstream refused the blob")

    with InMemoryQueue(handlers, namespace="unit") as q:
        big = "x" * 1_200_000
        blob_id = q.registry.latest("unit.Blob").schema_id
        # Unknown to every handler, and a known type whose retry would be as large: both over 1 MB.
        raw(q, "unit.normal", "unit.Nobody", b"\0" * 1_200_000)
        raw(q, "unit.normal", "unit.Blob", avro.frame(blob_id, avro.encode(avro.parse(BLOB), {"data": big})))
        for i in range(3):
            q.producer.enqueue("unit.Job", {"n": i})
        q.run_until_idle()
        assert sorted(ran) == [0, 1, 2]
        dead = {d.task_type: d for d in q.dead_letters}
        assert set(dead) == {"unit.Nobody", "unit.Blob"}
        for d in dead.values():
            assert d.value is None and "too large to republish whole" in d.reason
            assert int(d.headers["taskq-dlq-value-bytes"]) > 1_000_000
            assert len(d.headers["taskq-dlq-value-sha256"]) == 64
        assert "too large to retry" in dead["unit.Blob"].reason


@pytest.mark.parametrize("origin", ["unit.missing", "other.normal"])
def test_the_forwarder_forwards_only_to_its_own_namespaces_tiers(origin: str) -> None:
    handlers, ran = Handlers(), []

    @handlers.task("unit.Job", schema=JOB)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        ran.append(payload["n"])

    with InMemoryQueue(handlers, namespace="unit") as q:
        q.broker.admin().create_topics([TopicSpec("other.normal", 1)])
        job_id = q.registry.latest("unit.Job").schema_id
        raw(q, "unit.delay.1s", "unit.Job", avro.frame(job_id, avro.encode(avro.parse(JOB), {"n": -1})),
            **{"origin-topic": origin})  # fmt: skip
        for i in range(3):
            q.producer.enqueue("unit.Job", {"n": i}, delay=1)
        q.run_until_idle()
        assert sorted(ran) == [0, 1, 2]
        (dead,) = q.dead_letters
        assert f"origin topic {origin!r} is not a tier" in dead.reason
        assert q.broker.records("other.normal") == []


def test_an_async_transactional_handler_is_refused_at_registration() -> None:
    handlers = Handlers()
    with pytest.raises(ConfigurationError, match="transactional=True needs a plain `def` handler"):

        @handlers.task("unit.Job", schema=JOB, transactional=True)
        async def job(payload: dict[str, Any], ctx: TaskContext) -> None:
            ctx.db.execute("INSERT INTO effects VALUES (1)")

    assert "unit.Job" not in handlers


def test_a_delay_beyond_the_largest_tier_hops_and_never_holds_back_tasks_due_sooner() -> None:
    handlers, ran = Handlers(), []

    @handlers.task("unit.Job", schema=JOB)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        ran.append((payload["n"], q.clock.offset))

    with InMemoryQueue(handlers, namespace="unit") as q:
        # Both wait in the 1 h tier, on one partition (one key); the first is due in 5 h.
        q.producer.enqueue("unit.Job", {"n": 1}, key="k", delay=timedelta(hours=5))
        q.producer.enqueue("unit.Job", {"n": 2}, key="k", delay=timedelta(minutes=30))
        q.run_until_idle()
        assert [n for n, _ in ran] == [2, 1]
        waited = dict(ran)
        assert waited[2] <= 3600 + 60  # held at most one tier (1 h) behind the long one, not 5 h
        assert 5 * 3600 - 60 <= waited[1] <= 5 * 3600 + 60  # and the long one runs on time


@pytest.mark.parametrize("delay", [timedelta(days=366), 10**12])
def test_a_delay_over_the_maximum_is_refused_in_one_line(delay: object) -> None:
    with InMemoryQueue(Handlers(), namespace="unit") as q:
        q.registry.register(JOB)
        with pytest.raises(InvalidTaskError, match="delay") as err:
            q.producer.enqueue("unit.Job", {"n": 1}, delay=delay)  # type: ignore[arg-type]
        assert "\n" not in str(err.value)


def test_an_idempotency_key_with_a_nul_character_is_refused_in_one_line_and_nothing_is_sent() -> None:
    # Postgres text cannot hold it: a worker could never record the key (it dead-letters such a record).
    with InMemoryQueue(Handlers(), namespace="unit") as q:
        q.registry.register(JOB)
        with pytest.raises(InvalidTaskError, match="must not contain a NUL character") as err:
            q.producer.enqueue("unit.Job", {"n": 1}, idempotency_key="order:\x0042")
        assert "\n" not in str(err.value)
        q.producer.flush()
        assert not q.broker.records("unit.normal")


def test_dlq_listings_escape_control_characters_from_headers() -> None:
    handlers = Handlers()

    @handlers.task("unit.Job", schema=JOB, max_attempts=1)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        raise ValueError("boom \x1b[2J\x1b[31m cleared your screen\x07")

    with InMemoryQueue(handlers, namespace="unit") as q, q.dlq as dlq:
        q.producer.enqueue("unit.Job", {"n": 1})
        q.run_until_idle()
        (rec,) = dlq.list()
        shown = rec.to_dict(full=True)
        for text in (rec.reason, rec.traceback, *shown["headers"].values()):
            assert "\x1b" not in text and "\x07" not in text
        assert "\\x1b[2J" in rec.reason


def test_a_dlq_listing_with_a_limit_reads_no_further_than_one_fetch() -> None:
    with InMemoryQueue(Handlers(), namespace="unit") as q, q.dlq as dlq:
        sink = q.broker.sink()
        for i in range(2000):  # input that never became a task, dead-lettered earlier
            sink.send("unit.dlq", b"x", key=None, headers=[("taskq-dlq-reason", f"r{i}".encode())])
        sink.flush()
        before = q.broker.fetched
        assert [r.reason for r in dlq.list(limit=2)] == ["r0", "r1"]
        assert q.broker.fetched - before <= 500
        assert len(dlq.list()) == 2000


def test_tasks_behind_a_long_delay_that_are_due_sooner_are_not_held_back_by_it() -> None:
    handlers, ran = Handlers(), []

    @handlers.task("unit.Job", schema=JOB)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        ran.append((payload["n"], q.clock.offset))

    with InMemoryQueue(handlers, namespace="unit") as q:
        # One partition (one key), the 1 h tier: three tasks due in 3 h, then 100 due in 55 min behind them.
        for n in range(3):
            q.producer.enqueue("unit.Job", {"n": n}, key="k", delay=timedelta(hours=3))
        for n in range(3, 103):
            q.producer.enqueue("unit.Job", {"n": n}, key="k", delay=timedelta(minutes=55))
        q.run_until_idle()
        waited = dict(ran)
        assert sorted(waited) == list(range(103))
        # The clock's offset counts from before the enqueues (which took real milliseconds): allow a second.
        assert all(55 * 60 - 1 <= waited[n] <= 56 * 60 for n in range(3, 103))  # on time, not after the heads
        assert all(
            3 * 3600 - 1 <= waited[n] <= 3 * 3600 + 60 for n in range(3)
        )  # and the long ones not early


def test_at_takes_a_due_time() -> None:
    handlers, ran = Handlers(), []

    @handlers.task("unit.Job", schema=JOB)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        ran.append((payload["n"], q.clock.offset))

    with InMemoryQueue(handlers, namespace="unit") as q:
        now = datetime.fromtimestamp(q.clock.time(), UTC)
        q.producer.enqueue("unit.Job", {"n": 1}, at=now + timedelta(hours=3))
        q.producer.enqueue("unit.Job", {"n": 2}, at=now - timedelta(days=2))  # in the past: runs now
        for bad, problem in [
            ({"at": datetime(2030, 1, 1)}, "timezone-aware"),
            ({"at": now, "delay": 5}, "not both"),
            ({"at": now + timedelta(days=400)}, "maximum of 365 days"),
        ]:
            with pytest.raises(InvalidTaskError, match=problem) as raised:
                q.producer.enqueue("unit.Job", {"n": 3}, **bad)  # type: ignore[arg-type]
            assert "\n" not in str(raised.value)
        q.run_until_idle()
        waited = dict(ran)
        assert waited[2] < 1 and 3 * 3600 - 1 <= waited[1] <= 3 * 3600 + 60


@pytest.mark.parametrize("delay", [timedelta(seconds=5), timedelta(seconds=20), timedelta(seconds=90)])
def test_a_delayed_task_runs_at_its_due_time_not_a_tier_later(delay: timedelta) -> None:
    # On the queue's own clock: the forwarder releases a task when it is due, not when its tier's period ends.
    handlers, ran = Handlers(), []

    @handlers.task("unit.Job", schema=JOB)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        ran.append(q.clock.offset)

    with InMemoryQueue(handlers, namespace="unit") as q:
        q.producer.enqueue("unit.Job", {"n": 1}, delay=delay)
        q.run_until_idle()
        (waited,) = ran
        # The offset is what the clock was moved on; real milliseconds pass too, so "due" reads a little early.
        assert delay.total_seconds() - 0.5 <= waited <= delay.total_seconds() + 1
