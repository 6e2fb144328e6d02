"""Where a group's consumer starts reading a newly assigned partition: its committed offset, or where
auto.offset.reset points when the group never committed one, without librdkafka's offset-reset back-off."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, OFFSET_INVALID, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient

from taskq._core.broker import Record
from taskq._core.envelope import Topics
from taskq._core.kafka import Sink, Source
from taskq._core.kafka_clients import start_positions
from taskq._core.settings import Settings


def _first(source: Source) -> Record:
    for _ in range(60):
        records = source.poll(10, 1.0)
        if records:
            return records[0]
    raise AssertionError("nothing arrived within 60 polls")


@pytest.mark.partitions(1)
def test_a_new_group_starts_at_the_log_start_at_once_and_a_known_one_at_its_committed_offset(
    settings: Settings,
) -> None:
    topic = Topics(settings.namespace).priority_topics[0]
    sink = Sink(settings)
    for n in range(3):
        sink.send(topic, b"%d" % n, key=None, headers=[], partition=0)
    sink.flush()
    # librdkafka's debug log says when it resets a partition that has no committed offset itself: it then
    # waits 100 ms before it asks for the log's start. The worker's consumer asks at once, so it never does.
    lines: list[str] = []
    logger = logging.getLogger(f"test.rdkafka.{settings.namespace}")
    logger.addHandler(handler := logging.Handler())
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger.setLevel(logging.DEBUG)
    group = f"{settings.namespace}.start"
    source = Source(settings, group=group, debug="topic", logger=logger)
    source.subscribe([topic])
    try:
        first = _first(source)
        assert (first.offset, first.value) == (0, b"0")
        source.commit({first.tp: 2}, asynchronous=False)
    finally:
        source.close()
    assert lines, "librdkafka's debug log reached the test"
    assert not [line for line in lines if "no previously committed offset" in line]

    again = Source(settings, group=group)
    again.subscribe([topic])
    try:
        assert _first(again).offset == 2  # the committed offset, not the log's start
    finally:
        again.close()


@pytest.mark.partitions(1)
def test_a_new_group_starts_where_the_log_starts_once_its_first_records_are_deleted(settings: Settings) -> None:
    # Retention (or DeleteRecords) moved the log's start past 0: a group that never committed starts where the
    # log starts now, not at 0 (out of range) and not at its end.
    topic = Topics(settings.namespace).priority_topics[0]
    sink = Sink(settings)
    for n in range(5):
        sink.send(topic, b"%d" % n, key=None, headers=[], partition=0)
    sink.flush()
    admin = AdminClient({"bootstrap.servers": settings.bootstrap_servers, **settings.kafka})
    admin.delete_records([TopicPartition(topic, 0, 3)])[TopicPartition(topic, 0, 3)].result(30)
    source = Source(settings, group=f"{settings.namespace}.moved")
    source.subscribe([topic])
    try:
        first = _first(source)
        assert (first.offset, first.value) == (3, b"3")
    finally:
        source.close()


@dataclass
class _Unread:
    topic: str
    partition: int
    offset: int
    leader_epoch: int
    error: KafkaError


def test_start_positions_keep_committed_offsets_and_reset_the_others() -> None:
    committed = TopicPartition("t", 0, 7, leader_epoch=3)
    never = TopicPartition("t", 1, OFFSET_INVALID)
    # As Consumer.committed() returns a partition whose offset it could not read (TopicPartition's error is
    # read-only, so a record of the same fields stands in for it).
    unreadable = _Unread("t", 2, OFFSET_INVALID, -1, KafkaError(KafkaError.UNSTABLE_OFFSET_COMMIT))
    out = start_positions([committed, never, unreadable], OFFSET_BEGINNING)  # type: ignore[list-item]
    assert [(p.partition, p.offset) for p in out] == [(0, 7), (1, OFFSET_BEGINNING), (2, OFFSET_INVALID)]
    assert out[0].leader_epoch == 3
    assert start_positions([never], OFFSET_END)[0].offset == OFFSET_END
    assert start_positions([never], None)[0].offset == OFFSET_INVALID  # auto.offset.reset=error: librdkafka's
