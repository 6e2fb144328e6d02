"""A worker that joins a KIP-848 group takes its partitions without waiting for the members' heartbeats."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

from taskq._core.broker import TP
from taskq._core.envelope import Topics
from taskq._core.kafka import Source, base_config
from taskq._core.settings import Settings

#: The group's heartbeat interval here: the longest the broker allows (group.consumer.max.heartbeat.interval.ms,
#: Kafka's default). A member that waited for its next heartbeat to give partitions up would keep them this long.
_HEARTBEAT_MS = 15000


def _poll_until(sources: list[Source], done: Callable[[], object], what: str, within: float) -> None:
    deadline = time.monotonic() + within
    while not done():
        assert time.monotonic() < deadline, f"no {what} within {within:g} s"
        for s in sources:
            s.poll(10, 0.05)


def test_a_member_that_joins_gets_its_share_before_the_next_heartbeat_of_the_one_holding_it(
    settings: Settings,
) -> None:
    # A member of a KIP-848 group hears of a rebalance only in a heartbeat's answer. Member `a` holds every
    # partition; `b` joins. Left to their heartbeats, `a` gives half up at its next one (15 s here) and `b`
    # takes them at its own next one. While the group settles each re-sends its subscription every 0.1 s
    # (`Settling`), a heartbeat at once: `b` has its half within a second or two. The 10 s below is no
    # measure of speed; it is what separates the two, being shorter than one heartbeat interval.
    settings = dataclasses.replace(settings, group_protocol="consumer")
    topics = list(Topics(settings.namespace).priority_topics)
    group = f"{settings.namespace}.settling"
    admin = AdminClient(base_config(settings))
    group_configs = {
        "consumer.heartbeat.interval.ms": str(_HEARTBEAT_MS),
        "consumer.session.timeout.ms": "45000",
        "consumer.assignment.interval.ms": "0",  # the broker's own batching is not under test
    }
    resource = ConfigResource(
        ConfigResource.Type.GROUP,
        group,
        incremental_configs=[
            ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET) for k, v in group_configs.items()
        ],
    )
    admin.incremental_alter_configs([resource])[resource].result(timeout=30)
    owned: dict[str, set[TP]] = {"a": set(), "b": set()}

    def source(name: str) -> Source:
        return Source(
            settings,
            group=group,
            on_assign=owned[name].update,
            on_revoke=owned[name].difference_update,
        )

    all_partitions = 4 * 3
    a, b = source("a"), source("b")
    try:
        a.subscribe(topics)
        _poll_until([a], lambda: len(owned["a"]) == all_partitions, "assignment of every partition to a", 30)
        b.subscribe(topics)
        _poll_until(
            [a, b],
            lambda: (
                owned["b"] and not owned["a"] & owned["b"] and len(owned["a"] | owned["b"]) == all_partitions
            ),
            "share for b",
            10,
        )
        kept, share = set(owned["a"]), set(owned["b"])
    finally:
        a.close()
        b.close()
    # The range assignor, topic by topic: each member has one or two of each tier's 3 partitions.
    assert {t for t, _ in kept} == {t for t, _ in share} == set(topics)
