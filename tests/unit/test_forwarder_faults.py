"""The delay forwarder on the fakes when a transaction fails: it is ended, and the batch read again."""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest

from taskq._core.envelope import Envelope, Topics
from taskq._core.errors import KafkaUnavailableError
from taskq._core.settings import Settings
from taskq.consumer.forwarder import Forwarder
from taskq.producer.admin import topic_specs
from taskq.producer.producer import TaskProducer
from taskq.testing import Clock, InMemoryBroker, InMemoryRegistry

JOB = {"type": "record", "name": "Job", "namespace": "unit", "fields": [{"name": "n", "type": "long"}]}


def _delays(settings: Settings) -> tuple[Clock, InMemoryBroker, TaskProducer]:
    """A fake broker on a fake clock with the namespace's topics, and a producer of unit.Job on it."""
    clock = Clock()
    broker = InMemoryBroker(clock=clock.time)
    broker.admin().create_topics(topic_specs(settings, partitions=2))
    registry = InMemoryRegistry()
    registry.register(JOB)
    return clock, broker, TaskProducer(settings, registry=registry, broker=broker)


def test_a_fenced_forwarder_replaces_its_producer_and_forwards_each_task_once_in_its_membership() -> None:
    settings = Settings(namespace="unit")
    clock, broker, producer = _delays(settings)
    events: list[tuple[str, dict[str, Any]]] = []
    forwarder = Forwarder(
        settings, instance_id="f", broker=broker, clock=clock.time, on_event=lambda *e: events.append(e)
    )
    topics = Topics(settings.namespace, settings.delay_tiers)

    def released() -> Counter[str]:
        records = [r for t in topics.priority_topics for r in broker.records(t)]
        return Counter(Envelope.from_headers(r.headers).task_id for r in records)

    def enqueue(first: int) -> list[str]:
        ids = [
            producer.enqueue("unit.Job", {"n": n}, delay=timedelta(seconds=1)).task_id
            for n in range(first, first + 5)
        ]
        producer.flush()
        clock.advance(2)
        return ids

    forwarder.start()
    try:
        assert forwarder._clients is not None
        source = forwarder._clients[1]
        ids = enqueue(0)
        while sum(released().values()) < 5:
            forwarder.step(wait=0.0)
        # A newer producer of the forwarder's transactional id fences it: its next transaction fails.
        broker.sink(transactional_id=f"{forwarder.group}.f").init_transactions()
        ids += enqueue(5)
        while broker.uncommitted(forwarder.group, topics.delay_topics):
            forwarder.step(wait=0.0)
        assert [kind for kind, _ in events].count("transaction_failed") == 1, events
        assert released() == Counter(ids)  # each once: nothing lost, nothing doubled
        assert forwarder._clients[1] is source  # the same group membership throughout
    finally:
        forwarder.close()


def test_a_forwarder_ends_the_transaction_its_dead_predecessor_left_open_when_it_starts() -> None:
    settings = Settings(namespace="unit")
    broker = InMemoryBroker()
    broker.admin().create_topics(topic_specs(settings, partitions=2))
    topics = Topics(settings.namespace, settings.delay_tiers)
    # A forwarder killed mid-transaction: its records sent, the transaction never ended.
    killed = broker.sink(transactional_id=f"{settings.namespace}.forwarder.dead")
    killed.init_transactions()
    killed.begin()
    killed.send(topics.tier("normal"), b"unfinished", key=None, headers=[])
    forwarder = Forwarder(settings, instance_id="next", broker=broker, predecessors=["dead"])
    forwarder.start()
    try:
        with pytest.raises(KafkaUnavailableError, match="fenced"):
            killed.commit()
    finally:
        forwarder.close()
    assert broker.records(topics.tier("normal")) == []


class _ClientsFailingOnce:
    """The fake broker's clients, with the first poll failing as if the broker were away and the first
    producer's flush raising what no client error is (as a fenced producer's flush did, a log callback
    running with the client's error pending)."""

    def __init__(self, real: InMemoryBroker) -> None:
        self.real = real
        self.polled = self.flushed = False

    def source(self, **kw: Any) -> Any:
        source = self.real.source(**kw)
        poll = source.poll

        def failing_poll(max_records: int, timeout: float) -> Any:
            if not self.polled:
                self.polled = True
                raise KafkaUnavailableError("polling: broker away")
            return poll(max_records, timeout)

        source.poll = failing_poll  # type: ignore[method-assign]
        return source

    def sink(self, **kw: Any) -> Any:
        sink = self.real.sink(**kw)
        flush = sink.flush

        def failing_flush(timeout: float | None = None) -> int:
            if not self.flushed:
                self.flushed = True
                raise SystemError("<class 'logging.LogRecord'> returned a result with an exception set")
            return flush(timeout)

        sink.flush = failing_flush  # type: ignore[method-assign]
        return sink

    def admin(self) -> Any:
        return self.real.admin()


def test_a_forwarder_whose_client_raises_an_unexpected_error_while_closing_starts_over_and_forwards() -> None:
    settings = Settings(namespace="unit")
    clock, real, producer = _delays(settings)
    ids = [producer.enqueue("unit.Job", {"n": n}, delay=timedelta(seconds=1)).task_id for n in range(5)]
    producer.flush()
    clock.advance(2)
    broker = _ClientsFailingOnce(real)
    forwarder = Forwarder(settings, instance_id="f", broker=broker, clock=clock.time)
    thread = threading.Thread(target=forwarder.run, daemon=True)
    thread.start()
    topics = Topics(settings.namespace, settings.delay_tiers)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and thread.is_alive():
            records = [r for t in topics.priority_topics for r in real.records(t)]
            if len(records) >= len(ids):
                break
            time.sleep(0.05)
        assert broker.flushed, "the forwarder never started over"
        assert thread.is_alive(), "the forwarder's thread died closing its clients"
        records = [r for t in topics.priority_topics for r in real.records(t)]
        assert Counter(Envelope.from_headers(r.headers).task_id for r in records) == Counter(ids)
    finally:
        forwarder.stop()
        thread.join(10)


class _OffsetsGivenUpOnce:
    """The fake broker's clients, with the forwarder's first producer given up while adding offsets, as the
    real Sink gives up a send_offsets_to_transaction that had no answer (a broker killed): the call raises
    and so does every later one, abort included. With `landed`, the transaction committed all the same
    (the broker finished it behind the given-up call); without, it is still open when the new producer
    fences it."""

    def __init__(self, real: InMemoryBroker, *, landed: bool) -> None:
        self.real = real
        self.landed = landed
        self.sinks: list[Any] = []

    def source(self, **kw: Any) -> Any:
        return self.real.source(**kw)

    def sink(self, **kw: Any) -> Any:
        sink = self.real.sink(**kw)
        self.sinks.append(sink)
        if len(self.sinks) > 1:
            return sink
        add, commit = sink.commit_offsets_in_transaction, sink.commit
        given_up = "adding offsets to the transaction had no answer within 10 s"

        def add_given_up(source: Any, offsets: Any, timeout: float = 10.0) -> None:
            if self.landed:
                add(source, offsets, timeout)
                commit(timeout)
            raise KafkaUnavailableError(
                "adding offsets to the transaction: no answer within 10 s; the producer is given up"
            )

        def refused(timeout: float = 10.0) -> None:
            raise KafkaUnavailableError(f"aborting the transaction: this producer was given up ({given_up})")

        sink.commit_offsets_in_transaction = add_given_up
        sink.abort = refused
        return sink

    def admin(self) -> Any:
        return self.real.admin()


@pytest.mark.parametrize("landed", [True, False], ids=["committed_after_all", "left_open"])
def test_a_forwarder_whose_transaction_is_given_up_and_cannot_be_aborted_forwards_each_task_once(
    landed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # The corner seen once on a 3-broker cluster with a broker killed: adding the offsets had no answer, the
    # abort was refused, the producer was replaced. Whichever way the given-up transaction ended, the new
    # producer (same transactional id) fences the old one before the committed offsets are read, so the
    # batch is forwarded again only if it did not land.
    settings = Settings(namespace="unit")
    clock, real, producer = _delays(settings)
    ids = [producer.enqueue("unit.Job", {"n": n}, delay=timedelta(seconds=1)).task_id for n in range(5)]
    producer.flush()
    clock.advance(2)
    broker = _OffsetsGivenUpOnce(real, landed=landed)
    events: list[tuple[str, dict[str, Any]]] = []
    forwarder = Forwarder(
        settings, instance_id="f", broker=broker, clock=clock.time, on_event=lambda *e: events.append(e)
    )
    topics = Topics(settings.namespace, settings.delay_tiers)
    forwarder.start()
    try:
        # Steps past the failure too: a batch read again would be forwarded by the step after it.
        for _ in range(5):
            forwarder.step(wait=0.0)
        assert [kind for kind, _ in events].count("transaction_failed") == 1, events
        assert "producer replaced (abort failed" in caplog.text
        assert forwarder._clients is not None and forwarder._clients[0] is broker.sinks[1]
        assert [s._transactional_id for s in broker.sinks] == [f"{forwarder.group}.f"] * 2
        records = [r for t in topics.priority_topics for r in real.records(t)]
        assert Counter(Envelope.from_headers(r.headers).task_id for r in records) == Counter(ids)
        assert not real.uncommitted(forwarder.group, topics.delay_topics)
    finally:
        forwarder.close()
