"""Topics are usable when `create_topics` returns: every partition has its leader on the broker.

A broker answers CreateTopics once the controller has recorded the topic, and creates each partition's log
a moment later, up to seconds later for a namespace's dozens of partitions on a busy broker. A record sent in
between is refused (NOT_LEADER_FOR_PARTITION), and librdkafka's idempotent producer then reported it
delivered once a later batch of its partition succeeded: the task that `taskq chaos` lost in its first
second, acknowledged, never in the log, never claimed.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from confluent_kafka import KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from taskq._core.envelope import Topics
from taskq._core.kafka import Admin
from taskq._core.settings import Settings
from taskq.producer.admin import create_topics


def test_every_partition_answers_as_soon_as_create_topics_returns(base_settings: Settings, ns: str) -> None:
    s = base_settings.with_namespace(ns)
    topics = Topics(s.namespace, s.delay_tiers)
    names = [*topics.priority_topics, *topics.delay_topics, topics.dlq]
    try:
        create_topics(s, partitions=8)
        # One ListOffsets, no retry: a partition whose log the broker has not created yet answers
        # NOT_LEADER_FOR_PARTITION (and a produce to it may be acknowledged, then lost).
        admin = AdminClient({"bootstrap.servers": s.bootstrap_servers})
        parts = [TopicPartition(t, p) for t in names for p in range(1 if t == topics.dlq else 8)]
        futures = admin.list_offsets({tp: OffsetSpec.latest() for tp in parts}, request_timeout=30)
        not_ready = []
        for tp, future in futures.items():
            try:
                future.result()
            except KafkaException as exc:
                not_ready.append(f"{tp.topic}[{tp.partition}]: {exc.args[0].name()}")
        assert not_ready == [], f"{len(not_ready)} of {len(parts)} partitions not ready: {not_ready[:5]}"
    finally:
        Admin(s).delete_topics(names)


def test_topics_of_many_namespaces_created_at_once_are_each_ready(base_settings: Settings, ns: str) -> None:
    # A new client's metadata could keep "no leader" for new topics for longer than the wait: creations
    # side by side on a busy broker failed with "No leaders found" until the client asked the broker for
    # metadata of its own (9 of 25 in one such run).
    namespaces = [base_settings.with_namespace(f"{ns}-{i}") for i in range(16)]
    try:
        with ThreadPoolExecutor(4) as pool:  # raises if any partition has no leader within the wait
            list(pool.map(lambda s: create_topics(s, partitions=6), namespaces))
    finally:
        for s in namespaces:
            t = Topics(s.namespace, s.delay_tiers)
            Admin(s).delete_topics([*t.priority_topics, *t.delay_topics, t.dlq])
