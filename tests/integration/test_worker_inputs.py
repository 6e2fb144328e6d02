"""The programmatic Worker against the real stack: bad input, schema evolution, duplicates, transactions,
contiguous commits and bounded buffering."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from taskq import Handlers
from taskq._core.db import Database
from taskq._core.envelope import Envelope, Topics
from taskq._core.kafka import TP, Admin, Record, Sink, Source
from taskq._core.settings import Settings
from taskq.consumer.events import (
    AttemptFailed,
    AttemptStarted,
    DeadLettered,
    DuplicateSkipped,
    OffsetsCommitted,
    PartitionsRevoked,
    TaskCompleted,
)
from taskq.consumer.retry import RetryPolicy
from taskq.consumer.routing import DLQ_OFFSET, DLQ_REASON, DLQ_TOPIC
from taskq.consumer.store import ClaimRequest, IdempotencyStore, WorkerRecord
from taskq.consumer.worker import Worker, WorkerConfig
from taskq.producer.producer import TaskProducer, TaskSpec
from taskq.schemas import Registry, avro
from taskq.testing import RecordingHook
from tests.acceptance.helpers import wait_until
from tests.rawkafka import produce_raw

ID_FIELDS = [{"name": "id", "type": "string"}]


@contextmanager
def running(
    handlers: Handlers, settings: Settings, *, events: RecordingHook | None = None, **config: Any
) -> Iterator[tuple[Worker, RecordingHook]]:
    """A Worker in a background thread; stopped gracefully (and joined) at the end."""
    events = events or RecordingHook()
    config = {"concurrency": 2, "commit_interval": 0.2, **config}
    w = Worker(handlers, settings, WorkerConfig(**config), hooks=[events])
    failure: list[BaseException] = []

    def run() -> None:
        try:
            w.run()
        except BaseException as exc:
            failure.append(exc)
            raise

    thread = threading.Thread(target=run, name="test-worker", daemon=True)
    thread.start()
    try:
        yield w, events
    finally:
        w.stop()
        thread.join(60)
        assert not thread.is_alive(), "the worker did not shut down"
    assert not failure, f"the worker loop raised: {failure[0]!r}"


def _register(settings: Settings, schema: dict[str, Any]) -> int:
    with Registry(settings.schema_registry_url) as registry:
        return registry.register(schema).schema_id


def _committed(settings: Settings, tp: TP) -> int:
    return Admin(settings).committed(settings.worker_group, [tp[0]]).get(tp, -1)


def _read_all(
    settings: Settings, topic: str, partitions: int, want: int, timeout: float = 30.0
) -> list[Record]:
    """Every record of a topic from the start, waiting until at least `want` arrived."""
    source = Source(settings, group=f"{settings.namespace}.reader")
    try:
        source.assign([(topic, p, 0) for p in range(partitions)])
        out: list[Record] = []
        deadline = time.monotonic() + timeout
        while len(out) < want and time.monotonic() < deadline:
            out += source.poll(100, 0.5)
        # Anything beyond `want` that is already there must show up too (exactly, not at least).
        out += source.poll(100, 1.0)
        return out
    finally:
        source.close()


def _query(settings: Settings, sql: str, *params: Any) -> list[dict[str, Any]]:
    with Database(settings.database_url, schema=settings.database_schema).connection() as conn:
        return list(conn.execute(sql, params).fetchall())


# -------------------------------------------------------------------------------------------------- bad input
def test_bad_input_goes_to_the_dlq_with_its_reason_and_the_worker_moves_on(
    settings: Settings, task_schema: Callable[..., dict[str, Any]]
) -> None:
    ns = settings.namespace
    schema = task_schema("Job", ID_FIELDS)
    schema_id = _register(settings, schema)
    topics = Topics(ns, settings.delay_tiers)
    good_body = avro.frame(schema_id, avro.encode(avro.parse(schema), {"id": "x"}))

    def envelope(task_type: str, key: str) -> list[tuple[str, bytes]]:
        return Envelope(task_id=key, task_type=task_type, idempotency_key=key, priority="normal").to_headers()

    bad = {
        # value, headers, what the DLQ reason must name
        "garbage": (b"\x01not avro", envelope(f"{ns}.Job", "bad-garbage"), "undecodable"),
        "schema-id": (avro.frame(987654, b"\x02x"), envelope(f"{ns}.Job", "bad-id"), "unknown schema id"),
        "task-type": (good_body, envelope(f"{ns}.Nobody", "bad-task-type"), "unknown task type"),
        "envelope": (good_body, [], "bad envelope"),
    }
    sink = Sink(settings)
    placed: dict[int, str] = {}  # offset -> which bad record
    partitions: set[int] = set()

    def delivered(name: str) -> Callable[[str | None, Record | None], None]:
        def cb(err: str | None, record: Record | None) -> None:
            assert err is None and record is not None, err
            placed[record.offset] = name
            partitions.add(record.partition)

        return cb

    for name, (value, headers, _) in bad.items():
        sink.send(topics.tier("normal"), value, key=b"one", headers=headers, on_delivery=delivered(name))
    assert sink.flush(30) == 0
    # Valid tasks behind the bad ones, on the same partition (same message key).
    with TaskProducer(settings) as producer:
        receipts = producer.enqueue_many(
            [TaskSpec(task_type=f"{ns}.Job", payload={"id": f"ok{i}"}, key="one") for i in range(3)],
            wait=True,
        )
    partitions |= {r.partition for r in receipts if r.partition is not None}
    assert len(partitions) == 1, f"records spread over partitions {partitions}"
    tp = (topics.tier("normal"), partitions.pop())
    last = max(r.offset for r in receipts if r.offset is not None)

    seen: list[str] = []
    h = Handlers()

    @h.task(f"{ns}.Job", schema=schema)
    def job(payload: dict[str, Any], ctx: Any) -> None:
        seen.append(payload["id"])

    with running(h, settings) as (_, events):
        events.count(TaskCompleted, 3)
        events.count(DeadLettered, 4)
        wait_until(lambda: _committed(settings, tp) == last + 1, timeout=30, what="a commit past them all")
    assert sorted(seen) == ["ok0", "ok1", "ok2"]

    dlq = _read_all(settings, topics.dlq, 1, want=len(bad))
    by_name = {placed[int(r.header(DLQ_OFFSET) or b"-1")]: r for r in dlq}
    assert len(dlq) == len(bad), [r.header(DLQ_REASON) for r in dlq]
    assert set(by_name) == set(bad)
    for name, (value, _, reason) in bad.items():
        record = by_name[name]
        assert reason in (record.header(DLQ_REASON) or b"").decode(), (name, record.header(DLQ_REASON))
        assert record.value == value, name  # the original bytes, untouched


def _bad_job(
    settings: Settings, task_schema: Callable[..., dict[str, Any]]
) -> tuple[dict[str, Any], bytes, list[tuple[bytes, bytes]]]:
    """The Job schema (registered), the value of a task of it, and its envelope's headers as raw bytes."""
    ns = settings.namespace
    schema = task_schema("Job", ID_FIELDS)
    body = avro.frame(_register(settings, schema), avro.encode(avro.parse(schema), {"id": "bad"}))
    env = Envelope(task_id="bad", task_type=f"{ns}.Job", idempotency_key="bad", priority="normal")
    return schema, body, [(k.encode(), v) for k, v in env.to_headers()]


def _job_handlers(settings: Settings, schema: dict[str, Any]) -> tuple[Handlers, list[str]]:
    """Handlers whose Job task notes each payload's id in the returned list."""
    seen: list[str] = []
    h = Handlers()

    @h.task(f"{settings.namespace}.Job", schema=schema)
    def job(payload: dict[str, Any], ctx: Any) -> None:
        seen.append(payload["id"])

    return h, seen


@pytest.mark.partitions(1)
def test_a_header_key_that_is_not_utf8_is_dead_lettered_on_a_tier_and_a_delay_topic(
    settings: Settings, task_schema: Callable[..., dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    ns = settings.namespace
    topics = Topics(ns, settings.delay_tiers)
    schema, body, headers = _bad_job(settings, task_schema)
    # No client library writes such a key (they all encode header keys as UTF-8): a raw Produce request.
    headers += [(b"\xff\xfe", b"x")]
    tier, delay = topics.tier("normal"), topics.delay(settings.delay_tiers[0])
    for topic in (tier, delay):
        produce_raw(settings.bootstrap_servers, topic, 0, key=b"bad", value=body, headers=headers)
    with TaskProducer(settings) as producer:  # good tasks behind them, now and delayed
        for i in range(3):
            producer.enqueue(f"{ns}.Job", {"id": f"now{i}"})
            producer.enqueue(f"{ns}.Job", {"id": f"later{i}"}, delay=timedelta(seconds=1))
    h, seen = _job_handlers(settings, schema)
    with caplog.at_level(logging.ERROR, logger="taskq"), running(h, settings) as (_, events):
        events.count(TaskCompleted, 6)
        dlq = _read_all(settings, topics.dlq, 1, want=2)
    assert sorted(seen) == sorted([f"now{i}" for i in range(3)] + [f"later{i}" for i in range(3)])
    assert sorted((r.header(DLQ_TOPIC) or b"").decode() for r in dlq) == sorted([tier, delay])
    for record in dlq:
        reason = (record.header(DLQ_REASON) or b"").decode()
        assert "bad envelope" in reason and "not valid UTF-8" in reason, reason
        assert record.value == body
    assert not [r for r in caplog.records if r.name.startswith("taskq")], caplog.text  # no restart, no crash


@pytest.mark.partitions(1)
@pytest.mark.parametrize("header", ["taskq-idempotency-key", "taskq-task-id"])
def test_a_nul_byte_in_a_key_or_task_id_header_is_dead_lettered_and_the_tasks_beside_it_run(
    settings: Settings, task_schema: Callable[..., dict[str, Any]], header: str
) -> None:
    # Postgres text cannot hold a NUL byte: such a key or task id, claimed with the tasks fetched beside it,
    # failed their whole claim as if Postgres were away, again at every retry.
    ns = settings.namespace
    topics = Topics(ns, settings.delay_tiers)
    schema, body, headers = _bad_job(settings, task_schema)
    headers = [(k, b"bad\x00one" if k == header.encode() else v) for k, v in headers]
    tier = topics.tier("normal")
    with TaskProducer(settings) as producer:  # good tasks before and after it, in the same fetch
        producer.enqueue(f"{ns}.Job", {"id": "before"})
        producer.flush(30)
        produce_raw(settings.bootstrap_servers, tier, 0, key=b"bad", value=body, headers=headers)
        for i in range(3):
            producer.enqueue(f"{ns}.Job", {"id": f"after{i}"})
    h, seen = _job_handlers(settings, schema)
    with running(h, settings) as (_, events):
        events.count(TaskCompleted, 4, timeout=30)
        (dead,) = _read_all(settings, topics.dlq, 1, want=1)
    assert sorted(seen) == ["after0", "after1", "after2", "before"]
    reason = (dead.header(DLQ_REASON) or b"").decode()
    assert "bad envelope" in reason and header in reason and "NUL" in reason, reason
    assert dead.value == body


# ------------------------------------------------------------------------------------------- schema evolution
def test_old_payloads_are_read_into_the_handlers_newer_schema_and_upcast(
    settings: Settings, task_schema: Callable[..., dict[str, Any]]
) -> None:
    ns = settings.namespace
    v1, up_v1 = task_schema("Evolving", ID_FIELDS), task_schema("Upcast", ID_FIELDS)
    _register(settings, v1)
    up_v1_id = _register(settings, up_v1)
    with TaskProducer(settings) as producer:  # writes with the latest registered version: v1
        producer.enqueue(f"{ns}.Evolving", {"id": "e1"})
        producer.enqueue(f"{ns}.Upcast", {"id": "u1"})
    note = {"name": "note", "type": "string", "default": "none"}
    v2, up_v2 = task_schema("Evolving", [*ID_FIELDS, note]), task_schema("Upcast", [*ID_FIELDS, note])
    _register(settings, v2)
    _register(settings, up_v2)

    got: dict[str, dict[str, Any]] = {}
    h = Handlers()

    @h.task(f"{ns}.Evolving", schema=v2)
    def evolving(payload: dict[str, Any], ctx: Any) -> None:
        got["evolving"] = payload

    @h.task(
        f"{ns}.Upcast",
        schema=up_v2,
        upcaster=lambda payload, schema_id: {"id": payload["id"].upper(), "note": f"from {schema_id}"},
    )
    def upcast(payload: dict[str, Any], ctx: Any) -> None:
        got["upcast"] = payload

    with running(h, settings) as (_, events):
        events.count(TaskCompleted, 2)
    assert got["evolving"] == {"id": "e1", "note": "none"}
    assert got["upcast"] == {"id": "U1", "note": f"from {up_v1_id}"}


# ------------------------------------------------------------------------------------------------- duplicates
def test_one_idempotency_key_enqueued_three_times_runs_once(
    settings: Settings, task_schema: Callable[..., dict[str, Any]]
) -> None:
    ns = settings.namespace
    schema = task_schema("Charge", ID_FIELDS)
    _register(settings, schema)
    with TaskProducer(settings) as producer:
        for _ in range(3):
            producer.enqueue(f"{ns}.Charge", {"id": "p1"}, idempotency_key="charge:p1")
    runs: list[str] = []
    h = Handlers()

    @h.task(f"{ns}.Charge", schema=schema)
    def charge(payload: dict[str, Any], ctx: Any) -> None:
        runs.append(ctx.task_id)

    with running(h, settings) as (_, events):
        # Every delivery ends as a completion or a skipped duplicate; a second run would show as a completion.
        events.wait(
            lambda: len(events.of(TaskCompleted)) + len(events.of(DuplicateSkipped)) >= 3,
            timeout=60,
            what="all three deliveries",
        )
    assert len(events.of(TaskCompleted)) == 1 and len(events.of(DuplicateSkipped)) == 2, events.events
    assert len(runs) == 1
    rows = _query(settings, "SELECT state, attempts FROM taskq_tasks WHERE idempotency_key = %s", "charge:p1")
    assert rows == [{"state": "completed", "attempts": 1}]


def test_a_clean_stop_leaves_the_group_without_a_warning(
    settings: Settings, task_schema: Callable[..., dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    # Leaving the group serves a last revocation. Its commit ran with the consumer already let go, failed
    # on that (an assertion, with no message), and every stop logged "commit on revoke failed: " and nothing
    # more, a warning that names nothing.
    ns = settings.namespace
    schema = task_schema("Note", ID_FIELDS)
    _register(settings, schema)
    with TaskProducer(settings) as producer:
        producer.enqueue(f"{ns}.Note", {"id": "n1"})
    h = Handlers()

    @h.task(f"{ns}.Note", schema=schema)
    def note(payload: dict[str, Any], ctx: Any) -> None:
        pass

    with caplog.at_level(logging.WARNING, logger="taskq"), running(h, settings) as (_, events):
        events.wait(lambda: events.of(TaskCompleted), timeout=60, what="the task")
    assert events.of(PartitionsRevoked), "leaving the group revoked the partitions"
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("taskq")]
    assert not warnings, warnings


# ----------------------------------------------------------------------------------------------- transactions
def test_a_transactional_handler_that_raises_leaves_no_write_and_no_completion(
    settings: Settings, task_schema: Callable[..., dict[str, Any]]
) -> None:
    ns = settings.namespace
    schema = task_schema("Write", ID_FIELDS)
    _register(settings, schema)
    with Database(settings.database_url, schema=settings.database_schema).connection() as conn:
        conn.execute("CREATE TABLE effects (id text NOT NULL)")
    with TaskProducer(settings) as producer:
        producer.enqueue(f"{ns}.Write", {"id": "raises"}, idempotency_key="w:raises", max_attempts=1)
        producer.enqueue(f"{ns}.Write", {"id": "commits"}, idempotency_key="w:commits")
    h = Handlers()

    @h.task(f"{ns}.Write", schema=schema, transactional=True)
    def write(payload: dict[str, Any], ctx: Any) -> None:
        ctx.db.execute("INSERT INTO effects (id) VALUES (%s)", (payload["id"],))
        if payload["id"] == "raises":
            raise RuntimeError("after the write")

    with running(h, settings) as (_, events):
        events.count(TaskCompleted, 1)
        events.count(DeadLettered, 1)
    assert [r["id"] for r in _query(settings, "SELECT id FROM effects")] == ["commits"]
    states = {r["idempotency_key"]: r["state"] for r in _query(settings, "SELECT * FROM taskq_tasks")}
    assert states == {"w:raises": "dead", "w:commits": "completed"}


def test_an_error_message_postgres_cannot_hold_is_recorded_readably_and_the_worker_goes_on(
    settings: Settings, task_schema: Callable[..., dict[str, Any]]
) -> None:
    # A lone surrogate (a file name decoded with surrogateescape, say) cannot be encoded for Postgres. The
    # failure's record raised in the recorder, and the loop raised it: the worker stopped.
    ns = settings.namespace
    schema = task_schema("Read", ID_FIELDS)
    _register(settings, schema)
    with TaskProducer(settings) as producer:
        producer.enqueue(f"{ns}.Read", {"id": "bad"}, idempotency_key="r:bad", max_attempts=2)
        producer.enqueue(f"{ns}.Read", {"id": "ok"}, idempotency_key="r:ok")
    h = Handlers()
    calls: list[str] = []

    @h.task(f"{ns}.Read", schema=schema, retry=RetryPolicy(max_attempts=2, base=timedelta(milliseconds=50)))
    def read(payload: dict[str, Any], ctx: Any) -> None:
        calls.append(payload["id"])
        if payload["id"] == "bad" and calls.count("bad") == 1:
            raise OSError("cannot open " + b"report-\xff.pdf".decode("utf-8", "surrogateescape"))

    with running(h, settings) as (_, events):
        events.count(TaskCompleted, 2, timeout=60)
    assert [e.error for e in events.of(AttemptFailed)] == ["builtins.OSError: cannot open report-\\udcff.pdf"]
    rows = _query(settings, "SELECT idempotency_key, state, attempts FROM taskq_tasks ORDER BY 1")
    assert rows == [
        {"idempotency_key": "r:bad", "state": "completed", "attempts": 2},
        {"idempotency_key": "r:ok", "state": "completed", "attempts": 1},
    ]


class _Dispatched(RecordingHook):
    """Notes when the worker's loop dispatched each attempt (it emits AttemptStarted as it submits it)."""

    def __init__(self) -> None:
        super().__init__()
        self.at: list[datetime] = []

    def __call__(self, event: Any) -> None:
        if isinstance(event, AttemptStarted):
            self.at.append(datetime.now(UTC))
        super().__call__(event)


def test_every_slot_has_its_connection_open_before_the_first_transactional_attempt(
    settings: Settings, task_schema: Callable[..., dict[str, Any]]
) -> None:
    # Each pool thread runs transactional attempts on a connection of its own. Opened at the thread's first
    # attempt, the connects came between the dispatch of the first wave of group commits and their start,
    # so the groups began tens of ms apart, and the tiers' effects landed out of their weighted order.
    ns = settings.namespace
    schema = task_schema("Note", ID_FIELDS)
    _register(settings, schema)
    with TaskProducer(settings) as producer:
        for i in range(8):
            producer.enqueue(f"{ns}.Note", {"id": f"n{i}"}, idempotency_key=f"note:{i}")
    h = Handlers()
    opened: dict[int, datetime] = {}

    @h.task(f"{ns}.Note", schema=schema, transactional=True, group_commit=False)
    def note(payload: dict[str, Any], ctx: Any) -> None:
        row = ctx.db.execute(
            "SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()"
        ).fetchone()
        pid, start = row.values() if isinstance(row, dict) else row
        opened[pid] = start
        time.sleep(0.2)  # every slot gets an attempt at once

    dispatched = _Dispatched()
    with running(h, settings, events=dispatched, concurrency=4):
        dispatched.count(TaskCompleted, 8)
    assert len(opened) == 4, opened  # one connection per slot, kept between attempts
    first = min(dispatched.at)
    late = {pid: (at - first).total_seconds() for pid, at in opened.items() if at > first}
    assert not late, f"connections opened after the first dispatch (seconds after it): {late}"


# ----------------------------------------------------------------------------------------- contiguous commits
def test_the_committed_offset_waits_for_a_blocked_task_then_passes_all(
    settings: Settings, task_schema: Callable[..., dict[str, Any]]
) -> None:
    ns = settings.namespace
    schema = task_schema("Step", ID_FIELDS)
    _register(settings, schema)
    with TaskProducer(settings) as producer:
        receipts = producer.enqueue_many(
            [TaskSpec(task_type=f"{ns}.Step", payload={"id": f"s{i}"}, key="one") for i in range(6)],
            wait=True,
        )
    assert len({r.partition for r in receipts}) == 1
    tp = (receipts[0].topic, receipts[0].partition or 0)
    offsets = {r.task_id: r.offset for r in receipts}
    blocked = receipts[1]  # s0 completes before it, s2..s5 after it
    gate = threading.Event()
    h = Handlers()

    @h.task(f"{ns}.Step", schema=schema)
    def step(payload: dict[str, Any], ctx: Any) -> None:
        if payload["id"] == "s1":
            gate.wait(120)

    def later_done(events: RecordingHook) -> bool:
        done = {e.task_id for e in events.of(TaskCompleted)}
        return {r.task_id for r in receipts} - done == {blocked.task_id}

    def commits_of(events: RecordingHook, of: TP) -> list[int]:
        return [e.offsets[of] for e in events.of(OffsetsCommitted) if of in e.offsets]

    with TaskProducer(settings) as producer, running(h, settings) as (_, events):
        try:
            events.wait(lambda: later_done(events), timeout=60, what="every task but the blocked one")
            # A task on another partition completes after them: the commit following its completion has
            # seen everything done so far, so a watermark that skipped the blocked task would show by then.
            probe = producer.enqueue(f"{ns}.Step", {"id": "probe"}, priority="high", wait=True)
            probe_tp = (probe.topic, probe.partition or 0)
            events.wait(lambda: bool(commits_of(events, probe_tp)), timeout=60, what="the probe's commit")
            assert _committed(settings, tp) == offsets[blocked.task_id]
            assert max(commits_of(events, tp)) == offsets[blocked.task_id]
        finally:
            gate.set()
        wait_until(
            lambda: _committed(settings, tp) == max(offsets.values()) + 1,
            timeout=30,
            what="the commit past every task once the blocked one finished",
        )


# --------------------------------------------------------------------------------------------- bounded memory
def test_a_blocked_worker_buffers_at_most_its_capacity_and_pauses(
    settings: Settings, task_schema: Callable[..., dict[str, Any]]
) -> None:
    ns = settings.namespace
    schema = task_schema("Slow", ID_FIELDS)
    _register(settings, schema)
    with TaskProducer(settings) as producer:
        for start in range(0, 200, 50):
            producer.enqueue_many(
                [
                    TaskSpec(task_type=f"{ns}.Slow", payload={"id": f"b{i}"}, key="one")
                    for i in range(start, start + 50)
                ]
            )
    gate = threading.Event()
    h = Handlers()

    @h.task(f"{ns}.Slow", schema=schema)
    def slow(payload: dict[str, Any], ctx: Any) -> None:
        gate.wait(120)

    capacity = 8
    with running(h, settings, concurrency=1, buffer_capacity=capacity) as (w, events):
        try:
            events.count(AttemptStarted, 1)
            wait_until(lambda: w._paused, timeout=30, what="the busy partition to be paused")
            samples = []
            for _ in range(10):
                samples.append(len(w._scheduler))
                time.sleep(0.1)  # sampling a steady state: there is no event to wait for
            assert max(samples) <= capacity + 10, samples
            assert w._paused, "the busy partition was resumed while its buffer stayed full"
            assert {tp[0] for tp in w._paused} == {f"{ns}.normal"}
        finally:
            gate.set()
        events.count(TaskCompleted, 200, timeout=120)


def test_copies_of_a_running_key_count_against_the_buffer_bound(
    settings: Settings, task_schema: Callable[..., dict[str, Any]]
) -> None:
    """Copies held back while their key runs are buffered tasks too: they must not grow without bound."""
    ns = settings.namespace
    schema = task_schema("Same", ID_FIELDS)
    _register(settings, schema)
    copies = 120
    with TaskProducer(settings) as producer:
        producer.enqueue_many(
            [
                TaskSpec(task_type=f"{ns}.Same", payload={"id": "x"}, idempotency_key="same", key="one")
                for _ in range(copies)
            ]
        )
    gate = threading.Event()
    h = Handlers()

    @h.task(f"{ns}.Same", schema=schema)
    def same(payload: dict[str, Any], ctx: Any) -> None:
        gate.wait(120)

    capacity = 8
    with running(h, settings, concurrency=2, buffer_capacity=capacity) as (w, events):
        try:
            events.count(AttemptStarted, 1)
            wait_until(
                lambda: len(w._scheduler) + len(w._held) >= capacity and w._paused,
                timeout=30,
                what="a full buffer and the busy partition paused",
            )
            samples = []
            for _ in range(20):
                samples.append((len(w._scheduler) + len(w._held), bool(w._paused)))
                time.sleep(0.1)  # sampling a steady state: there is no event to wait for
            # Held copies free no buffer room, so the partition stays paused and the count stays put.
            assert all(paused for _, paused in samples), samples
            assert max(n for n, _ in samples) <= capacity + 10, samples
        finally:
            gate.set()
        events.wait(
            lambda: len(events.of(TaskCompleted)) + len(events.of(DuplicateSkipped)) >= copies,
            timeout=120,
            what="every copy to be completed or skipped",
        )
    assert len(events.of(TaskCompleted)) == 1


# ---------------------------------------------------------------------------------------------- registry down
def test_a_registry_outage_holds_tasks_instead_of_dead_lettering_them(
    settings: Settings, task_schema: Callable[..., dict[str, Any]]
) -> None:
    schema = task_schema("Held", ID_FIELDS)
    _register(settings, schema)
    ran: list[str] = []
    h = Handlers()

    @h.task(f"{settings.namespace}.Held", schema=schema)
    def held(payload: dict[str, Any], ctx: Any) -> None:
        ran.append(payload["id"])

    with TaskProducer(settings) as producer:
        producer.enqueue_many(
            [TaskSpec(task_type=f"{settings.namespace}.Held", payload={"id": f"h{i}"}) for i in range(5)]
        )
    real_url = settings.schema_registry_url
    down = replace(settings, schema_registry_url="http://127.0.0.1:9/apis/ccompat/v7")  # nothing listens on 9
    with running(h, down) as (w, events):
        # The worker fetches the tasks but cannot read their schema: it must hold them, not dead-letter them.
        wait_until(lambda: len(w._undecoded) == 5, timeout=60, what="the tasks held for the registry")
        assert not events.of(DeadLettered) and not ran
        assert w.heartbeat.healthy()
        w.registry = Registry(real_url)  # the registry is back
        events.count(TaskCompleted, 5)
    assert sorted(ran) == [f"h{i}" for i in range(5)]
    assert not events.of(DeadLettered)


# ------------------------------------------------------------------------------------------------- rebalances
def test_partitions_paused_before_a_rebalance_flow_again_when_they_come_back(
    settings: Settings, task_schema: Callable[..., dict[str, Any]]
) -> None:
    schema = task_schema("Back", ID_FIELDS)
    _register(settings, schema)
    release = threading.Event()
    done: list[str] = []
    h = Handlers()

    @h.task(f"{settings.namespace}.Back", schema=schema)
    def back(payload: dict[str, Any], ctx: Any) -> None:
        release.wait(60)
        done.append(payload["id"])

    n = 120
    tiers = ("critical", "high", "normal", "low")
    with TaskProducer(settings) as producer:
        producer.enqueue_many(
            [
                TaskSpec(
                    task_type=f"{settings.namespace}.Back", payload={"id": f"b{i}"}, priority=tiers[i % 4]
                )
                for i in range(n)
            ]
        )
    with running(h, settings, concurrency=1, buffer_capacity=8, revoke_timeout=1.0) as (w, events):
        # One slot, blocked: the buffers fill and every tier's partitions get paused.
        wait_until(lambda: len(w._paused) == 12, timeout=60, what="the worker to pause all 12 partitions")
        everything = set(w._assigned)
        # Another member joins and takes paused partitions away, then leaves and gives them back.
        other = Source(settings, group=settings.worker_group)
        other.subscribe(Topics(settings.namespace).priority_topics)
        try:
            wait_until(
                lambda: other.poll(1, 0.2) is not None and bool(other.assignment()),
                timeout=60,
                what="the second member to get partitions",
            )
            assert len(w._assigned) < 12 or events.of(PartitionsRevoked)
        finally:
            other.close()
        wait_until(lambda: set(w._assigned) == everything, timeout=60, what="the partitions to come back")
        release.set()
        events.count(TaskCompleted, n, timeout=120)
    assert sorted(done) == sorted(f"b{i}" for i in range(n))


def test_keys_of_a_worker_silent_for_the_configured_stale_after_are_taken_over(
    settings: Settings, task_schema: Callable[..., dict[str, Any]]
) -> None:
    ns = settings.namespace
    schema = task_schema("Charge", ID_FIELDS)
    _register(settings, schema)
    db = Database(settings.database_url, schema=settings.database_schema)
    db.migrate(namespace=ns)
    ghost = IdempotencyStore(db, owner="ghost", namespace=ns)
    record = WorkerRecord("ghost", ns, settings.worker_group, "another-host", 1, 4, datetime.now(UTC))
    ghost.enter(record, bool)
    ghost.claim([ClaimRequest("charge:g", "earlier", f"{ns}.Charge", 3600.0)])
    ghost.close()
    stop = threading.Event()

    def silent_for_five_seconds() -> None:
        # Its last heartbeat stays 5 s old: stale past the worker's stale_after (3 s), fresh within the
        # default (10 s), and its lease runs an hour: only the configured stale_after frees the key.
        with db.connection() as conn:
            while not stop.is_set():
                conn.execute(
                    "UPDATE taskq_workers SET heartbeat_at = now() - interval '5 seconds'"
                    " WHERE worker_id = 'ghost'"
                )
                stop.wait(0.2)

    aging = threading.Thread(target=silent_for_five_seconds, daemon=True)
    aging.start()
    runs: list[str] = []
    h = Handlers()

    @h.task(f"{ns}.Charge", schema=schema)
    def charge(payload: dict[str, Any], ctx: Any) -> None:
        runs.append(ctx.task_id)

    try:
        with TaskProducer(settings) as producer:
            producer.enqueue(f"{ns}.Charge", {"id": "g"}, idempotency_key="charge:g")
        with running(h, settings, stale_after=3.0, heartbeat_interval=1.0) as (_, events):
            events.wait(lambda: events.of(TaskCompleted), timeout=60, what="the ghost's key taken over")
    finally:
        stop.set()
        aging.join(5)
    assert len(runs) == 1
    rows = _query(settings, "SELECT state, takeovers FROM taskq_tasks WHERE idempotency_key = %s", "charge:g")
    assert rows == [{"state": "completed", "takeovers": 1}]


def test_a_started_worker_has_the_connections_of_its_first_reads_and_claims_open_before_any_record(
    settings: Settings,
) -> None:
    # The loop's first read (an operator's pauses) and its first claims come as the first records arrive:
    # their Postgres connections are opened at start, while the first records are fetched, not then.
    w = Worker(
        Handlers(), settings, WorkerConfig(concurrency=1, forwarder=False, relay=False, metrics_port=None)
    )
    w.start()
    try:
        stores = [w.store, w._recorder]
        assert all(isinstance(s, IdempotencyStore) for s in stores)

        def opened() -> bool:
            return all(s.database._conn is not None and not s.database._conn.closed for s in stores)  # type: ignore[union-attr]

        wait_until(opened, timeout=10, what="the store's and the claims' connections")
    finally:
        w.close()
