"""The worker's start-up: the registry made and warmed on a thread of its own, and a start that fails
halfway leaving nothing behind."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from taskq import Handlers
from taskq._core.errors import ConfigurationError, KafkaAuthenticationError, StoreUnavailableError
from taskq._core.settings import Settings
from taskq.consumer.store import WorkerRecord
from taskq.consumer.worker import Worker, WorkerConfig
from taskq.producer.admin import topic_specs
from taskq.schemas.registry import PendingRegistry, SchemaRegistry
from taskq.testing import InMemoryBroker, InMemoryRegistry, InMemoryStore

JOB = {"type": "record", "name": "Job", "namespace": "unit", "fields": [{"name": "n", "type": "long"}]}


class _Counting(InMemoryRegistry):
    """An in-memory registry counting the latest-version look-ups of each subject."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []

    def latest(self, subject: str):  # type: ignore[no-untyped-def]
        self.asked.append(subject)
        return super().latest(subject)


def _run_until_it_stops(worker: Worker) -> list[BaseException]:
    """Run the worker on a thread for up to 20 s (then stop it); what its run raised."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            worker.run()
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(20)
    if thread.is_alive():
        worker.stop()
        thread.join(20)
    return failed


def test_calls_wait_for_the_registry_and_the_subjects_are_looked_up_ahead_once_asked() -> None:
    made = _Counting()
    schema_id = made.register(JOB).schema_id
    gate = threading.Event()

    def make() -> SchemaRegistry:
        gate.wait(10)
        return made

    pending = PendingRegistry(make)
    assert pending.cached(schema_id) is None  # not made yet: the loop's cache check does not wait
    gate.set()
    assert pending.by_id(schema_id) is made.by_id(schema_id)  # waits until made
    assert made.asked == []  # nothing is looked up ahead until asked
    pending.look_up_ahead(["unit.Job", "unit.Unregistered"])
    pending._thread.join(10)
    assert made.asked == ["unit.Job", "unit.Unregistered"]  # an unknown subject is no error ahead of need
    assert pending.cached(schema_id) is not None
    pending.close()


def test_what_making_the_registry_raised_every_call_raises() -> None:
    def make() -> SchemaRegistry:
        raise ConfigurationError("schema registry client for https://r: bad PEM")

    pending = PendingRegistry(make)
    for call in (lambda: pending.by_id(1), lambda: pending.latest("unit.Job"), lambda: pending.lookup(JOB)):
        with pytest.raises(ConfigurationError, match="bad PEM"):
            call()
    pending.close()  # nothing was made: nothing to close, no error


class _Unreachable(InMemoryStore):
    """A store whose liveness record cannot be written: Postgres is away."""

    def enter(self, worker: WorkerRecord, alive: Callable[[int], bool]) -> set[str]:
        raise StoreUnavailableError("Postgres unreachable")


def test_a_start_that_fails_after_joining_the_group_leaves_it() -> None:
    settings = Settings(namespace="unit")
    broker = InMemoryBroker()
    broker.admin().create_topics(topic_specs(settings, partitions=2))
    handlers = Handlers()
    worker = Worker(
        handlers,
        settings,
        WorkerConfig(worker_id="w", forwarder=False),
        broker=broker,
        store=_Unreachable(owner="w"),
        registry=InMemoryRegistry(),
    )
    with pytest.raises(StoreUnavailableError):
        worker.start()
    assert worker._source is None
    assert broker._group(settings.worker_group).members == []  # left: its partitions go to the others


def test_a_worker_without_a_registry_given_makes_one_and_looks_up_its_handlers_subjects_at_start() -> None:
    made = _Counting()
    made.register(JOB)
    handlers = Handlers()

    @handlers.task("unit.Job", schema=JOB)
    def job(payload: dict[str, int], ctx: object) -> None:
        pass

    settings = Settings(namespace="unit")
    broker = InMemoryBroker()
    broker.admin().create_topics(topic_specs(settings, partitions=1))
    worker = Worker(
        handlers, settings, WorkerConfig(forwarder=False), broker=broker, store=InMemoryStore(owner="w")
    )
    assert isinstance(worker.registry, PendingRegistry)
    worker.registry.close()
    worker.registry = pending = PendingRegistry(lambda: made)  # the real one's stand-in, made the same way
    worker._pending_registry = pending
    worker.start()
    pending._thread.join(10)
    assert made.asked == ["unit.Job"]
    worker.close()


def test_a_worker_whose_registry_settings_are_refused_stops_with_that_error_before_any_record() -> None:
    # The registry is made on its own thread: its settings' failure (a CA file that holds no certificate)
    # must still stop the worker, not wait for the first record that needs the registry.
    def make() -> SchemaRegistry:
        raise ConfigurationError("TASKQ_SCHEMA_REGISTRY_CA_FILE: no certificate in '/etc/ca.pem'")

    settings = Settings(namespace="unit")
    broker = InMemoryBroker()
    broker.admin().create_topics(topic_specs(settings, partitions=1))
    worker = Worker(
        Handlers(), settings, WorkerConfig(forwarder=False), broker=broker, store=InMemoryStore(owner="w")
    )
    assert isinstance(worker.registry, PendingRegistry)
    worker.registry.close()
    worker.registry = worker._pending_registry = PendingRegistry(make)
    failed = _run_until_it_stops(worker)
    assert [type(e).__name__ for e in failed] == ["ConfigurationError"], failed


def test_closing_a_pending_registry_ends_its_thread_even_during_a_look_up_ahead() -> None:
    # A daemon thread still in a request when the interpreter finalizes can crash the process.
    entered = threading.Event()

    class _Slow(InMemoryRegistry):
        def latest(self, subject: str):  # type: ignore[no-untyped-def]
            entered.set()
            threading.Event().wait(0.5)
            return super().latest(subject)

    pending = PendingRegistry(_Slow)
    pending.look_up_ahead(["unit.Job"])
    assert entered.wait(10)
    pending.close()
    assert not pending._thread.is_alive()


class _RefusedOnLeave(InMemoryBroker):
    """A broker whose consumers cannot leave the group: the credentials were refused meanwhile."""

    def source(self, **kw: Any) -> Any:
        source = super().source(**kw)

        def close() -> None:
            raise KafkaAuthenticationError("Kafka refused the connection (check the TASKQ_KAFKA_* settings)")

        source.close = close
        return source


def test_a_worker_that_cannot_leave_its_group_still_releases_everything_else() -> None:
    settings = Settings(namespace="unit")
    broker = _RefusedOnLeave()
    broker.admin().create_topics(topic_specs(settings, partitions=1))
    store = InMemoryStore(owner="w")
    worker = Worker(
        Handlers(), settings, WorkerConfig(forwarder=False), broker=broker, store=store, registry=InMemoryRegistry()
    )
    closed: list[str] = []
    worker.registry.close = lambda: closed.append("registry")  # type: ignore[method-assign]
    worker.start()
    assert store.workers  # its liveness record
    worker.close()
    assert closed == ["registry"]
    assert not store.workers  # a clean stop removes the record: the keys it held are not waited for


class _BrokenForwarder:
    """A delay forwarder that fails on its own a moment after it starts."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def run(self) -> None:
        raise RuntimeError("the forwarder's own bug")

    def stop(self) -> None:
        pass


def test_a_worker_whose_forwarder_stops_on_its_own_stops_too(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Run on without its forwarder, a worker would release no delayed task again, and look healthy.
    monkeypatch.setattr("taskq.consumer.worker.Forwarder", _BrokenForwarder)
    settings = Settings(namespace="unit")
    broker = InMemoryBroker()
    broker.admin().create_topics(topic_specs(settings, partitions=1))
    worker = Worker(
        Handlers(),
        settings,
        WorkerConfig(forwarder=True),
        broker=broker,
        store=InMemoryStore(owner="w"),
        registry=InMemoryRegistry(),
    )
    failed = _run_until_it_stops(worker)
    assert [str(e) for e in failed] == [
        "the delay forwarder stopped (its error is logged above); the worker stops"
    ], failed
    assert "the forwarder's own bug" in caplog.text
