"""`bench latency`: enqueue-to-start and enqueue-to-completion times at a fixed rate, to running workers."""

from __future__ import annotations

import time
from typing import Any

from taskq._core.envelope import PRIORITIES
from taskq._core.errors import ConfigurationError
from taskq._core.settings import Settings
from taskq.producer.producer import TaskProducer
from taskq.tools.bench.run import _ms, _namespace, _warm_up
from taskq.tools.bench.runners import _Workers, _WorkerSpec


def bench_latency(
    settings: Settings,
    *,
    rate: float,
    duration: float = 10.0,
    concurrency: int = 4,
    processes: int = 1,
    partitions: int = 6,
    timeout: float = 120.0,
    bare: bool = False,
) -> dict[str, Any]:
    """Run Workers in processes of their own, enqueue `rate` tasks/s on a fixed schedule for `duration` s
    from this one, and time each task's way. `bare`: the framework-free loop of `bench ceiling` in place of
    the workers, the floor of these figures on the same machine."""
    if not rate > 0:
        raise ConfigurationError(f"rate must be > 0, got {rate}")
    if not duration > 0:
        raise ConfigurationError(f"duration must be > 0, got {duration}")
    if concurrency < 1:
        raise ConfigurationError(f"concurrency must be >= 1, got {concurrency}")
    count = max(1, round(rate * duration))
    enqueued: dict[str, float] = {}
    behind: list[float] = []
    with _namespace(settings, partitions=partitions) as run:
        all_partitions = 4 * partitions
        # The workers never share this process's interpreter with the sender: under one GIL each would
        # delay the other, and the figures would be of the benchmark.
        spec = _WorkerSpec.of(run, "noop", concurrency)
        with _Workers(spec, processes=processes, spawn=True, bare=bare) as workers:
            workers.wait(
                lambda: sum(workers.partitions.values()) >= all_partitions,
                timeout,
                f"the worker was not assigned all {all_partitions} partitions",
            )
            with TaskProducer(run.settings) as producer:
                _warm_up(producer, run)
                t0 = time.monotonic()
                for i in range(count):
                    # Open loop: the i-th send is due at t0 + i/rate whatever happened to the ones before, so
                    # a slow send makes the next ones late but never moves the schedule.
                    due = t0 + i / rate
                    now = time.monotonic()
                    if now < due:
                        time.sleep(due - now)
                    else:
                        behind.append(now - due)
                    key = f"bench:{i}"
                    enqueued[key] = time.monotonic()
                    producer.enqueue(run.task_type, {"i": i}, priority=PRIORITIES[i % 4], idempotency_key=key)
                sent_s = time.monotonic() - t0
                producer.flush(60)
            workers.wait(
                lambda: len(workers.completed) >= count, timeout, f"not every one of {count} tasks ran"
            )
        completed, started, cpu_s = workers.completed, workers.started, workers.cpu_s

    keys = [k for k in enqueued if k in completed]
    return {
        "rate": rate,
        "duration_s": duration,
        "tasks": count,
        "completed": len(keys),
        "concurrency": concurrency,
        "processes": processes,
        "partitions": partitions,
        "bare": bare,
        "namespace": run.settings.namespace,
        # Sends per second actually made over the schedule (the rate when the sender kept up).
        "achieved_rate_per_s": count / sent_s if sent_s > 0 else None,
        # Sends that found themselves behind their scheduled time, and by how much at most.
        "late_sends": len(behind),
        "max_behind_schedule_ms": max(behind, default=0.0) * 1e3,
        # Process CPU of the workers (or bare loops), all threads, from launch to the stop request (joining
        # the group and idle waits included), per task sent.
        "worker_cpu_ms_per_task": cpu_s / count * 1e3,
        "enqueue_to_start_ms": _ms([started[k] - enqueued[k] for k in keys if k in started]),
        "enqueue_to_completion_ms": _ms([completed[k] - enqueued[k] for k in keys]),
    }
