"""Prometheus metrics of workers, and the /metrics + /healthz endpoint. Names end in _total or _seconds."""

from __future__ import annotations

import math
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from taskq.consumer.events import (
    Event,
    LoopSampled,
    ShareRedelivered,
    Tally,
    WorkerStarted,
    WorkerStopped,
)

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
#: The latency histograms' buckets' upper bounds, as prometheus_client keeps them (+Inf last).
_BOUNDS = (*map(float, _LATENCY), math.inf)


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
        #: Where the worker's stages count per-task events (through a Reporter) between flushes.
        self.tally = Tally()
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
        """Set what the event says of the worker's state. Per-task counts come through `tally`, not as
        events (taskq.consumer.events.Reporter), and go to the metrics once per loop pass (`flush`)."""
        match event:
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

    def flush(self) -> None:
        """Apply what was counted into `tally` since the last flush (the worker flushes once a loop pass)."""
        if self.tally:
            self.apply(self.tally)
            self.tally.clear()

    def apply(self, tally: Tally) -> None:
        """Add a pass's per-task counts: one update per counter and label set, one per bucket of a histogram,
        instead of one per event (each takes a lock, and an observation walks the buckets)."""
        for t, n in tally.started.items():
            self._of(t).started.inc(n)
        for t, n in tally.quarantined.items():
            self.quarantined.labels(t).inc(n)
        for t, seconds in tally.ran.items():
            _observe_all(self._of(t).processing, seconds)
        # Timed when the pass's counts are applied, not when each attempt reported: later by at most a pass.
        now = datetime.now(UTC)
        for t, enqueued in tally.succeeded.items():
            bound = self._of(t)
            bound.succeeded.inc(len(enqueued))
            _observe_all(bound.end_to_end, [max(0.0, (now - at).total_seconds()) for at in enqueued])
        for t, n in tally.failed.items():
            self._of(t).failed.inc(n)
        for t, n in tally.retried.items():
            self._of(t).retried.inc(n)
        for t, n in tally.duplicates.items():
            self._of(t).duplicates.inc(n)
        for error_type, n in tally.dead_lettered.items():
            self.dead_lettered.labels(error_type.rsplit(".", 1)[-1][:40]).inc(n)


def _observe_all(histogram: Any, amounts: Sequence[float]) -> None:
    """`histogram.observe(a)` for each of `amounts`, with one update of each bucket that gets any and of the
    sum. prometheus_client has no bulk observe, so this reaches into what `observe` itself updates: one
    value per bucket (not cumulative; its le ≥ the amount, first match) and the sum. Those values are
    mmapped ones with PROMETHEUS_MULTIPROC_DIR set (`taskq worker --processes N`), kept per bucket there
    too, where inc(n) is one write as inc(1) is."""
    counts: dict[int, int] = {}
    for amount in amounts:
        i = bisect_left(_BOUNDS, amount)
        counts[i] = counts.get(i, 0) + 1
    buckets = histogram._buckets
    for i, n in counts.items():
        buckets[i].inc(n)
    histogram._sum.inc(sum(amounts))


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
