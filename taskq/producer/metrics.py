"""Prometheus metrics of the producer. Names end in _total or _seconds; labels are a small fixed set."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

ENQUEUED = Counter("taskq_tasks_enqueued_total", "Tasks accepted by a producer", ["task_type", "priority"])
REJECTED = Counter(
    "taskq_enqueue_rejections_total",
    "Enqueues refused before anything was sent, by reason",
    ["reason"],
)
DELIVERY_FAILED = Counter("taskq_delivery_failures_total", "Accepted tasks the broker did not acknowledge")
ENQUEUE_SECONDS = Histogram(
    "taskq_enqueue_seconds",
    "Time spent in enqueue(), validation to hand-off to the Kafka client",
    buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0),
)
