"""DeadLetters against the real stack: list, show, replay and depth of realistic DLQ records."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client import REGISTRY

from taskq import Handlers, Reject
from taskq._core.db import Database
from taskq._core.envelope import Envelope, H, Topics
from taskq._core.errors import DeliveryError
from taskq._core.kafka import Admin, Record, Sink, Source
from taskq._core.settings import Settings
from taskq.consumer.dlq import DeadLetters, DlqRecordNotFoundError
from taskq.consumer.events import DuplicateSkipped
from taskq.consumer.forwarder import Forwarder
from taskq.consumer.routing import dead_letter_record
from taskq.consumer.store import ClaimRequest, Finished, IdempotencyStore
from taskq.consumer.worker import Worker, WorkerConfig
from taskq.producer.producer import TaskProducer
from taskq.schemas import Registry
from taskq.testing import RecordingHook
from tests.acceptance.helpers import wait_until
from tests.rawkafka import produce_raw

FIELDS = [{"name": "to", "type": "string"}, {"name": "n", "type": "int"}]


@pytest.fixture
def email_type(settings: Settings, task_schema: Callable[..., dict[str, Any]]) -> str:
    with Registry(settings.schema_registry_url) as registry:
        return registry.register(task_schema("SendEmail", FIELDS)).subject


@pytest.fixture
def report_type(settings: Settings, task_schema: Callable[..., dict[str, Any]]) -> str:
    with Registry(settings.schema_registry_url) as registry:
        return registry.register(task_schema("Report", FIELDS)).subject


@pytest.fixture
def dlq(settings: Settings) -> Iterator[DeadLetters]:
    with DeadLetters(settings) as d:
        yield d


@pytest.fixture
def store(settings: Settings) -> Iterator[IdempotencyStore]:
    s = IdempotencyStore(Database(settings.database_url, schema=settings.database_schema), owner="w", namespace=settings.namespace)
    yield s
    s.close()


def read(settings: Settings, tps: list[tuple[str, int, int]], count: int) -> list[Record]:
    """`count` records from these (topic, partition, offset)s, without a group."""
    source = Source(settings, group="test-reader")
    try:
        source.assign(tps)
        out: list[Record] = []

        def enough() -> bool:
            out.extend(source.poll(100, 0.5))
            return len(out) >= count

        wait_until(enough, timeout=30, what=f"{count} records")
        return out
    finally:
        source.close()


def publish(settings: Settings, out: Any) -> None:
    sink = Sink(settings)
    sink.send(out.topic, out.value, key=out.key, headers=out.headers)
    assert sink.flush(30) == 0


def dead_letter(
    settings: Settings,
    store: IdempotencyStore,
    task_type: str,
    n: int,
    *,
    priority: str = "normal",
    state: str = "dead",
    failed_at: datetime | None = None,
) -> Record:
    """Enqueue a real task, consume it, dead-letter its third attempt as a worker would; return the task."""
    with TaskProducer(settings) as producer:
        payload = {"to": f"u{n}@example.com", "n": n}
        receipt = producer.enqueue(task_type, payload, priority=priority, wait=True)
    assert receipt.partition is not None and receipt.offset is not None
    [task] = read(settings, [(receipt.topic, receipt.partition, receipt.offset)], 1)
    env = Envelope.from_headers(task.headers)
    publish_third_attempt(settings, task, failed_at=failed_at)
    store.claim([ClaimRequest(env.idempotency_key, env.task_id, task_type, 60)])
    store.finish([Finished(env.idempotency_key, 1, state, error="smtp down")])  # type: ignore[arg-type]
    return task


def publish_third_attempt(
    settings: Settings, task: Record, *, worker_id: str = "host:1:abc", failed_at: datetime | None = None
) -> None:
    """Dead-letter the third attempt of `task` as a worker would."""
    env = Envelope.from_headers(task.headers)
    # The last attempt came back through a delay tier: attempt 3, with a not-before time.
    third = replace(task, headers=replace(env, attempt=3, not_before=datetime.now(UTC)).to_headers())
    out = dead_letter_record(
        third,
        reason="failed 3 attempt(s): ValueError: smtp down",
        error_type="builtins.ValueError",
        traceback='Traceback (most recent call last):\n  File "h.py", line 1\nValueError: smtp down',
        attempts=3,
        worker_id=worker_id,
        topics=Topics(settings.namespace),
        now=failed_at,
    )
    publish(settings, out)


def publish_garbage(settings: Settings) -> None:
    """Bytes that never became a task, dead-lettered as the worker does with undecodable input."""
    raw = Record(f"{settings.namespace}.normal", 0, 7, None, b"\x01garbage", [], 0)
    publish(
        settings,
        dead_letter_record(
            raw,
            reason="undecodable payload: not Confluent-framed",
            error_type="taskq.DecodeError",
            traceback="",
            attempts=0,
            worker_id="host:1:abc",
            topics=Topics(settings.namespace),
        ),
    )


def test_list_shows_records_with_fields_and_filters(
    settings: Settings, store: IdempotencyStore, dlq: DeadLetters, email_type: str, report_type: str
) -> None:
    old = dead_letter(settings, store, email_type, 1, failed_at=datetime.now(UTC) - timedelta(hours=2))
    email = dead_letter(settings, store, email_type, 2, priority="high")
    dead_letter(settings, store, report_type, 3)
    publish_garbage(settings)

    records = dlq.list()
    assert [r.offset for r in records] == [0, 1, 2, 3]
    rec = records[1]
    env = Envelope.from_headers(email.headers)
    assert (rec.task_id, rec.task_type, rec.idempotency_key, rec.priority) == (
        env.task_id,
        email_type,
        env.idempotency_key,
        "high",
    )
    assert rec.attempts == 3
    assert rec.reason == "failed 3 attempt(s): ValueError: smtp down"
    assert rec.error_type == "builtins.ValueError"
    assert rec.traceback.endswith("ValueError: smtp down")
    assert rec.worker == "host:1:abc"
    assert (rec.topic, rec.partition, rec.original_offset) == (email.topic, email.partition, email.offset)
    assert rec.value == email.value and rec.key == email.key
    assert abs(rec.failed_at - datetime.now(UTC)) < timedelta(minutes=1)
    assert rec.replayed_at is None

    garbage = records[3]
    assert garbage.task_type is None and garbage.idempotency_key is None
    assert garbage.envelope_error and "missing" in garbage.envelope_error
    assert garbage.value == b"\x01garbage"

    assert [r.offset for r in dlq.list(task_type=email_type)] == [0, 1]
    assert [r.offset for r in dlq.list(task_type=report_type)] == [2]
    assert [r.offset for r in dlq.list(since=timedelta(hours=1))] == [1, 2, 3]
    assert records[0].idempotency_key == Envelope.from_headers(old.headers).idempotency_key
    assert [r.offset for r in dlq.list(limit=2)] == [0, 1]
    assert dlq.list(task_type=email_type, since=timedelta(hours=1), limit=5)[0].offset == 1


def test_show_decodes_payload_and_copes_with_garbage(
    settings: Settings, store: IdempotencyStore, dlq: DeadLetters, email_type: str
) -> None:
    dead_letter(settings, store, email_type, 5)
    publish_garbage(settings)

    rec = dlq.show(0)
    assert rec.payload == {"to": "u5@example.com", "n": 5} and rec.payload_error is None
    full = rec.to_dict(full=True)
    assert full["headers"][H + "task-type"] == email_type
    assert full["headers"][H + "dlq-reason"].startswith("failed 3 attempt(s)")
    assert "ValueError: smtp down" in full["traceback"]

    bad = dlq.show(1)
    assert bad.payload is None and bad.payload_error and "magic byte" in bad.payload_error
    assert bad.to_dict(full=True)["value_hex"] == b"\x01garbage".hex()

    with pytest.raises(DlqRecordNotFoundError, match="offset 9"):
        dlq.show(9)


def test_replay_reenqueues_the_original_task_at_attempt_one(
    settings: Settings, store: IdempotencyStore, dlq: DeadLetters, email_type: str
) -> None:
    task = dead_letter(settings, store, email_type, 1, priority="high")
    env = Envelope.from_headers(task.headers)
    assert dlq.depth() == 1
    assert REGISTRY.get_sample_value("taskq_dlq_depth") == 1

    [result] = dlq.replay([0])
    assert result.replayed and result.topic == f"{settings.namespace}.high"
    assert (result.task_id, result.idempotency_key, result.replays) == (env.task_id, env.idempotency_key, 1)
    assert not result.already_completed

    [again] = read(settings, [(task.topic, task.partition, task.offset + 1)], 1)
    assert again.key == task.key and again.value == task.value
    replayed = Envelope.from_headers(again.headers)
    assert (replayed.task_id, replayed.idempotency_key) == (env.task_id, env.idempotency_key)
    assert replayed.priority == "high"
    assert replayed.attempt == 1 and replayed.not_before is None
    assert not [k for k, _ in again.headers if k.startswith(H + "dlq-")]

    row = store.get(env.idempotency_key)
    assert row is not None and (row["state"], row["attempts"]) == ("failed", 0)
    assert dlq.depth() == 0
    assert REGISTRY.get_sample_value("taskq_dlq_depth") == 0
    assert dlq.list() == []
    [listed] = dlq.list(include_replayed=True)
    assert listed.replayed_at is not None and listed.replays == 1

    [refused] = dlq.replay([0])
    assert not refused.replayed and refused.refused and "already replayed" in refused.refused
    assert Admin(settings).end_offsets([task.topic])[task.tp] == task.offset + 2  # nothing sent

    [forced] = dlq.replay([0], force=True)
    assert forced.replayed and forced.replays == 2
    assert Admin(settings).end_offsets([task.topic])[task.tp] == task.offset + 3


def test_replay_of_a_completed_key_reports_it(
    settings: Settings, store: IdempotencyStore, dlq: DeadLetters, email_type: str
) -> None:
    task = dead_letter(settings, store, email_type, 1, state="completed")
    [result] = dlq.replay([0])
    assert result.replayed and result.already_completed
    row = store.get(Envelope.from_headers(task.headers).idempotency_key)
    assert row is not None and row["state"] == "completed"


def test_garbage_is_listed_but_refused_on_replay(
    settings: Settings, store: IdempotencyStore, dlq: DeadLetters, email_type: str
) -> None:
    publish_garbage(settings)
    dead_letter(settings, store, email_type, 1)
    results = dlq.replay(all=True)
    assert [(r.offset, r.replayed) for r in results] == [(0, False), (1, True)]
    assert results[0].refused and results[0].refused.startswith("not a task: header")
    assert "is missing" in results[0].refused
    assert dlq.depth() == 1  # the garbage stays for an operator to read
    assert [r.offset for r in dlq.list()] == [0]


def test_a_dlq_record_whose_header_key_is_not_utf8_is_listed_shown_and_refused(
    settings: Settings, store: IdempotencyStore, dlq: DeadLetters, email_type: str
) -> None:
    dead_letter(settings, store, email_type, 1)
    dlq_topic = Topics(settings.namespace).dlq
    produce_raw(settings.bootstrap_servers, dlq_topic, 0, key=None, value=b"v", headers=[(b"\xff\xfe", b"x")])
    listed = dlq.list()
    assert [r.offset for r in listed] == [0, 1]
    assert listed[1].envelope_error and "not valid UTF-8" in listed[1].envelope_error
    assert dlq.show(1).value == b"v"
    results = dlq.replay(all=True)
    assert [(r.offset, r.replayed) for r in results] == [(0, True), (1, False)]
    assert results[1].refused and results[1].refused.startswith("not a task")


def test_replay_names_missing_offsets_and_replays_nothing(
    settings: Settings, store: IdempotencyStore, dlq: DeadLetters, email_type: str
) -> None:
    dead_letter(settings, store, email_type, 1)
    with pytest.raises(DlqRecordNotFoundError, match="offset 4"):
        dlq.replay([0, 4])
    assert dlq.depth() == 1
    with pytest.raises(ValueError):
        dlq.replay()
    with pytest.raises(ValueError):
        dlq.replay([0], all=True)


def test_a_replay_whose_send_fails_stays_unreplayed(
    settings: Settings,
    store: IdempotencyStore,
    dlq: DeadLetters,
    email_type: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dead_letter(settings, store, email_type, 1)

    def broker_down(*args: object) -> None:
        raise DeliveryError("no acknowledgement")

    monkeypatch.setattr(dlq, "_send", broker_down)
    with pytest.raises(DeliveryError):
        dlq.replay([0])
    assert dlq.depth() == 1 and dlq.list()[0].replayed_at is None  # the mark rolled back with the send
    monkeypatch.undo()
    [result] = dlq.replay([0])
    assert result.replayed and result.replays == 1


def test_worker_dead_letters_then_replay_runs_once_after_the_fix(
    settings: Settings, dlq: DeadLetters, email_type: str
) -> None:
    """A real worker: rejected into the DLQ, fixed, replayed once; a forced second replay is skipped."""
    handlers = Handlers()
    broken = threading.Event()
    broken.set()
    effects: list[tuple[str, int]] = []
    events = RecordingHook()

    @handlers.task(email_type)
    def send(payload: dict[str, Any], ctx: Any) -> None:
        if broken.is_set():
            raise Reject("mailbox does not exist")
        effects.append((ctx.idempotency_key, ctx.attempt))

    worker = Worker(
        handlers,
        settings,
        WorkerConfig(concurrency=1, commit_interval=0.2),
        hooks=[events],
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        with TaskProducer(settings) as producer:
            producer.enqueue(email_type, {"to": "a@example.com", "n": 1}, idempotency_key="mail:1", wait=True)
        wait_until(lambda: dlq.depth() == 1, timeout=60, what="the rejected task in the DLQ")
        [rec] = dlq.list()
        assert rec.idempotency_key == "mail:1" and rec.reason.startswith("rejected by handler")

        broken.clear()
        [result] = dlq.replay([rec.offset])
        assert result.replayed
        wait_until(lambda: effects, timeout=60, what="the replayed task to run")
        assert effects == [("mail:1", 1)]

        assert not dlq.replay([rec.offset])[0].replayed
        assert dlq.replay([rec.offset], force=True)[0].already_completed
        events.count(DuplicateSkipped, 1)
        assert effects == [("mail:1", 1)]
    finally:
        worker.stop()
        thread.join(60)
    assert not thread.is_alive()


def test_list_reaches_the_end_past_a_transaction_marker(
    settings: Settings, dlq: DeadLetters, store: IdempotencyStore, email_type: str
) -> None:
    # The forwarder dead-letters in transactions: its commit marker takes the last offset of the DLQ,
    # which no consumer ever receives. Listing must still end there, not wait for a record at it.
    dead_letter(settings, store, email_type, 1)
    [only] = dlq.list()
    sink = Sink(settings, transactional_id=f"{settings.namespace}.test-forwarder")
    sink.init_transactions()
    sink.begin()
    out = dead_letter_record(
        Record(f"{settings.namespace}.delay.1s", 0, 7, None, b"\0", [], 0),
        reason="bad envelope on a delay topic",
        error_type="taskq.EnvelopeError",
        traceback="",
        attempts=0,
        worker_id="fwd",
        topics=Topics(settings.namespace),
    )
    sink.send(out.topic, out.value, key=out.key, headers=out.headers)
    sink.commit()
    records = dlq.list()
    assert [r.offset for r in records] == [only.offset, only.offset + 1]


def test_depth_counts_records_not_the_forwarders_transaction_markers(
    settings: Settings, dlq: DeadLetters, store: IdempotencyStore, email_type: str
) -> None:
    # The forwarder dead-letters in transactions, and each commit marker takes an offset of the DLQ:
    # two records then span three offsets. The depth is the records, and stays right as the DLQ grows.
    dead_letter(settings, store, email_type, 1)
    sink = Sink(settings)  # not a task, on a delay topic: the forwarder dead-letters it
    delay_topic = Topics(settings.namespace, settings.delay_tiers).delay_topics[0]
    sink.send(delay_topic, b"\x01garbage", key=None, headers=[])
    assert sink.flush(30) == 0
    forwarder = Forwarder(settings)
    forwarder.start()
    try:
        wait_until(lambda: forwarder.step() >= 1, timeout=60, what="the forwarder's DLQ record")
    finally:
        forwarder.close()
    dlq_tp = (Topics(settings.namespace).dlq, 0)
    assert Admin(settings).end_offsets([dlq_tp[0]])[dlq_tp] == 3  # two records and a commit marker
    assert [r.reason.split(":")[0] for r in dlq.list()] == [
        "failed 3 attempt(s)",
        "bad envelope on a delay topic",
    ]
    assert dlq.depth() == 2
    assert REGISTRY.get_sample_value("taskq_dlq_depth") == 2

    dlq.replay([0])
    publish_garbage(settings)  # read on from where the last count stopped
    assert dlq.depth() == 2


def test_a_task_dead_lettered_twice_in_the_repeat_window_is_listed_once_and_stays_hidden_once_replayed(
    settings: Settings, dlq: DeadLetters, store: IdempotencyStore, email_type: str
) -> None:
    # A worker killed between the DLQ acknowledgement and the 'dead' write leaves the task's offset
    # uncommitted: its redelivery is dead-lettered again by the next worker, from the same original record.
    task = dead_letter(settings, store, email_type, 1)
    env = Envelope.from_headers(task.headers)
    publish_third_attempt(settings, task, worker_id="host:2:def")
    publish_garbage(settings)
    publish_garbage(settings)  # the same undecodable record, dead-lettered twice likewise
    listed = dlq.list()
    assert [(r.task_id, r.attempts) for r in listed] == [(env.task_id, 3), (None, 0)], listed
    assert dlq.replay([listed[0].offset])[0].replayed
    assert [r.task_id for r in dlq.list()] == [None]  # the copy of the replayed record stays hidden
    assert len(dlq.list(include_replayed=True)) == 2
