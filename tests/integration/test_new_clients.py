"""A new Kafka client's first moments: what librdkafka makes a just-made producer wait for, and what the
project does so that it need not."""

from __future__ import annotations

import logging

from taskq._core.envelope import Topics
from taskq._core.kafka import Sink
from taskq._core.settings import Settings


def test_a_new_producers_first_record_does_not_wait_for_the_producer_id_timer(settings: Settings) -> None:
    # librdkafka (2.10 on) drops the bootstrap broker as soon as the cluster's metadata names the brokers. An
    # idempotent producer asks for its producer id at that moment, finds no broker up, and asks again after
    # the next metadata answer or when its 500 ms timer fires. A record sent at once had its topic's metadata
    # in the first answer, so it waited for the timer, and with a 450 ms timeout it always timed out. The
    # Sink asks for the cluster's metadata again once a learned broker can answer, and the id comes with it.
    topic = Topics(settings.namespace).priority_topics[0]
    sink = Sink(settings, **{"message.timeout.ms": 450})
    outcomes: list[str | None] = []
    sink.send(topic, b"first", key=None, headers=[], on_delivery=lambda err, _record: outcomes.append(err))
    assert sink.flush(10) == 0
    assert outcomes == [None]


def test_a_new_transactional_producer_registers_its_id_without_waiting_for_the_timer(settings: Settings) -> None:
    # The same timer held a transactional producer's registration (the delay forwarder's start, and its
    # fencing of a dead predecessor's id): 508-512 ms in 5 of 6 starts, against some 20 with the Sink's
    # metadata requests. A registration given 450 ms so failed in most starts.
    sink = Sink(settings, transactional_id=f"{settings.namespace}.first")
    sink.init_transactions(timeout=0.45)
    sink.begin()
    sink.send(Topics(settings.namespace).priority_topics[0], b"first", key=None, headers=[])
    sink.commit()


def test_a_new_producers_early_metadata_requests_name_the_topic_it_sends_to(settings: Settings) -> None:
    # The early requests' answers are what the producer id waits for, whatever they hold. The whole cluster's
    # metadata is a few MB on a cluster of thousands of topics; the topic the first record goes to is what
    # the send asks for anyway (and all a broker's auto-creation could act on).
    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    log = logging.getLogger(f"test.new_clients.{settings.namespace}")
    log.addHandler(Lines())
    log.setLevel(logging.DEBUG)
    log.propagate = False
    topic = Topics(settings.namespace).priority_topics[0]
    sink = Sink(settings, debug="metadata", logger=log, **{"message.timeout.ms": 450})
    outcomes: list[str | None] = []
    sink.send(topic, b"first", key=None, headers=[], on_delivery=lambda err, _record: outcomes.append(err))
    assert sink.flush(10) == 0
    assert outcomes == [None]
    requests = [line for line in lines if "Request metadata for" in line]
    # Whichever asks first, the early request ("application requested") or the client's own on connecting
    # ("connected", when the connection is up before the early request is made and it joins that one).
    assert any("1 topic(s)" in line for line in requests), requests
    assert not any("all topics" in line for line in requests), requests
