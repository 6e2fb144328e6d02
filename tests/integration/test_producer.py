"""TaskProducer against the real stack: wire format, refusals that send nothing, shared rate limits, depth limits."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from taskq import (
    DeliveryError,
    InvalidPriorityError,
    InvalidTaskError,
    PayloadTooLargeError,
    PayloadValidationError,
    QueueFullError,
    RateLimit,
    RateLimitedError,
    Settings,
    TaskProducer,
    TaskSpec,
    UnknownTaskTypeError,
)
from taskq._core.envelope import PRIORITIES, Envelope, Topics
from taskq._core.kafka import Admin, Record, Source
from taskq.producer.ratelimit import SharedBucket
from taskq.schemas import Registry, avro

FIELDS = [
    {"name": "to", "type": "string"},
    {"name": "n", "type": "int"},
    {"name": "body", "type": "string", "default": ""},
]


@pytest.fixture
def email_type(settings: Settings, task_schema: Callable[..., dict[str, Any]]) -> str:
    """A registered task type in the test's namespace; returns its name."""
    schema = task_schema("SendEmail", FIELDS, write_to="send_email.avsc")
    with Registry(settings.schema_registry_url) as registry:
        return registry.register(schema).subject


@pytest.fixture
def producer(settings: Settings) -> Iterator[TaskProducer]:
    with TaskProducer(settings) as p:
        yield p


def _all_topics(settings: Settings) -> list[str]:
    t = Topics(settings.namespace, settings.delay_tiers)
    return [*t.priority_topics, *t.delay_topics, t.dlq]


def _read(settings: Settings, topics: list[str], n: int) -> list[Record]:
    """The first n records of these topics, read from offset 0 without joining a group."""
    partitions = Admin(settings).partitions(topics)
    source = Source(settings, group=f"{settings.namespace}.reader")
    source.assign([(t, p, 0) for t, count in partitions.items() for p in range(count)])
    got: list[Record] = []
    try:
        for _ in range(100):
            got += source.poll(n, 0.5)
            if len(got) >= n:
                return got
        raise AssertionError(f"read {len(got)} of {n} records from {topics}")
    finally:
        source.close()


# ---------------------------------------------------------------------------------------------- wire format
def test_each_priority_lands_on_its_topic_as_framed_avro_with_the_envelope(
    settings: Settings, email_type: str, producer: TaskProducer
) -> None:
    receipts = {
        p: producer.enqueue(
            email_type, {"to": f"{p}@example.com", "n": i}, priority=p, max_attempts=4, timeout=9.5, wait=True
        )
        for i, p in enumerate(PRIORITIES)
    }
    topics = Topics(settings.namespace)
    with Registry(settings.schema_registry_url) as fresh:  # no cache: ids must resolve in the registry itself
        for i, p in enumerate(PRIORITIES):
            receipt = receipts[p]
            assert receipt.topic == topics.tier(p) == f"{settings.namespace}.{p}"
            (record,) = _read(settings, [receipt.topic], 1)
            assert (record.partition, record.offset) == (receipt.partition, receipt.offset)
            assert record.value is not None and record.value[0] == 0  # Confluent magic byte
            schema_id, body = avro.split_frame(record.value)
            assert avro.decode(body, fresh.by_id(schema_id)) == {"to": f"{p}@example.com", "n": i, "body": ""}
            env = Envelope.from_headers(record.headers)
            assert env.task_id == receipt.task_id
            assert env.task_type == email_type
            assert env.priority == p
            assert env.idempotency_key == receipt.idempotency_key
            assert (env.attempt, env.max_attempts, env.timeout) == (1, 4, 9.5)
            assert env.origin_topic == receipt.topic
            assert env.not_before is None
            assert abs(env.enqueued_at - datetime.fromtimestamp(record.timestamp_ms / 1000, UTC)) < timedelta(
                seconds=60
            )
            # No key given: the record is keyed by the idempotency key.
            assert record.key == receipt.idempotency_key.encode()


def test_keys_derived_and_explicit(settings: Settings, email_type: str, producer: TaskProducer) -> None:
    first = producer.enqueue(email_type, {"to": "a@example.com", "n": 1}, wait=True)
    again = producer.enqueue(email_type, {"n": 1, "to": "a@example.com"}, wait=True)
    other = producer.enqueue(email_type, {"to": "a@example.com", "n": 2}, wait=True)
    explicit = producer.enqueue(
        email_type, {"to": "a@example.com", "n": 1}, idempotency_key="email:42", key="customer-7", wait=True
    )
    assert first.idempotency_key == again.idempotency_key  # same payload, same key: one effect
    assert first.task_id != again.task_id
    assert other.idempotency_key != first.idempotency_key
    assert explicit.idempotency_key == "email:42"

    records = {Envelope.from_headers(r.headers).task_id: r for r in _read(settings, [first.topic], 4)}
    assert records[first.task_id].key == records[again.task_id].key == first.idempotency_key.encode()
    assert Envelope.from_headers(records[explicit.task_id].headers).idempotency_key == "email:42"
    assert records[explicit.task_id].key == b"customer-7"  # the ordering key wins over the idempotency key


@pytest.mark.parametrize(
    ("delay", "tier"),
    [
        (timedelta(milliseconds=400), "1s"),
        (1, "1s"),
        (timedelta(seconds=20), "30s"),
        (timedelta(minutes=3), "10m"),
        ("absolute 90s", "2m"),
        (timedelta(days=2), "1h"),  # longer than every tier: the largest holds it until its time
    ],
)
def test_delayed_tasks_go_to_the_smallest_delay_tier_that_fits(
    settings: Settings, email_type: str, producer: TaskProducer, delay: Any, tier: str
) -> None:
    before = datetime.now(UTC)
    if delay == "absolute 90s":
        delay = before + timedelta(seconds=90)
    span = delay - before if isinstance(delay, datetime) else delay
    span = span if isinstance(span, timedelta) else timedelta(seconds=span)
    receipt = producer.enqueue(
        email_type, {"to": "a@example.com", "n": 1}, priority="high", delay=delay, wait=True
    )
    after = datetime.now(UTC)
    assert receipt.topic == f"{settings.namespace}.delay.{tier}"
    (record,) = _read(settings, [receipt.topic], 1)
    env = Envelope.from_headers(record.headers)
    assert env.origin_topic == f"{settings.namespace}.high"  # the forwarder releases it to its tier
    assert env.priority == "high"
    assert env.not_before is not None
    ms = timedelta(milliseconds=1)
    if isinstance(delay, datetime):
        assert abs(env.not_before - delay) < ms
    else:
        assert before + span - ms <= env.not_before <= after + span
    assert receipt.not_before is not None and abs(receipt.not_before - env.not_before) < ms


# --------------------------------------------------------------------------------- refusals send nothing
def test_each_invalid_input_raises_its_error_and_sends_nothing(
    settings: Settings,
    email_type: str,
    producer: TaskProducer,
    task_schema: Callable[..., dict[str, Any]],
    tmp_path: Path,
) -> None:
    admin = Admin(settings)
    topics = _all_topics(settings)
    ok = {"to": "a@example.com", "n": 1}
    task_schema("NeverRegistered", FIELDS, write_to="never.avsc")

    def with_producer(fn: Callable[[TaskProducer], Any], **kwargs: Any) -> Callable[[], Any]:
        def run() -> Any:
            with TaskProducer(settings, **kwargs) as p:
                return fn(p)

        return run

    cases: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
        (
            "wrong type",
            lambda: producer.enqueue(email_type, {"to": "a", "n": "one"}),
            PayloadValidationError,
            "n",
        ),
        ("missing field", lambda: producer.enqueue(email_type, {"n": 1}), PayloadValidationError, "to"),
        (
            "unknown field",
            lambda: producer.enqueue(email_type, {**ok, "cc": "b"}),
            PayloadValidationError,
            "cc",
        ),
        ("not a mapping", lambda: producer.enqueue(email_type, ["a", 1]), PayloadValidationError, "object"),  # type: ignore[arg-type]
        (
            "unregistered type",
            lambda: producer.enqueue(f"{settings.namespace}.Nope", ok),
            UnknownTaskTypeError,
            f"{settings.namespace}.Nope",
        ),
        (
            "unregistered schema file",
            with_producer(
                lambda p: p.enqueue(f"{settings.namespace}.NeverRegistered", ok),
                schemas=[tmp_path / "never.avsc"],
            ),
            UnknownTaskTypeError,
            "not registered",
        ),
        (
            "bad priority",
            lambda: producer.enqueue(email_type, ok, priority="urgent"),
            InvalidPriorityError,
            "urgent",
        ),
        (
            "too large",
            with_producer(lambda p: p.enqueue(email_type, {**ok, "body": "x" * 200}), max_payload_bytes=100),
            PayloadTooLargeError,
            "limit of 100",
        ),
        ("delay as text", lambda: producer.enqueue(email_type, ok, delay="5s"), InvalidTaskError, "delay"),  # type: ignore[arg-type]
        ("delay NaN", lambda: producer.enqueue(email_type, ok, delay=math.nan), InvalidTaskError, "delay"),
        (
            "naive datetime",
            lambda: producer.enqueue(email_type, ok, delay=datetime.now()),
            InvalidTaskError,
            "timezone-aware",
        ),
        ("zero timeout", lambda: producer.enqueue(email_type, ok, timeout=0), InvalidTaskError, "timeout"),
        (
            "negative timeout",
            lambda: producer.enqueue(email_type, ok, timeout=timedelta(seconds=-1)),
            InvalidTaskError,
            "timeout",
        ),
        (
            "zero max_attempts",
            lambda: producer.enqueue(email_type, ok, max_attempts=0),
            InvalidTaskError,
            "max_attempts",
        ),
        (
            "fractional max_attempts",
            lambda: producer.enqueue(email_type, ok, max_attempts=1.5),
            InvalidTaskError,  # type: ignore[arg-type]
            "max_attempts",
        ),
        (
            "empty idempotency key",
            lambda: producer.enqueue(email_type, ok, idempotency_key=""),
            InvalidTaskError,
            "idempotency_key",
        ),
        (
            "one bad task in a batch",
            lambda: producer.enqueue_many(
                [
                    TaskSpec(task_type=email_type, payload=ok),
                    TaskSpec(task_type=email_type, payload=ok, priority="critical"),
                    TaskSpec(task_type=email_type, payload={"to": "a", "n": 2**40}, priority="low"),
                ]
            ),
            PayloadValidationError,
            "n",
        ),
    ]
    producer.flush()
    before = admin.end_offsets(topics)
    assert before and set(before.values()) == {0}
    for name, call, error, mention in cases:
        with pytest.raises(error) as info:
            call()
        assert mention in str(info.value), f"{name}: {info.value}"
        if isinstance(info.value, PayloadValidationError) and name != "not a mapping":
            assert info.value.field == mention, name  # the error names the field
    producer.flush()
    assert admin.end_offsets(topics) == before, "a refused enqueue sent something"

    # The measurement sees a send: a valid batch lands whole.
    receipts = producer.enqueue_many(
        [
            TaskSpec(task_type=email_type, payload={**ok, "n": i}, priority=p)
            for i, p in enumerate(PRIORITIES)
        ],
        wait=True,
    )
    assert [r.topic for r in receipts] == [f"{settings.namespace}.{p}" for p in PRIORITIES]
    after = admin.end_offsets(topics)
    assert sum(after.values()) - sum(before.values()) == len(PRIORITIES)


def test_a_given_schema_file_that_is_registered_is_used(
    settings: Settings, email_type: str, tmp_path: Path
) -> None:
    with TaskProducer(settings, schemas=[tmp_path / "send_email.avsc"]) as p:
        receipt = p.enqueue(email_type, {"to": "a@example.com", "n": 1}, wait=True)
    (record,) = _read(settings, [receipt.topic], 1)
    with Registry(settings.schema_registry_url) as registry:
        assert avro.split_frame(record.value)[0] == registry.latest(email_type).schema_id


# ------------------------------------------------------------------------------------------- rate limits
def test_an_exhausted_local_limit_refuses_with_a_retry_after(settings: Settings, email_type: str) -> None:
    admin = Admin(settings)
    with TaskProducer(settings, rate_limits=[RateLimit(rate=0.5, burst=2, priority="low")]) as p:
        p.enqueue(email_type, {"to": "a", "n": 1}, priority="low")
        p.enqueue(email_type, {"to": "a", "n": 2}, priority="low")
        p.flush()
        before = admin.end_offsets(_all_topics(settings))
        with pytest.raises(RateLimitedError) as info:
            p.enqueue(email_type, {"to": "a", "n": 3}, priority="low")
        assert 0 < info.value.retry_after <= 2.0  # one token at 0.5/s
        assert info.value.bucket == f"{settings.namespace}:*:low"
        p.enqueue(email_type, {"to": "a", "n": 4}, priority="normal")  # other tiers are not limited
        p.flush()
    after = admin.end_offsets(_all_topics(settings))
    assert sum(after.values()) - sum(before.values()) == 1


def test_an_exhausted_shared_limit_refuses_with_a_retry_after(settings: Settings, email_type: str) -> None:
    limit = RateLimit(rate=0.5, burst=1, task_type=email_type, shared=True)
    with TaskProducer(settings, rate_limits=[limit]) as p:
        p.enqueue(email_type, {"to": "a", "n": 1})
        with pytest.raises(RateLimitedError) as info:
            p.enqueue(email_type, {"to": "a", "n": 2})
    assert 0 < info.value.retry_after <= 2.0


def test_a_lone_producer_pays_one_database_round_trip_per_lease(
    settings: Settings, email_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[float] = []
    take = SharedBucket._take_from_db

    def counted(self: SharedBucket, want: float) -> float:
        calls.append(want)
        return take(self, want)

    monkeypatch.setattr(SharedBucket, "_take_from_db", counted)
    n, rate = 2000, 10_000
    with TaskProducer(settings, rate_limits=[RateLimit(rate=rate, burst=rate, shared=True)]) as p:
        (bucket,) = [b for _, b in p._limiter._buckets]
        assert isinstance(bucket, SharedBucket)
        for i in range(n):
            p.enqueue(email_type, {"to": "a@example.com", "n": i}, idempotency_key=f"k{i}")
    assert bucket.lease > 1
    assert len(calls) <= math.ceil(n / bucket.lease) + 1, f"{len(calls)} round trips for {n} enqueues"


PRODUCER_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from taskq import RateLimit, RateLimitedError, Settings, TaskProducer

    task_type, rate, burst, duration = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    limit = RateLimit(rate=rate, burst=burst, priority="high", shared=True)
    granted = refused = 0
    retry_afters = []
    with TaskProducer(Settings.from_env(), rate_limits=[limit]) as producer:
        # Warm up (schema fetched, broker connected) on an unlimited tier, then wait for the start signal.
        producer.enqueue(task_type, {"to": "warm", "n": 0}, wait=True)
        print("ready", flush=True)
        sys.stdin.readline()
        start = time.time()
        while time.time() - start < duration:
            try:
                producer.enqueue(task_type, {"to": "x", "n": granted}, priority="high")
                granted += 1
            except RateLimitedError as exc:
                refused += 1
                retry_afters.append(exc.retry_after)
                time.sleep(min(exc.retry_after, 0.02))  # a polite client backs off
        end = time.time()
    print(json.dumps({"granted": granted, "refused": refused, "start": start, "end": end,
                      "min_retry_after": min(retry_afters, default=None)}), flush=True)
    """
)


def test_two_processes_sharing_a_bucket_get_no_more_than_rate_times_time_plus_capacity(
    settings: Settings, email_type: str, env_of: Callable[..., dict[str, str]]
) -> None:
    rate, burst, duration = 40.0, 10.0, 1.5
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PRODUCER_SCRIPT, email_type, str(rate), str(burst), str(duration)],
            env=env_of(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        for proc in procs:  # both start together, so they contend for the same tokens
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = [json.loads(proc.communicate(timeout=60)[0]) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert all(proc.returncode == 0 for proc in procs)
    # Every token granted left Postgres between the earliest start and the latest end.
    elapsed = max(r["end"] for r in results) - min(r["start"] for r in results)
    granted = sum(r["granted"] for r in results)
    assert granted <= rate * elapsed + burst + 1, (granted, elapsed, results)
    # Both drew from the bucket and both were refused at times: they really shared it.
    assert all(r["granted"] > 0 and r["refused"] > 0 for r in results), results
    assert all(r["min_retry_after"] > 0 for r in results), results


# ------------------------------------------------------------------------------------------ depth limits
def _wait_for_depth(producer: TaskProducer, tier: str, depth: int) -> None:
    deadline = time.monotonic() + 30
    while producer.depth().get(tier) != depth:
        assert time.monotonic() < deadline, f"depth of {tier} stayed {producer.depth()}, expected {depth}"
        time.sleep(0.05)


def test_a_full_tier_refuses_until_the_worker_group_commits_past_the_backlog(
    settings: Settings, email_type: str
) -> None:
    admin = Admin(settings)
    low = f"{settings.namespace}.low"
    with TaskProducer(settings, depth_limits={"low": 3}, depth_refresh=0.1) as p:
        for i in range(3):
            p.enqueue(email_type, {"to": "a", "n": i}, priority="low", wait=True)
        _wait_for_depth(p, "low", 3)
        before = admin.end_offsets(_all_topics(settings))
        with pytest.raises(QueueFullError) as info:
            p.enqueue(email_type, {"to": "a", "n": 3}, priority="low")
        assert (info.value.priority, info.value.depth, info.value.limit) == ("low", 3, 3)
        assert "depth limit of 3" in str(info.value)
        p.flush()
        assert admin.end_offsets(_all_topics(settings)) == before
        p.enqueue(email_type, {"to": "a", "n": 4}, priority="normal", wait=True)  # no limit on normal

        # The workers' group consumes the backlog and commits past it.
        source = Source(settings, group=settings.worker_group)
        try:
            source.assign([(low, part, 0) for part in range(admin.partitions([low])[low])])
            records: list[Record] = []
            for _ in range(100):
                records += source.poll(10, 0.5)
                if len(records) >= 3:
                    break
            assert len(records) == 3
            source.commit({r.tp: r.offset + 1 for r in records})
        finally:
            source.close()
        _wait_for_depth(p, "low", 0)
        receipt = p.enqueue(email_type, {"to": "a", "n": 5}, priority="low", wait=True)
    assert receipt.topic == low


def test_a_task_the_broker_never_takes_surfaces_on_flush_and_on_wait(
    settings: Settings, email_type: str
) -> None:
    # Another namespace whose topics were never created (and the broker does not auto-create them).
    orphan = settings.with_namespace(settings.namespace + "x")
    reported: list[tuple[str, str | None]] = []
    producer = TaskProducer(
        orphan,
        kafka_config={"message.timeout.ms": 1500},
        on_delivery=lambda receipt, err: reported.append((receipt.task_id, err)),
    )
    try:
        receipt = producer.enqueue(email_type, {"to": "a@example.com", "n": 1})
        with pytest.raises(DeliveryError) as raised:
            producer.flush(30)
        assert [task_id for task_id, _ in raised.value.failures] == [receipt.task_id]
        assert reported and reported[0][0] == receipt.task_id and reported[0][1]
        with pytest.raises(DeliveryError):
            producer.enqueue(email_type, {"to": "b@example.com", "n": 2}, wait=True)
        producer.flush(30)  # each failure is reported once: nothing is left to raise
    finally:
        producer.close(5)


def test_a_task_the_broker_never_takes_surfaces_on_flush_without_a_delivery_hook(
    settings: Settings, email_type: str
) -> None:
    # Without a hook and without wait, records carry no callback of their own: the sink reports failures.
    orphan = settings.with_namespace(settings.namespace + "y")
    producer = TaskProducer(orphan, kafka_config={"message.timeout.ms": 1500})
    try:
        first = producer.enqueue(email_type, {"to": "a@example.com", "n": 1})
        second = producer.enqueue(email_type, {"to": "b@example.com", "n": 2})
        with pytest.raises(DeliveryError) as raised:
            producer.flush(30)
        assert sorted(task_id for task_id, _ in raised.value.failures) == sorted(
            [first.task_id, second.task_id]
        )
        assert all(err for _, err in raised.value.failures)
        producer.flush(30)  # each failure is reported once
    finally:
        producer.close(5)
