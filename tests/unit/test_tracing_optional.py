"""Tracing is optional: without the otel extra, or with it and no tracer provider, nothing of opentelemetry
is imported and tasks run as before; with a provider, retries and DLQ replays keep the trace."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

# Runs a task that fails once (a retry), and one rejected into the DLQ and replayed, on the in-memory fakes.
SCRIPT = textwrap.dedent(
    """
    import json, sys

    mode = sys.argv[1]
    if mode == "absent":
        class Blocked:
            def find_spec(self, name, path=None, target=None):
                if name == "opentelemetry" or name.startswith("opentelemetry."):
                    raise ImportError(f"No module named {name!r} (blocked)")
                return None
        sys.meta_path.insert(0, Blocked())
    elif mode == "sdk":
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        trace.set_tracer_provider(TracerProvider())

    from taskq import Handlers, Reject
    from taskq.testing import InMemoryQueue

    JOB = {"type": "record", "name": "Job", "namespace": "unit", "fields": [{"name": "n", "type": "long"}]}
    handlers = Handlers()
    seen = []

    @handlers.task("unit.Job", schema=JOB, max_attempts=3)
    def job(payload, ctx):
        seen.append((payload["n"], ctx.attempt, ctx.headers.get("traceparent", b"").decode()))
        if payload["n"] == 1 and ctx.attempt == 1:
            raise RuntimeError("fails once")
        if payload["n"] == 2 and len([s for s in seen if s[0] == 2]) == 1:
            raise Reject("not yet")

    with InMemoryQueue(handlers) as q:
        q.producer.enqueue("unit.Job", {"n": 1})
        q.producer.enqueue("unit.Job", {"n": 2})
        q.run_until_idle()
        [dead] = q.dead_letters
        [replay] = q.dlq.replay([dead.offset])
        assert replay.replayed
        q.run_until_idle()
        completed = len(q.completed)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")
    print(json.dumps({"seen": seen, "completed": completed, "otel_modules": loaded}))
    """
)


def run(mode: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_without_the_extra_nothing_of_opentelemetry_is_imported_and_tasks_run() -> None:
    result = run("absent")
    assert result["otel_modules"] == []
    assert result["completed"] == 2
    assert {tp for _, _, tp in result["seen"]} == {""}  # type: ignore[attr-defined]


def test_without_a_tracer_provider_nothing_is_traced_or_imported() -> None:
    result = run("installed")
    assert result["otel_modules"] == []  # a process that does not trace never pays for loading it
    assert result["completed"] == 2
    assert {tp for _, _, tp in result["seen"]} == {""}  # type: ignore[attr-defined]


def test_retries_and_dlq_replays_keep_the_enqueue_trace_context() -> None:
    result = run("sdk")
    assert result["completed"] == 2
    runs: dict[int, list[str]] = {}
    for n, _, traceparent in result["seen"]:  # type: ignore[attr-defined]
        runs.setdefault(n, []).append(traceparent)
    # Every run of a task, the retry's and the replay's included, carries the context of its enqueue.
    assert len(runs[1]) == 2 and len(set(runs[1])) == 1 and runs[1][0].startswith("00-")
    assert len(runs[2]) == 2 and len(set(runs[2])) == 1 and runs[2][0].startswith("00-")
    assert runs[1][0] != runs[2][0]


HANDLER_SPANS = textwrap.dedent(
    """
    import json
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    trace.set_tracer_provider(provider)
    app = trace.get_tracer("app")

    from taskq import Handlers
    from taskq.testing import InMemoryQueue

    def schema(name):
        fields = [{"name": "n", "type": "long"}]
        return {"type": "record", "name": name, "namespace": "unit", "fields": fields}

    handlers = Handlers()

    @handlers.task("unit.Sync", schema=schema("Sync"))
    def sync(payload, ctx):
        with app.start_as_current_span("sync work"):
            pass

    @handlers.task("unit.Async", schema=schema("Async"))
    async def in_loop(payload, ctx):
        with app.start_as_current_span("async work"):
            pass

    with InMemoryQueue(handlers) as q:
        for n in range(3):
            q.producer.enqueue("unit.Sync", {"n": n})
            q.producer.enqueue("unit.Async", {"n": n})
        q.run_until_idle()
    spans = memory.get_finished_spans()
    consumer = trace.SpanKind.CONSUMER
    attempts = {s.context.span_id: s.attributes["taskq.task_type"] for s in spans if s.kind == consumer}
    work = [(s.name, attempts.get(s.parent.span_id) if s.parent else None) for s in spans if "work" in s.name]
    print(json.dumps(sorted(work)))
    """
)


def test_a_handlers_spans_are_children_of_its_attempt_in_threads_and_in_the_event_loop() -> None:
    out = subprocess.run([sys.executable, "-c", HANDLER_SPANS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    work = json.loads(out.stdout.strip().splitlines()[-1])
    assert work == [["async work", "unit.Async"]] * 3 + [["sync work", "unit.Sync"]] * 3
