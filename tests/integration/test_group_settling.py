"""A worker that joins a KIP-848 group takes its partitions without waiting for the members' heartbeats."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

from taskq._core import kafka_clients, settling
from taskq._core.broker import TP
from taskq._core.envelope import Topics
from taskq._core.kafka import Source, base_config
from taskq._core.settings import Settings

#: The group's heartbeat interval here: the longest the broker allows (Kafka's default
#: group.consumer.max.heartbeat.interval.ms). A member that waited for its next heartbeat to give partitions
#: up would keep them this long.
_HEARTBEAT_MS = 15000


def _poll_until(
    sources: list[Source],
    done: Callable[[], object],
    what: str,
    within: float,
    also: Callable[[], None] = lambda: None,
) -> None:
    deadline = time.monotonic() + within
    while not done():
        assert time.monotonic() < deadline, f"no {what} within {within:g} s"
        for s in sources:
            s.poll(10, 0.05)
        also()


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


def test_a_member_keeps_reading_its_kept_partitions_where_it_was_after_giving_others_up(
    settings: Settings,
) -> None:
    # After a revocation the member wakes its fetchers by seeking the partitions it keeps to where its
    # reading is (its position, or where it last set it if it has taken nothing since): what it took before
    # is not delivered again, and nothing after it is skipped. With a resume (a seek) between its last take
    # and the revocation, the first form sought them back to where they started at the assignment.
    settings = dataclasses.replace(settings, group_protocol="consumer")
    topic = Topics(settings.namespace).priority_topics[0]
    per_partition = 300
    producer = Producer(base_config(settings))
    for i in range(3 * per_partition):
        producer.produce(topic, b"x", partition=i % 3)
    assert producer.flush(30) == 0
    group = f"{settings.namespace}.kept"
    owned: dict[str, set[TP]] = {"a": set(), "b": set()}
    a = Source(settings, group=group, on_assign=owned["a"].update, on_revoke=owned["a"].difference_update)
    b = Source(settings, group=group, on_assign=owned["b"].update, on_revoke=owned["b"].difference_update)
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}

    def read_a(n: int, timeout: float) -> None:
        for r in a.poll(n, timeout):
            seen[r.partition].append(r.offset)

    try:
        a.subscribe([topic])
        deadline = time.monotonic() + 30
        while min(len(v) for v in seen.values()) < 50:  # a has read some of every partition
            assert time.monotonic() < deadline, "a read too little within 30 s"
            read_a(20, 0.05)
        # Flow control pauses and resumes partitions; a resume seeks, to wake the fetcher, and librdkafka
        # then knows no position of the partition until a record of it is taken. Where the reading is
        # stays known: the next offset to read, not -1 (which the stall warnings took for "never fetched").
        tps = [(topic, p) for p in range(3)]
        a.pause(tps)
        a.resume(tps)
        assert [a.position(tp) for tp in tps] == [seen[p][-1] + 1 for p in range(3)]
        b.subscribe([topic])
        _poll_until(
            [b],
            lambda: owned["b"] and not owned["a"] & owned["b"],
            "share for b",
            30,
            also=lambda: read_a(5, 0),
        )
        kept = {p for t, p in owned["a"] if t == topic}
        deadline = time.monotonic() + 30
        while any(len(seen[p]) < per_partition or seen[p][-1] < per_partition - 1 for p in kept):
            assert time.monotonic() < deadline, f"a did not read its kept partitions {kept} to their end"
            read_a(100, 0.05)
    finally:
        a.close()
        b.close()
    assert kept
    for p in kept:
        assert seen[p] == list(range(per_partition)), f"partition {p}: read again or skipped"


def test_a_closing_member_asks_librdkafka_nothing_about_its_assignment_in_the_revocation(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Closing, a member is revoked its partitions from inside librdkafka's close, and a request to the group's
    # thread made from that callback can wait for ever (a CI run hung there: Source.close -> revoked ->
    # kept_through -> Consumer.assignment()). Leaving, it has no fetchers to wake nor a group to settle in:
    # the revocation answers and asks nothing else.
    settings = dataclasses.replace(settings, group_protocol="consumer")
    topic = Topics(settings.namespace).priority_topics[0]
    revoked_closing: list[list[TP]] = []
    asked_closing: list[list[TP]] = []
    source: Source

    def on_revoke(tps: list[TP]) -> None:
        if source._closing:
            revoked_closing.append(tps)

    def kept_through(consumer: object, changed: list[TP]) -> set[TP]:
        if source._closing:
            asked_closing.append(changed)
        return settling.kept_through(consumer, changed)  # type: ignore[arg-type]

    monkeypatch.setattr(kafka_clients, "kept_through", kept_through)
    owned: set[TP] = set()
    group = f"{settings.namespace}.leaving"
    source = Source(settings, group=group, on_assign=owned.update, on_revoke=on_revoke)
    try:
        source.subscribe([topic])
        _poll_until([source], lambda: len(owned) == 3, "assignment", 30)
    finally:
        source.close()
    assert revoked_closing and revoked_closing[0], "the close revoked nothing: the test saw no revocation"
    assert asked_closing == [], f"asked for the assignment while closing, after revoking {asked_closing}"
