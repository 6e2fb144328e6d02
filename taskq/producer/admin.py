"""Provisioning: the priority, delay-tier and DLQ topics of a namespace."""

from __future__ import annotations

from taskq._core.broker import TopicSpec
from taskq._core.envelope import Topics
from taskq._core.errors import ConfigurationError
from taskq._core.kafka_admin import Admin
from taskq._core.settings import Settings

#: DLQ records wait for an operator: keep them 30 days (overridable).
DLQ_RETENTION_MS = 30 * 24 * 3600 * 1000


def topic_specs(
    settings: Settings, *, partitions: int = 6, replication: int | None = None
) -> list[TopicSpec]:
    """Every topic a namespace needs; without `replication`, the cluster's defaults decide (see below)."""
    if partitions < 1:
        raise ConfigurationError(f"partitions must be >= 1, got {partitions}")
    if replication is not None and replication < 1:
        raise ConfigurationError(f"replication must be >= 1, got {replication}")
    topics = Topics(settings.namespace, settings.delay_tiers)
    # No replication given: the broker's default.replication.factor and min.insync.replicas, which is what
    # the cluster's operator chose (compose/stack's 3-broker cluster: 3 and 2; one broker: 1 and 1).
    # Given: min.insync.replicas below replication keeps acks=all writable with one broker down.
    config = {} if replication is None else {"min.insync.replicas": str(max(1, min(2, replication - 1)))}
    specs = [TopicSpec(t, partitions, replication, config) for t in topics.priority_topics]
    specs += [TopicSpec(t, partitions, replication, config) for t in topics.delay_topics]
    specs.append(TopicSpec(topics.dlq, 1, replication, {**config, "retention.ms": str(DLQ_RETENTION_MS)}))
    return specs


def create_topics(
    settings: Settings, *, partitions: int = 6, replication: int | None = None
) -> dict[str, bool]:
    """Create the namespace's topics that are missing (idempotent); returns topic -> created now."""
    return Admin(settings).create_topics(
        topic_specs(settings, partitions=partitions, replication=replication)
    )
