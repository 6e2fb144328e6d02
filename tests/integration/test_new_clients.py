"""A new Kafka client's first moments: what librdkafka makes a just-made producer wait for, and what the
project does so that it need not."""

from __future__ import annotations

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
