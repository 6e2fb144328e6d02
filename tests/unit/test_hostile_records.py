"""Invariant 6 on the fakes: records with hostile envelope headers go to the DLQ with the reason, and the
worker and the forwarder carry on with the good tasks behind them."""

from __future__ import annotations

from typing import Any

import pytest

from taskq import Handlers, TaskContext
from taskq._core.envelope import Envelope
from taskq.schemas import avro
from taskq.testing import InMemoryQueue

JOB = {"type": "record", "name": "Job", "namespace": "unit", "fields": [{"name": "n", "type": "long"}]}

#: header -> hostile value, and what the DLQ reason must name.
HOSTILE = {
    "max-attempts 0": ("taskq-max-attempts", b"0", "taskq-max-attempts"),
    "timeout inf": ("taskq-timeout", b"inf", "taskq-timeout"),
    "timeout nan": ("taskq-timeout", b"nan", "taskq-timeout"),
    "timeout 1e308": ("taskq-timeout", b"1e308", "taskq-timeout"),
    "enqueued-at 400 nines": ("taskq-enqueued-at", b"9" * 400, "taskq-enqueued-at"),
    "not-before overflow": ("taskq-not-before", b"99999999999999999999", "taskq-not-before"),
    "attempt -1": ("taskq-attempt", b"-1", "taskq-attempt"),
    "huge task type": ("taskq-task-type", b"unit.Job" + b"x" * 5000, "over the 4096-byte limit"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_header_is_dead_lettered_and_the_tasks_behind_it_run(case: str) -> None:
    header, value, named = HOSTILE[case]
    handlers, ran = Handlers(), []

    @handlers.task("unit.Job", schema=JOB, timeout=5)
    def job(payload: dict[str, Any], ctx: TaskContext) -> None:
        ran.append(payload["n"])

    with InMemoryQueue(handlers, namespace="unit") as q:
        schema_id = q.registry.latest("unit.Job").schema_id
        frame = avro.frame(schema_id, avro.encode(avro.parse(JOB), {"n": -1}))
        env = Envelope(task_id="bad", task_type="unit.Job", idempotency_key="bad", priority="normal")
        headers = [(k, v) for k, v in env.to_headers() if k != header] + [(header, value)]
        sink = q.broker.sink()
        for topic in ("unit.normal", "unit.delay.1s"):  # a tier topic, and a delay topic for the forwarder
            sink.send(topic, frame, key=b"k", headers=headers, partition=0)
        sink.flush()
        for i in range(5):
            q.producer.enqueue("unit.Job", {"n": i}, idempotency_key=f"good-{i}")
        q.run_until_idle()
        assert sorted(ran) == list(range(5))
        reasons = [d.reason for d in q.dead_letters]
        assert len(reasons) == 2 and all(named in r for r in reasons), reasons
