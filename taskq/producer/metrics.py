"""Prometheus metrics of the producer. Names end in _total or _seconds; labels are a small fixed set.

They are created by the first producer of the process (never at import), in the default registry, so a
service that already serves /metrics exports them with its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from prometheus_client import Counter, Histogram

_ENQUEUE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)


@dataclass(frozen=True)
class ProducerMetrics:
    """The producer's counters and histogram."""

    enqueued: Counter
    rejected: Counter
    delivery_failed: Counter
    enqueue_seconds: Histogram


@cache
def producer_metrics() -> ProducerMetrics:
    """The process's producer metrics, created on first use."""
    return ProducerMetrics(
        enqueued=Counter(
            "taskq_tasks_enqueued_total", "Tasks accepted by a producer", ["task_type", "priority"]
        ),
        rejected=Counter(
            "taskq_enqueue_rejections_total",
            "Enqueues refused before anything was sent, by reason",
            ["reason"],
        ),
        delivery_failed=Counter(
            "taskq_delivery_failures_total", "Accepted tasks the broker did not acknowledge"
        ),
        enqueue_seconds=Histogram(
            "taskq_enqueue_seconds",
            "Time spent in enqueue(), validation to hand-off to the Kafka client",
            buckets=(
                0.00005,
                0.0001,
                0.00025,
                0.0005,
                0.001,
                0.0025,
                0.005,
                0.01,
                0.025,
                0.05,
                0.1,
                0.5,
                1.0,
            ),
        ),
    )
