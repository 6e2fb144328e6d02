"""Under saturation, the partitions of a tier take turns.

Flow control pauses a tier once its share of the buffer is taken and resumes it when some of that has run.
librdkafka fetches for the partitions in the order they were resumed, and a pause drops what was fetched and
not taken: a tier whose share a single partition's fetch fills was read from its first partitions only, and
the tasks of its last ones waited for as long as the tier was saturated (one partition of `low` went unread
for over a minute in a 10-minute run at 8,000 tasks a second).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from taskq._core.settings import Settings
from taskq.consumer.handlers import Handlers
from taskq.producer.producer import TaskProducer, TaskSpec
from tests.acceptance.helpers import wait_until
from tests.integration.test_worker_inputs import _register, running

PARTITIONS = 6
CRITICAL = 54_000
LOW = 6_000
#: Low's completions awaited: critical takes 8 picks to low's 1, so about 27,000 completions in all.
LOW_DONE = 3_000


@pytest.mark.quiet  # judges where completions came from, which a starved CPU blurs
@pytest.mark.partitions(PARTITIONS)
def test_every_partition_of_a_saturated_tier_makes_progress(
    settings: Settings, task_schema: Callable[..., dict[str, Any]]
) -> None:
    ns = settings.namespace
    schema = task_schema("Job", [{"name": "i", "type": "int"}])
    _register(settings, schema)
    low: dict[str, int] = {}  # idempotency key -> partition
    with TaskProducer(settings) as producer:
        for tier, n in (("low", LOW), ("critical", CRITICAL)):
            for start in range(0, n, 1000):
                specs = [
                    TaskSpec(
                        task_type=f"{ns}.Job", payload={"i": i}, priority=tier, idempotency_key=f"{tier}:{i}"
                    )
                    for i in range(start, start + 1000)
                ]
                receipts = producer.enqueue_many(specs, wait=True)
                if tier == "low":
                    low |= {r.idempotency_key: r.partition for r in receipts}
    assert set(low.values()) == set(range(PARTITIONS)), "low's tasks are spread over its partitions"
    done: list[str] = []
    h = Handlers()

    @h.task(f"{ns}.Job", schema=schema)
    def job(payload: dict[str, Any], ctx: Any) -> None:
        done.append(ctx.idempotency_key)

    with running(h, settings, concurrency=8):
        wait_until(
            lambda: sum(key in low for key in done) >= LOW_DONE, timeout=120, what=f"{LOW_DONE} low tasks"
        )
    per_partition = Counter(low[key] for key in done if key in low)
    # Taking turns, each partition gives about a sixth (500). Read from the first ones until they ran dry,
    # the first two gave all they held (1,000 each) and the last ones none or the few of the start's fetch
    # (16). Each must give at least a tenth of its sixth.
    starved = {
        p: per_partition[p] for p in range(PARTITIONS) if per_partition[p] < LOW_DONE // PARTITIONS // 10
    }
    assert not starved, f"low's completions per partition: {dict(sorted(per_partition.items()))}"
