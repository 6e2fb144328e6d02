"""Benchmarks of the worker runtime and of the ceiling its design allows, each in a namespace of its own.

The namespace (topics, consumer groups, Postgres schema, registry subject) is created for one run and deleted
after it, so a benchmark never reads another run's tasks nor leaves records behind. Times come from the
worker's events: enqueue, attempt start and recorded completion of every idempotency key, on the monotonic
clock (CLOCK_MONOTONIC on Linux: one clock for every process of the machine, so worker processes' times
compare with the parent's).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from taskq.tools.bench.ceiling import bench_ceiling
    from taskq.tools.bench.effects import BENCH_HANDLERS
    from taskq.tools.bench.latency import bench_latency
    from taskq.tools.bench.run import scratch_namespace
    from taskq.tools.bench.worker import bench_worker

__all__ = ["BENCH_HANDLERS", "bench_ceiling", "bench_latency", "bench_worker", "scratch_namespace"]

# Imported when first named: a spawned bench worker imports its runner from this package, and its launch,
# which the bench reports, should not include the ceiling's, the latency run's and the producer's modules.
_HOMES = {
    "BENCH_HANDLERS": "effects",
    "bench_ceiling": "ceiling",
    "bench_latency": "latency",
    "bench_worker": "worker",
    "scratch_namespace": "run",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{home}"), name)
