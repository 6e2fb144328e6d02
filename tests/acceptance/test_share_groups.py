"""Share groups (KIP-932) on the stack's Kafka: what a share-group worker builds on (issue 24).

The first test drives the client alone; the rest drive `ShareSource`, the share-group member the worker
swaps in for its consumer. What the preview client (confluent-kafka 2.16.1, librdkafka 2.16.0) was seen to
do against Kafka 4.3 is written beside the test that shows it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource

from taskq._core.broker import TP, Record, TopicSpec
from taskq._core.errors import KafkaAuthenticationError
from taskq._core.kafka_admin import Admin
from taskq._core.kafka_clients import KafkaBroker
from taskq._core.settings import Settings
from taskq._core.share import ShareSource
from tests.acceptance.helpers import share_group_reads, wait_until

#: A member's first records take a share-group heartbeat to come (group.share.min.heartbeat.interval.ms is
#: 5 s), and a loaded machine doubles that.
JOIN = 30.0


def test_a_share_group_delivers_each_record_once_and_again_after_a_release(settings: Settings) -> None:
    # Accepted at the first delivery: each record read once, delivery count 1.
    assert share_group_reads(settings.bootstrap_servers, records=5) == [1] * 5
    # Released at the first delivery: the broker hands each out again and counts the second delivery.
    counts = share_group_reads(settings.bootstrap_servers, records=5, release_first=True)
    assert sorted(counts) == [1] * 5 + [2] * 5


@dataclass
class Share:
    """A 1-partition topic and a share group on it, configured as taskq configures it."""

    settings: Settings
    topic: str
    group: str
    broker: KafkaBroker
    admin: Admin
    sources: list[ShareSource] = field(default_factory=list)
    refused: list[tuple[dict[TP, set[int]], str]] = field(default_factory=list)

    def write(self, *values: bytes, batched: bool = False) -> None:
        """Write records; each in a batch of its own unless `batched` (the broker acquires whole batches)."""
        one_each = {"linger.ms": 0, "batch.num.messages": 1}
        sink = self.broker.sink() if batched else self.broker.sink(**one_each)
        for v in values:
            sink.send(self.topic, v, key=None, headers=[])
            if not batched:
                sink.flush(30)
        assert sink.flush(30) == 0

    def source(self, *, consumers: int = 1, max_poll_records: int = 1) -> ShareSource:
        """A member of the group (closed at the end of the test)."""

        def heard(offsets: dict[TP, set[int]], error: str | None) -> None:
            if error is not None:
                self.refused.append((offsets, error))

        source = self.broker.share_source(
            group=self.group,
            topics=[self.topic],
            consumers=consumers,
            max_poll_records=max_poll_records,
            on_commit=heard,
        )
        self.sources.append(source)
        return source


@pytest.fixture
def share(base_settings: Settings, ns: str) -> Iterator[Share]:
    broker = KafkaBroker(base_settings)
    admin = broker.admin()
    topic = group = f"{ns}.share"
    admin.create_topics([TopicSpec(topic, 1)])
    admin.configure_share_group(group)
    s = Share(base_settings, topic, group, broker, admin)
    yield s
    for source in s.sources:
        source.close()
    admin.delete_topics([topic])


def take(
    source: ShareSource, n: int, *, max_records: int = 100, timeout: float = JOIN, accept: bool = False
) -> list[Record]:
    """Poll until `n` records came (at most `max_records` a poll), accepting each if `accept`."""
    got: list[Record] = []

    def enough() -> bool:
        for r in source.poll(max_records, 0.2):
            got.append(r)
            if accept:
                source.accept(r)
        return len(got) >= n

    wait_until(enough, timeout=timeout, what=f"{n} records", every=0)
    return got


def test_two_members_share_one_partition(share: Share) -> None:
    share.write(*(b"%d" % i for i in range(12)))
    a = share.source()
    # a holds its first record: in a consumer group the partition would be a's alone, and b read nothing.
    (held,) = take(a, 1, max_records=1)
    b = share.source()
    rest = take(b, 11, accept=True)
    assert held.offset not in {r.offset for r in rest}
    assert sorted(r.offset for r in [held, *rest]) == list(range(12))
    assert {r.delivery_count for r in [held, *rest]} == {1}
    a.accept(held)


def test_release_delivers_again_reject_and_accept_never(share: Share) -> None:
    share.write(b"released", b"rejected", b"accepted")
    source = share.source(max_poll_records=3)
    released, rejected, accepted = sorted(take(source, 3), key=lambda r: r.offset)
    source.release(released)
    source.reject(rejected)
    source.accept(accepted)
    assert source.in_flight() == 0
    # A record written after them comes after whatever of them the group hands out again (it acquires
    # the lowest available offsets first): when it comes, nothing else may have.
    share.write(b"after")
    again = take(source, 2, accept=True)
    assert [(r.value, r.delivery_count) for r in again] == [(b"released", 2), (b"after", 1)]
    source.commit()
    assert share.refused == []


def test_a_poll_hands_out_no_more_than_asked(share: Share) -> None:
    # One producer batch of 10: the client acquires it whole though asked for 1 record a poll.
    share.write(*(b"%d" % i for i in range(10)), batched=True)
    source = share.source(max_poll_records=1)
    first = take(source, 2, max_records=2)
    assert len(first) == 2
    assert source.in_flight() == 2
    # The other 8 were acquired with them and wait here: handed out next, without a fetch.
    rest = source.poll(100, 0)
    assert sorted(r.offset for r in first + rest) == list(range(10))
    assert source.in_flight() == 10


def test_a_record_held_by_one_consumer_does_not_stop_the_others(share: Share) -> None:
    share.write(*(b"%d" % i for i in range(6)))
    source = share.source(consumers=3, max_poll_records=1)
    (slow,) = take(source, 1, max_records=1)
    # The consumer that acquired `slow` may not poll until it is acknowledged; the other two keep fetching.
    more = take(source, 2, max_records=1)
    assert slow.offset not in {r.offset for r in more}
    assert source.in_flight() == 3
    # Each accepted record frees its consumer for the next: the rest come while `slow` is still held.
    for r in more:
        source.accept(r)
    rest = take(source, 3, max_records=3, accept=True)
    assert sorted(r.offset for r in [slow, *more, *rest]) == list(range(6))
    assert source.in_flight() == 1
    source.accept(slow)


def test_close_releases_held_records_to_another_member_at_once(share: Share) -> None:
    # The longest lock the broker allows: a member waiting it out would wait a minute.
    share.admin.configure_share_group(share.group, lock_duration_ms=60_000)
    share.write(b"a", b"b", b"c")
    first = share.source(max_poll_records=3)
    handed = take(first, 1, max_records=1)  # the others of its poll wait in `first`, acquired
    assert first.in_flight() == 1
    first.close()
    again = take(share.source(), 3, accept=True)
    assert sorted((r.value, r.delivery_count) for r in again) == [(b"a", 2), (b"b", 2), (b"c", 2)]
    assert handed[0].offset in {r.offset for r in again}


def _broker_config(bootstrap: str, name: str) -> int:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    broker = next(iter(admin.list_topics(timeout=30).brokers))
    resource = ConfigResource(ConfigResource.Type.BROKER, str(broker))
    return int(admin.describe_configs([resource])[resource].result(30)[name].value)


def test_an_expired_lock_hands_the_record_to_another_member_and_the_late_accept_is_refused(
    share: Share,
) -> None:
    # The shortest lock the broker allows (compose/stack lowers its minimum to 1 s for this test; Kafka's
    # default minimum is 15 s).
    lock_ms = _broker_config(share.settings.bootstrap_servers, "group.share.min.record.lock.duration.ms")
    share.admin.configure_share_group(share.group, lock_duration_ms=lock_ms)
    share.write(b"slow")
    holder = share.source()
    (held,) = take(holder, 1)
    other = share.source()
    (again,) = take(other, 1, timeout=JOIN + lock_ms / 1000)
    assert (again.offset, held.delivery_count, again.delivery_count) == (held.offset, 1, 2)
    # Seen: the client takes the late acknowledgement, and the broker refuses it when it is committed
    # (INVALID_RECORD_STATE, to the commit callback): the record is the other member's now.
    holder.accept(held)
    holder.commit()
    assert [(offsets, error.split(" (")[-1]) for offsets, error in share.refused] == [
        ({(share.topic, 0): {held.offset}}, "INVALID_RECORD_STATE)")
    ]
    # Refused indeed: released by its new holder, the group hands it out a third time.
    other.release(again)
    (third,) = take(other, 1)
    assert (third.offset, third.delivery_count) == (held.offset, 3)
    other.accept(third)


def test_records_of_an_aborted_transaction_never_come(share: Share) -> None:
    sink = share.broker.sink(transactional_id=f"{share.group}.tx")
    sink.init_transactions()
    sink.begin()
    sink.send(share.topic, b"aborted", key=None, headers=[])
    sink.flush(30)
    sink.abort()
    sink.begin()
    sink.send(share.topic, b"committed", key=None, headers=[])
    sink.commit()
    source = share.source()
    got = take(source, 1)
    assert [r.value for r in got] == [b"committed"]
    source.accept(got[0])


def test_refused_credentials_are_one_line(share: Share) -> None:
    sasl = os.environ.get("TASKQ_STACK_SASL_BOOTSTRAP")
    assert sasl, "the stack's SASL listener (TASKQ_STACK_SASL_BOOTSTRAP) is not in the environment"
    wrong = Settings.from_env(
        {
            "TASKQ_BOOTSTRAP_SERVERS": sasl,
            "TASKQ_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "TASKQ_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
            "TASKQ_KAFKA_SASL_USERNAME": os.environ.get("TASKQ_STACK_SASL_USERNAME", "taskq"),
            "TASKQ_KAFKA_SASL_PASSWORD": "not-the-password",
            "TASKQ_KAFKA_SSL_CA_LOCATION": os.environ.get("TASKQ_STACK_SASL_CA", ""),
        }
    )
    source = KafkaBroker(wrong).share_source(group=share.group, topics=[share.topic])
    try:
        with pytest.raises(KafkaAuthenticationError, match="refused the connection"):
            wait_until(lambda: source.poll(1, 0.5), timeout=JOIN, what="the refusal", every=0)
    finally:
        with contextlib.suppress(KafkaAuthenticationError):  # closing meets the same refusal
            source.close()
