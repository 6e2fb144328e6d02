"""Benchmarks of the worker runtime and of the ceiling its design allows, each in a namespace of its own.

The namespace (topics, consumer groups, Postgres schema, registry subject) is created for one run and deleted
after it, so a benchmark never reads another run's tasks nor leaves records behind. Times come from the
worker's events: enqueue, attempt start and recorded completion of every idempotency key, on the monotonic
clock (CLOCK_MONOTONIC on Linux: one clock for every process of the machine, so worker processes' times
compare with the parent's).
"""

from taskq.tools.bench.ceiling import bench_ceiling
from taskq.tools.bench.latency import bench_latency
from taskq.tools.bench.run import BENCH_HANDLERS, scratch_namespace
from taskq.tools.bench.worker import bench_worker

__all__ = ["BENCH_HANDLERS", "bench_ceiling", "bench_latency", "bench_worker", "scratch_namespace"]
