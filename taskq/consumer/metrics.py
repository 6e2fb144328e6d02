"""Prometheus metrics of workers, and the /metrics + /healthz endpoint. Names end in _total or _seconds."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import Counter, Gauge, Histogram, make_wsgi_app

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

STARTED = Counter("taskq_tasks_started_total", "Attempts started", ["task_type"])
SUCCEEDED = Counter("taskq_tasks_succeeded_total", "Attempts that completed the task", ["task_type"])
FAILED = Counter(
    "taskq_tasks_failed_total", "Attempts that failed (incl. timeouts and crashes)", ["task_type"]
)
RETRIED = Counter(
    "taskq_tasks_retried_total", "Failed attempts sent to a delay tier for another try", ["task_type"]
)
DEAD_LETTERED = Counter(
    "taskq_tasks_dead_lettered_total", "Tasks published to the DLQ, by reason", ["reason"]
)
DUPLICATES = Counter(
    "taskq_duplicates_skipped_total",
    "Deliveries skipped because their idempotency key was completed",
    ["task_type"],
)
PROCESSING = Histogram(
    "taskq_processing_seconds", "Wall time of one attempt", ["task_type"], buckets=_LATENCY
)
END_TO_END = Histogram(
    "taskq_enqueue_to_completion_seconds",
    "From enqueue to recorded completion",
    ["task_type"],
    buckets=_LATENCY,
)
IN_FLIGHT = Gauge("taskq_tasks_in_flight", "Attempts running now")
SLOT_UTILISATION = Gauge("taskq_slot_utilisation_ratio", "Busy execution slots / concurrency")
BUFFERED = Gauge("taskq_buffered_tasks", "Tasks fetched and waiting for a slot, by tier", ["priority"])
LAG = Gauge("taskq_consumer_lag", "Records of assigned partitions not yet consumed, by tier", ["priority"])


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve(port: int, healthy: Callable[[], bool], host: str = "0.0.0.0") -> WSGIServer:
    """Serve /metrics (Prometheus) and /healthz (200 while `healthy()`, else 503) from a daemon thread."""
    metrics_app = make_wsgi_app()

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
