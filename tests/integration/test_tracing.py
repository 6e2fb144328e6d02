"""OpenTelemetry traces against the real stack: enqueue, a retry through a delay tier, completion."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once

from taskq import Handlers
from taskq._core.db import Database
from taskq._core.envelope import Topics
from taskq._core.settings import Settings
from taskq.consumer.events import TaskCompleted
from taskq.consumer.retry import RetryPolicy
from taskq.consumer.worker import Worker, WorkerConfig
from taskq.producer.outbox import OutboxRelay
from taskq.producer.producer import TaskProducer
from taskq.testing import RecordingHook
from tests.acceptance.helpers import tier_records

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    """Spans of this process, kept in memory, while this module's tests run."""
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider), "a tracer provider is set"
    provider = TracerProvider()
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    trace.set_tracer_provider(provider)
    yield memory
    provider.shutdown()
    # A process sets its provider once; OpenTelemetry's own tests unset it like this, so that the tests
    # after these run untraced, as they would without the extra's tracer provider.
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None


def _named(spans: tuple[ReadableSpan, ...], prefix: str) -> list[ReadableSpan]:
    return sorted((s for s in spans if s.name.startswith(prefix)), key=lambda s: s.start_time or 0)


def _attempts(spans: tuple[ReadableSpan, ...], task_id: str) -> list[ReadableSpan]:
    """The `process` spans of a task's handler calls, in the order they started."""
    calls = _named(spans, "process ")
    return [s for s in calls if (s.attributes or {}).get("messaging.message.id") == task_id]


def _run_until_one_completes(handlers: Handlers, settings: Settings) -> None:
    """Run a worker until it has completed a task, then stop it."""
    events = RecordingHook()
    worker = Worker(handlers, settings, WorkerConfig(concurrency=2, commit_interval=0.2), hooks=[events])
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        events.count(TaskCompleted, 1, timeout=30)
    finally:
        worker.stop()
        thread.join(60)


def test_a_trace_runs_from_enqueue_through_a_retry_to_completion(
    settings: Settings, task_schema: Any, exporter: InMemorySpanExporter
) -> None:
    schema = task_schema("Traced", [{"name": "id", "type": "string"}])
    task_type = f"{settings.namespace}.Traced"
    app = trace.get_tracer("test-app")
    handlers = Handlers()

    @handlers.task(
        task_type, schema=schema, retry=RetryPolicy(max_attempts=3, base=timedelta(milliseconds=50), jitter=0)
    )
    def flaky(payload: dict[str, Any], ctx: Any) -> None:
        with app.start_as_current_span("handler work"):
            pass
        if ctx.attempt == 1:
            raise RuntimeError("the first attempt fails")

    with (
        app.start_as_current_span("request") as request,
        TaskProducer(settings, schemas=[schema], auto_register=True) as producer,
    ):
        receipt = producer.enqueue(task_type, {"id": "a"}, wait=True)
    _run_until_one_completes(handlers, settings)

    spans = exporter.get_finished_spans()
    tier = Topics(settings.namespace, settings.delay_tiers).tier("normal")
    [send] = _named(spans, "send ")
    assert send.kind is trace.SpanKind.PRODUCER and send.name == f"send {tier}"
    assert send.parent is not None and send.parent.span_id == request.get_span_context().span_id
    assert send.attributes is not None and send.attributes["messaging.message.id"] == receipt.task_id
    trace_id, send_id = send.context.trace_id, send.context.span_id

    attempts = _attempts(spans, receipt.task_id)
    assert [(s.attributes or {}).get("taskq.attempt") for s in attempts] == [1, 2]
    assert [(s.attributes or {}).get("taskq.outcome") for s in attempts] == ["retried", "completed"]
    for span in attempts:
        # One trace from the enqueue on, retry included; each attempt a child of the enqueue, linked to it.
        assert span.kind is trace.SpanKind.CONSUMER and span.name == f"process {tier}"
        assert span.context.trace_id == trace_id
        assert span.parent is not None and span.parent.span_id == send_id
        assert [link.context.span_id for link in span.links] == [send_id]
        attributes = span.attributes or {}
        assert attributes["messaging.system"] == "kafka"
        assert attributes["messaging.destination.name"] == tier
        assert attributes["messaging.operation.type"] == "process"
        assert attributes["taskq.task_type"] == task_type
        assert attributes["taskq.tier"] == "normal"
    assert attempts[0].status.status_code is trace.StatusCode.ERROR

    # The handler's own spans are children of the attempt that ran them.
    work = [s for s in _named(spans, "handler work") if s.context.trace_id == trace_id]
    assert sorted(s.parent.span_id for s in work if s.parent) == sorted(s.context.span_id for s in attempts)


def test_a_task_staged_in_the_outbox_keeps_the_context_of_its_enqueue(
    settings: Settings, task_schema: Any, exporter: InMemorySpanExporter
) -> None:
    schema = task_schema("Staged", [{"name": "id", "type": "string"}])
    task_type = f"{settings.namespace}.Staged"
    database = Database(settings.database_url, schema=settings.database_schema)
    try:
        with TaskProducer(settings, schemas=[schema], auto_register=True) as producer:
            with database.connect(autocommit=False) as conn:
                receipt = producer.enqueue(task_type, {"id": "s"}, conn=conn)
                conn.commit()
        with OutboxRelay(settings) as relay:
            assert relay.relay_once() == 1
    finally:
        database.close()
    [send] = [
        s for s in _named(exporter.get_finished_spans(), "send ")
        if (s.attributes or {}).get("messaging.message.id") == receipt.task_id
    ]  # fmt: skip
    tier = Topics(settings.namespace, settings.delay_tiers).tier("normal")
    [record] = [r for r in tier_records(settings) if r.topic == tier]
    # The relay publishes what was staged: the enqueue's context, captured in the caller's transaction.
    sc = send.context
    expected = f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{sc.trace_flags:02x}"
    assert dict(record.headers)["traceparent"] == expected.encode()


def test_a_call_run_again_in_its_group_ends_its_span_as_rerun(
    settings: Settings, task_schema: Any, exporter: InMemorySpanExporter
) -> None:
    # A transactional handler that raises after a statement in a group without savepoints is called again
    # in the same attempt: the first call's span ends too, and says so, instead of never being exported.
    schema = task_schema("Rerun", [{"name": "id", "type": "string"}])
    task_type = f"{settings.namespace}.Rerun"
    handlers = Handlers()
    calls: list[int] = []

    @handlers.task(
        task_type,
        schema=schema,
        transactional=True,
        retry=RetryPolicy(max_attempts=2, base=timedelta(milliseconds=50), jitter=0),
    )
    def flaky(payload: dict[str, Any], ctx: Any) -> None:
        calls.append(trace.get_current_span().get_span_context().span_id)
        ctx.db.execute("SELECT 1")
        if ctx.attempt == 1:
            raise RuntimeError("the first attempt fails")

    with TaskProducer(settings, schemas=[schema], auto_register=True) as producer:
        receipt = producer.enqueue(task_type, {"id": "r"}, wait=True)
    _run_until_one_completes(handlers, settings)

    attempts = _attempts(exporter.get_finished_spans(), receipt.task_id)
    assert len(calls) == 3  # attempt 1 without savepoints, then with them; attempt 2
    assert sorted(calls) == sorted(s.context.span_id for s in attempts)
    ends = [(a["taskq.attempt"], a["taskq.outcome"]) for a in (s.attributes or {} for s in attempts)]
    assert ends == [(1, "rerun"), (1, "retried"), (2, "completed")]
