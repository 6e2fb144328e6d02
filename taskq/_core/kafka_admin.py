"""Topic provisioning and offset look-ups: `Admin`, which waits out a broker that is not ready yet."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
    OffsetSpec,
)

from taskq._core.broker import TP, TopicSpec
from taskq._core.errors import KafkaUnavailableError
from taskq._core.kafka import base_config
from taskq._core.kafka_clients import NOT_READY, new_client, unavailable
from taskq._core.settings import Settings, redact

#: Answers after which the client's own metadata of new topics may be what is behind: it asks for more.
_STALE_METADATA = frozenset(
    {
        KafkaError._NOENT,
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.UNKNOWN_LEADER_EPOCH,
        KafkaError.FENCED_LEADER_EPOCH,
    }
)

#: Seconds a broker that answers "not ready yet" (see NOT_READY) is waited for, whatever the admin timeout.
NOT_READY_PATIENCE = 30.0

R = TypeVar("R")


class Admin:
    """Topic provisioning and offset look-ups."""

    def __init__(self, settings: Settings, *, timeout: float | None = None) -> None:
        self._a = new_client(AdminClient, base_config(settings))
        self._timeout = settings.kafka_timeout if timeout is None else timeout
        self._servers = redact(settings.bootstrap_servers)
        self._settings = settings
        self._readers: dict[str, Consumer] = {}  # group -> a consumer that reads its offsets

    def _wrap(self, what: str, exc: KafkaException) -> KafkaUnavailableError:
        return unavailable(what, exc, servers=self._servers, timeout=self._timeout)

    def create_topics(self, specs: Sequence[TopicSpec]) -> dict[str, bool]:
        """Create topics that do not exist; returns name -> created (False: it existed already)."""
        if not specs:
            return {}
        futures = self._a.create_topics(
            [
                NewTopic(
                    s.name,
                    num_partitions=s.partitions,
                    replication_factor=-1 if s.replication is None else s.replication,
                    config=dict(s.config or {}),
                )
                for s in specs
            ],
            operation_timeout=self._timeout,
            request_timeout=self._timeout,
        )
        created: dict[str, bool] = {}
        for name, fut in futures.items():
            try:
                fut.result()
                created[name] = True
            except KafkaException as exc:
                err = exc.args[0]
                if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    created[name] = False
                else:
                    raise self._wrap(f"creating topic {name}", exc) from exc
        # Delivery guarantee: the broker answers CreateTopics before it has created each partition's log
        # (seconds later for dozens of partitions on a busy broker). A record produced in between is refused
        # (NOT_LEADER_FOR_PARTITION), and librdkafka's idempotent producer (2.16) then reported it delivered
        # once a later batch of that partition succeeded ("implicitly acked"): acknowledged, never in the
        # log. Topics are handed out only once every partition has its leader, which ListOffsets tells.
        # A topic that existed already is waited for with the partitions it has (another process may have
        # created it a moment ago, with other counts).
        counts = {s.name: s.partitions for s in specs if created[s.name]}
        counts.update(self.partitions([name for name, new in created.items() if not new]))
        req = {TopicPartition(t, p): OffsetSpec.latest() for t, n in counts.items() for p in range(n)}  # type: ignore[no-untyped-call]

        def leaders(left: float) -> None:
            try:
                for future in self._a.list_offsets(req, request_timeout=left).values():
                    future.result()
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if isinstance(err, KafkaError) and err.code() in _STALE_METADATA:
                    # The client's metadata has no leader for them yet, and it may keep that answer: a
                    # metadata request of its own brings the leaders the broker knows by now.
                    self._a.list_topics(timeout=max(0.1, min(left, 5.0)))
                raise

        # Right after CreateTopics no partition may have a leader in the client's metadata yet: the whole
        # request then fails with "No leaders found", a state to wait out like the others.
        self._answered(
            "waiting for the partitions of new topics", leaders, not_ready=NOT_READY | {KafkaError._NOENT}
        )
        return created

    def delete_topics(self, names: Sequence[str]) -> None:
        """Delete topics (missing ones are ignored)."""
        if not names:
            return
        futures = self._a.delete_topics(
            list(names), operation_timeout=self._timeout, request_timeout=self._timeout
        )
        for name, fut in futures.items():
            try:
                fut.result()
            except KafkaException as exc:
                err = exc.args[0]
                if not (isinstance(err, KafkaError) and err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART):
                    raise self._wrap(f"deleting topic {name}", exc) from exc

    def delete_groups(self, groups: Sequence[str]) -> None:
        """Delete consumer groups that have no members left (missing ones are ignored)."""
        if not groups:
            return
        futures = self._a.delete_consumer_groups(list(groups), request_timeout=self._timeout)
        for group, fut in futures.items():
            try:
                fut.result()
            except KafkaException as exc:
                err = exc.args[0]
                if not (isinstance(err, KafkaError) and err.code() == KafkaError.GROUP_ID_NOT_FOUND):
                    raise self._wrap(f"deleting group {group}", exc) from exc

    def configure_share_group(
        self, group: str, *, lock_duration_ms: int | None = None, delivery_count_limit: int | None = None
    ) -> None:
        """Set a share group's configs (KIP-932) that taskq relies on; the group need not exist yet.
        `lock_duration_ms`: how long a member holds a record before the group hands it out again (the
        broker's group.share.record.lock.duration.ms when None; within its min and max).
        `delivery_count_limit`: deliveries after which the group archives a record it is not acknowledged
        for (the broker's group.share.delivery.count.limit when None; within its min and max)."""
        configs = {
            # A share group otherwise starts at the end of its topics: tasks enqueued before the first
            # worker started would never run.
            "share.auto.offset.reset": "earliest",
            # Delivery guarantee: the forwarder writes in transactions, and a record of an aborted one must
            # never run (a share group reads uncommitted records unless told).
            "share.isolation.level": "read_committed",
        }
        if lock_duration_ms is not None:
            configs["share.record.lock.duration.ms"] = str(lock_duration_ms)
        if delivery_count_limit is not None:
            configs["share.delivery.count.limit"] = str(delivery_count_limit)
        entries = [ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET) for k, v in configs.items()]
        resource = ConfigResource(ConfigResource.Type.GROUP, group, incremental_configs=entries)

        def alter(left: float) -> None:
            self._a.incremental_alter_configs([resource], request_timeout=left)[resource].result()

        self._answered(f"configuring share group {group}", alter)

    def share_group_configs(self, groups: Sequence[str]) -> dict[str, dict[str, str]]:
        """Each share group's effective configs (`share.*`: its own where set, else the broker's)."""
        resources = [ConfigResource(ConfigResource.Type.GROUP, g) for g in groups]

        def describe(left: float) -> dict[str, dict[str, str]]:
            answers = self._a.describe_configs(resources, request_timeout=left)
            return {r.name: {k: e.value for k, e in answers[r].result().items()} for r in resources}

        return self._answered(f"reading the configs of share groups {', '.join(groups)}", describe)

    def broker_configs(self) -> dict[str, str]:
        """The configs of one of the cluster's brokers (as they apply to it: the cluster-wide settings
        of a uniformly configured cluster)."""

        def describe(left: float) -> dict[str, str]:
            brokers = self._a.list_topics(timeout=left).brokers
            resource = ConfigResource(ConfigResource.Type.BROKER, str(min(brokers)))
            answer = self._a.describe_configs([resource], request_timeout=left)[resource].result()
            return {k: e.value for k, e in answer.items()}

        return self._answered("reading a broker's configs", describe)

    def partitions(self, topics: Sequence[str]) -> dict[str, int]:
        """Partition counts of existing topics (missing topics are left out)."""
        try:
            md = self._a.list_topics(timeout=self._timeout)
        except KafkaException as exc:
            raise self._wrap("listing topics", exc) from exc
        return {
            t: len(md.topics[t].partitions) for t in topics if t in md.topics and md.topics[t].error is None
        }

    def end_offsets(self, topics: Sequence[str]) -> dict[TP, int]:
        """The log end offset (high watermark) of every partition of these topics."""
        return self._list_offsets(topics, OffsetSpec.latest())  # type: ignore[no-untyped-call]

    def start_offsets(self, topics: Sequence[str]) -> dict[TP, int]:
        """The earliest offset still in the log of every partition."""
        return self._list_offsets(topics, OffsetSpec.earliest())  # type: ignore[no-untyped-call]

    def _list_offsets(self, topics: Sequence[str], spec: OffsetSpec) -> dict[TP, int]:
        counts = self.partitions(topics)
        req = {TopicPartition(t, p): spec for t, n in counts.items() for p in range(n)}
        if not req:
            return {}

        def list_offsets(left: float) -> dict[TP, int]:
            futures = self._a.list_offsets(req, request_timeout=left)
            return {(tp.topic, tp.partition): f.result().offset for tp, f in futures.items()}

        return self._answered("listing offsets", list_offsets)

    def committed(self, group: str, topics: Sequence[str]) -> dict[TP, int]:
        """A group's committed offsets on these topics (-1 where it committed nothing)."""
        counts = self.partitions(topics)
        parts = [TopicPartition(t, p) for t, n in counts.items() for p in range(n)]
        if not parts:
            return {}
        # Read by a consumer of the group (which does not join it), not by list_consumer_group_offsets:
        # librdkafka (2.13 to 2.16 at least) kills the process with SIGSEGV when that admin request meets a
        # coordinator still loading, as on a broker's first seconds: its OffsetFetch error path calls into
        # a consumer group the admin client does not have (rd_kafka_handle_OffsetFetch -> rd_kafka_cgrp_op).
        reader = self._readers.get(group)
        if reader is None:
            conf = base_config(self._settings) | {"group.id": group, "enable.auto.commit": False}
            reader = self._readers[group] = new_client(Consumer, conf)
        found = self._answered(
            f"reading offsets of group {group}", lambda left: reader.committed(parts, timeout=left)
        )
        return {(p.topic, p.partition): (p.offset if p.offset >= 0 else -1) for p in found}

    def _answered(
        self, what: str, call: Callable[[float], R], *, not_ready: frozenset[int] = NOT_READY
    ) -> R:
        """`call(seconds left)`, again while the broker answers that it is not ready yet (a leader or a
        group coordinator being elected or loading, as right after a topic or the broker starts); that is
        a state to wait out, not a failure to report.

        A broker that does not answer is reported after the admin timeout (10 s for the CLI's one-off
        commands). One that answers "not ready" is there and busy, and is waited for at least
        `NOT_READY_PATIENCE` seconds: a loaded broker can take longer than 10 s to create new partitions.
        """
        started = time.monotonic()
        deadline = started + self._timeout
        patient = started + max(self._timeout, NOT_READY_PATIENCE)
        backoff = 0.05
        while True:
            try:
                return call(max(0.1, deadline - time.monotonic()))
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                answered = isinstance(err, KafkaError) and err.code() in not_ready
                transient = answered or (isinstance(err, KafkaError) and err.retriable())
                if answered:
                    deadline = patient
                if not transient or time.monotonic() + backoff > deadline:
                    raise self._wrap(what, exc) from exc
            time.sleep(backoff)
            backoff = min(1.0, backoff * 2)
