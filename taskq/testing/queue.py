"""`InMemoryQueue`: a producer, a worker and the delay forwarder over the in-memory fakes."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from taskq._core.envelope import Topics
from taskq._core.errors import TaskqError
from taskq._core.settings import Settings
from taskq.consumer.dlq import DeadLetters, DlqRecord, parse_record
from taskq.consumer.events import Hook, TaskCompleted
from taskq.consumer.forwarder import Forwarder
from taskq.consumer.handlers import Handlers
from taskq.consumer.worker import Worker, WorkerConfig
from taskq.producer.admin import topic_specs
from taskq.producer.producer import TaskProducer
from taskq.testing.broker import InMemoryBroker
from taskq.testing.clock import Clock
from taskq.testing.recording import RecordingHook
from taskq.testing.registry import InMemoryRegistry
from taskq.testing.store import InMemoryStore


class InMemoryQueue:
    """A producer, a worker and the delay forwarder of `handlers` over the in-memory fakes.

    `run_until_idle()` runs until every task is done: completed, skipped as a duplicate, or dead-lettered,
    retries included; delays and backoff are fast-forwarded on `clock`, so nothing waits for real.
    `hooks` get the worker's events as a real worker's hooks do, beside `events`, which records them all.
    """

    def __init__(
        self,
        handlers: Handlers,
        *,
        namespace: str = "taskq",
        concurrency: int = 4,
        connect: Callable[[], Any] | None = None,
        hooks: Sequence[Hook] = (),
    ) -> None:
        self.clock = Clock()
        self.settings = Settings(namespace=namespace)
        self.topics = Topics(self.settings.namespace, self.settings.delay_tiers)
        self.broker = InMemoryBroker(clock=self.clock.time)
        self.broker.admin().create_topics(topic_specs(self.settings, partitions=2))
        self.registry = InMemoryRegistry()
        for spec in handlers:
            if spec.schema is not None:
                self.registry.register(spec.schema)
        self.store = InMemoryStore(
            owner="in-memory", namespace=namespace, clock=self.clock.time, connect=connect
        )
        self.producer = TaskProducer(
            self.settings, registry=self.registry, broker=self.broker, records=self.store
        )
        self.events = RecordingHook()
        self.worker = Worker(
            handlers,
            self.settings,
            WorkerConfig(
                concurrency=concurrency, forwarder=False, commit_interval=0.001, worker_id="in-memory"
            ),
            broker=self.broker,
            store=self.store,
            registry=self.registry,
            hooks=[self.events, *hooks],
            clock=self.clock.monotonic,
        )
        self.forwarder = Forwarder(
            self.settings, instance_id="in-memory", broker=self.broker, clock=self.clock.time
        )
        self._started = False
        self._relay_sink = self.broker.sink()

    @property
    def completed(self) -> list[TaskCompleted]:
        """The tasks whose completion was recorded, in order."""
        return self.events.of(TaskCompleted)

    @property
    def dlq(self) -> DeadLetters:
        """The DLQ tools over the fakes: list, show and replay, as `taskq dlq` does."""
        return DeadLetters(self.settings, broker=self.broker, registry=self.registry, store=self.store)

    @property
    def dead_letters(self) -> list[DlqRecord]:
        """The DLQ's records, oldest first, with why each failed."""
        return [parse_record(r) for r in self.broker.records(self.topics.dlq)]

    def run_until_idle(self, *, timeout: float = 60.0) -> None:
        """Run until nothing is left to do; TaskqError if that takes more than `timeout` real seconds."""
        if not self._started:
            self.worker.start()
            self.forwarder.start()
            self._started = True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._relay()
            self.producer.flush()
            if self.forwarder.step(wait=0.0):
                continue
            pending = self.broker.uncommitted(self.worker.group, self.topics.priority_topics)
            if pending or not self.worker.idle():
                due = self.worker.waiting_until()
                if due is not None:
                    self.clock.advance(due - self.clock.monotonic())
                self.worker.step()
                continue
            if self.broker.uncommitted(self.forwarder.group, self.topics.delay_topics) == 0:
                return
            due = self.forwarder.next_due()
            if due is not None:
                self.clock.advance(due - self.clock.time())
        raise TaskqError(f"the in-memory queue was still busy after {timeout}s")

    def _relay(self) -> None:
        """Publish what workflows staged (the outbox relay's part)."""
        staged = self.store.take_staged()
        if staged:
            for topic, key, value, headers in staged:
                self._relay_sink.send(topic, value, key=key, headers=headers)
            self._relay_sink.flush()

    def close(self) -> None:
        """Stop the worker's executor and release everything."""
        if self._started:
            self.worker.close()
            self.forwarder.close()
        self.producer.close()

    def __enter__(self) -> InMemoryQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
