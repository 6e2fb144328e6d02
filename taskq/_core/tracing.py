"""OpenTelemetry spans of enqueues and attempts, with the `otel` extra (`pip install kafka-taskq[otel]`).

Nothing is traced until the application sets a tracer provider, and nothing of opentelemetry is imported
here: a provider can only be set by a process that imported `opentelemetry.trace`, so until it shows up in
`sys.modules` each task costs one dict lookup, and a process without the extra, or one that does not trace,
never loads it. Spans follow OpenTelemetry's messaging semantic conventions: a `send` span per enqueue,
whose context travels in the `traceparent` header, and a `process` span per attempt, a child of the
enqueue's span and linked to it, current while the handler runs so that the handler's spans are its
children. Retry records and DLQ replays keep the header, so every attempt of a task is in one trace.
"""

from __future__ import annotations

import contextvars
import sys
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from taskq._core.envelope import Envelope

if TYPE_CHECKING:
    from opentelemetry.trace import Span
    from opentelemetry.trace import Tracer as OtelTracer

__all__ = ["Tracer"]


class Tracer:
    """Makes the spans of enqueues and attempts once a tracer provider is set; see the module docstring."""

    def __init__(self) -> None:
        self._on = False
        self._trace: Any = None  # the opentelemetry.trace module, once a provider is set
        self._tracer: OtelTracer | None = None

    def active(self) -> bool:
        """Whether a tracer provider is set (once set it stays: a process sets its provider once)."""
        if self._on:
            return True
        trace = sys.modules.get("opentelemetry.trace")
        if trace is None or isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            return False
        from opentelemetry import context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from taskq import __version__

        self._trace = trace
        self._attach = context.attach
        self._w3c = TraceContextTextMapPropagator()
        self._tracer = trace.get_tracer("taskq", __version__)
        self._on = True
        return True

    def send(self) -> AbstractContextManager[Span]:
        """A context manager around one enqueue: the current `send` span (it records a raised error)."""
        assert self._tracer is not None, "call only when active()"
        return self._tracer.start_as_current_span("send", kind=self._trace.SpanKind.PRODUCER)

    def sent(self, span: Span, topic: str, env: Envelope) -> str:
        """Name and describe an enqueue's span; its context as a `traceparent` header value."""
        span.update_name(f"send {topic}")
        span.set_attributes(
            {
                "messaging.system": "kafka",
                "messaging.operation.type": "send",
                "messaging.operation.name": "send",
                "messaging.destination.name": topic,
                "messaging.message.id": env.task_id,
                "taskq.task_type": env.task_type,
                "taskq.tier": env.priority,
            }
        )
        sc = span.get_span_context()
        return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{sc.trace_flags:02x}"

    def attempt(
        self, env: Envelope, topic: str, attempt: int, group: str, partition: int, offset: int
    ) -> tuple[Span, contextvars.Context]:
        """Start an attempt's `process` span; the context to run its handler in (the span current)."""
        parent = None
        links = []
        if env.traceparent:
            carried = self._w3c.extract({"traceparent": env.traceparent})
            sc = self._trace.get_current_span(carried).get_span_context()
            if sc.is_valid:
                parent, links = carried, [self._trace.Link(sc)]
        assert self._tracer is not None, "call only when active()"
        span = self._tracer.start_span(
            f"process {topic}",
            context=parent,
            kind=self._trace.SpanKind.CONSUMER,
            links=links,
            attributes={
                "messaging.system": "kafka",
                "messaging.operation.type": "process",
                "messaging.operation.name": "process",
                "messaging.destination.name": topic,
                "messaging.destination.partition.id": str(partition),
                "messaging.consumer.group.name": group,
                "messaging.message.id": env.task_id,
                "messaging.kafka.offset": offset,
                "taskq.task_type": env.task_type,
                "taskq.tier": env.priority,
                "taskq.attempt": attempt,
            },
        )
        run_in = contextvars.Context()
        run_in.run(self._attach, self._trace.set_span_in_context(span))
        return span, run_in

    def finish(self, span: Span, outcome: str, error: str | None = None) -> None:
        """End an attempt's span with its outcome (`completed`, `retried`, `dead_lettered`, ...)."""
        span.set_attribute("taskq.outcome", outcome)
        if error is not None:
            span.set_status(self._trace.StatusCode.ERROR, error[:500])
        span.end()
