"""Prometheus metrics of workers, and the /metrics + /healthz endpoint. Names end in _total or _seconds."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from taskq.consumer.events import (
    AttemptFailed,
    AttemptStarted,
    AttemptSucceeded,
    DeadLettered,
    DuplicateSkipped,
    Event,
    LoopSampled,
    ShareRedelivered,
    TaskRetried,
    WorkerStarted,
    WorkerStopped,
)

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


@dataclass(frozen=True, slots=True)
class _Bound:
    """One task type's label children."""

    started: Any
    succeeded: Any
    failed: Any
    retried: Any
    duplicates: Any
    processing: Any
    end_to_end: Any


class PrometheusHook:
    """The worker's Prometheus metrics, as a hook: created with the hook (never at import), in a registry
    of its own, so several workers in one process (tests, benchmarks) never collide."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._bound: dict[str, _Bound] = {}
        r = self.registry
        self.started = Counter("taskq_tasks_started_total", "Attempts started", ["task_type"], registry=r)
        self.quarantined = Counter(
            "taskq_quarantined_runs_total",
            "Attempts of suspects (keys taken over from a dead worker) run alone in their process",
            ["task_type"],
            registry=r,
        )
        self.succeeded = Counter(
            "taskq_tasks_succeeded_total", "Attempts that completed the task", ["task_type"], registry=r
        )
        self.failed = Counter(
            "taskq_tasks_failed_total",
            "Attempts that failed (incl. timeouts and crashes)",
            ["task_type"],
            registry=r,
        )
        self.retried = Counter(
            "taskq_tasks_retried_total",
            "Failed attempts sent to a delay tier for another try",
            ["task_type"],
            registry=r,
        )
        self.dead_lettered = Counter(
            "taskq_tasks_dead_lettered_total", "Tasks published to the DLQ, by reason", ["reason"], registry=r
        )
        self.duplicates = Counter(
            "taskq_duplicates_skipped_total",
            "Deliveries skipped because their idempotency key was completed",
            ["task_type"],
            registry=r,
        )
        self.processing = Histogram(
            "taskq_processing_seconds",
            "Wall time of one attempt",
            ["task_type"],
            buckets=_LATENCY,
            registry=r,
        )
        self.end_to_end = Histogram(
            "taskq_enqueue_to_completion_seconds",
            "From enqueue to recorded completion",
            ["task_type"],
            buckets=_LATENCY,
            registry=r,
        )
        # multiprocess_mode counts only under `taskq worker --processes N` (PROMETHEUS_MULTIPROC_DIR set):
        # one /metrics for every worker process, summing the counts and the sizes of live processes, and a
        # ratio per process (a `pid` label).
        self.in_flight = Gauge(
            "taskq_tasks_in_flight", "Attempts running now", registry=r, multiprocess_mode="livesum"
        )
        self.slots = Gauge(
            "taskq_slot_utilisation_ratio",
            "Busy execution slots / concurrency",
            registry=r,
            multiprocess_mode="liveall",
        )
        self.buffered = Gauge(
            "taskq_buffered_tasks",
            "Tasks fetched and waiting for a slot, by tier",
            ["priority"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.workers = Gauge(
            "taskq_workers",
            "Worker processes running (1 per process, summed under --processes)",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.lag = Gauge(
            "taskq_consumer_lag",
            "Records of assigned partitions not yet consumed, by tier",
            ["priority"],
            registry=r,
            multiprocess_mode="livesum",
        )

        self.share_held = Gauge(
            "taskq_share_records_held",
            "Share mode: records the tiers' share groups handed to the worker, not acknowledged yet",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.share_redelivered = Counter(
            "taskq_share_redeliveries_total",
            "Share mode: records handed to the worker again, by tier and by whether they were sent back to "
            "their tier as new records (on the group's last delivery)",
            ["topic", "sent_again"],
            registry=r,
        )

    def _of(self, task_type: str) -> _Bound:
        # Label children bound once per task type: labels() per event cost ~10 µs a task on the hot path.
        bound = self._bound.get(task_type)
        if bound is None:
            bound = self._bound[task_type] = _Bound(
                *(m.labels(task_type) for m in (self.started, self.succeeded, self.failed, self.retried)),
                *(m.labels(task_type) for m in (self.duplicates, self.processing, self.end_to_end)),
            )
        return bound

    def __call__(self, event: Event) -> None:
        """Count and time what the event says."""
        match event:
            case AttemptStarted(task_type=t, quarantined=quarantined):
                self._of(t).started.inc()
                if quarantined:
                    self.quarantined.labels(t).inc()
            case AttemptSucceeded(task_type=t, seconds=seconds, enqueued_at=enqueued_at):
                bound = self._of(t)
                bound.processing.observe(seconds)
                bound.succeeded.inc()
                age = (datetime.now(UTC) - enqueued_at).total_seconds()
                bound.end_to_end.observe(max(0.0, age))
            case AttemptFailed(task_type=t, seconds=seconds):
                bound = self._of(t)
                bound.processing.observe(seconds)
                bound.failed.inc()
            case TaskRetried(task_type=t):
                self._of(t).retried.inc()
            case DuplicateSkipped(task_type=t):
                self._of(t).duplicates.inc()
            case DeadLettered(error_type=error_type):
                self.dead_lettered.labels(error_type.rsplit(".", 1)[-1][:40]).inc()
            case LoopSampled() as sample:
                self.in_flight.set(sample.in_flight)
                self.slots.set(sample.busy_slots / sample.concurrency)
                for tier, n in sample.buffered.items():
                    self.buffered.labels(tier).set(n)
                for tier, n in (sample.lag or {}).items():
                    self.lag.labels(tier).set(n)
                if sample.share_held is not None:
                    self.share_held.set(sample.share_held)
            case ShareRedelivered(topic=topic, sent_again=sent_again):
                self.share_redelivered.labels(topic, "true" if sent_again else "false").inc()
            case WorkerStarted():
                self.workers.set(1)
            case WorkerStopped():
                self.workers.set(0)
            case _:
                pass


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve(
    port: int,
    healthy: Callable[[], bool],
    host: str = "127.0.0.1",
    registry: CollectorRegistry = REGISTRY,
) -> WSGIServer:
    """Serve /metrics (Prometheus) and /healthz (200 while `healthy()`, else 503) from a daemon thread;
    on loopback unless another host is given (0.0.0.0 for a Prometheus in a container or elsewhere)."""
    metrics_app = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ.get("PATH_INFO") == "/healthz":
            ok = healthy()
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [b"ok\n" if ok else b"unhealthy\n"]
        return metrics_app(environ, start_response)

    server = make_server(host, port, app, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="taskq-metrics", daemon=True).start()
    return server


class Heartbeat:
    """The worker loop beats; /healthz fails when it has not beaten for `limit` seconds."""

    def __init__(self, limit: float = 60.0) -> None:
        self.limit = limit
        self._last = time.monotonic()

    def beat(self) -> None:
        """The loop is alive."""
        self._last = time.monotonic()

    def healthy(self) -> bool:
        """Whether the loop beat recently."""
        return time.monotonic() - self._last < self.limit
