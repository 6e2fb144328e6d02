"""The topics a namespace gets: how many copies of each, and how many must acknowledge a write."""

from __future__ import annotations

from taskq._core.settings import Settings
from taskq.producer.admin import topic_specs


def test_without_a_replication_factor_the_cluster_decides() -> None:
    settings = Settings.from_env({}, namespace="topics")
    # compose/stack --brokers 3 sets default.replication.factor=3 and min.insync.replicas=2; one broker: 1, 1.
    specs = topic_specs(settings, partitions=2)
    assert {s.replication for s in specs} == {None}
    assert all("min.insync.replicas" not in (s.config or {}) for s in specs)
    # Given, it is the topics' own, with writes going on while one copy is away.
    given = topic_specs(settings, partitions=2, replication=3)
    assert {(s.replication, (s.config or {})["min.insync.replicas"]) for s in given} == {(3, "2")}
