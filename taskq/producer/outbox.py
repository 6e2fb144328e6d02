"""The transactional outbox's relay: publishes tasks staged by `enqueue(..., conn=)` once their transaction
has committed, then deletes them.

A batch is published inside the Postgres transaction that locks its rows (FOR UPDATE SKIP LOCKED, so relays
publish disjoint batches) and deleted in it only after Kafka acknowledged every record. A relay that dies in
between leaves the rows to the next one, which publishes them again: the same records, task id and
idempotency key included, so the worker runs the effect once. A row is never lost and never becomes a
different task.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from functools import cache
from typing import Any

import psycopg
from prometheus_client import Counter, Histogram

from taskq._core.broker import Broker, RecordSink
from taskq._core.db import Connection, Database, Transaction
from taskq._core.errors import (
    ConfigurationError,
    KafkaAuthenticationError,
    KafkaUnavailableError,
    StoreUnavailableError,
    TaskqError,
)
from taskq._core.kafka_clients import KafkaBroker
from taskq._core.settings import Settings, redact
from taskq._core.store import Store

log = logging.getLogger("taskq.relay")

#: Rows published per transaction.
DEFAULT_BATCH = 500


@dataclass(frozen=True)
class RelayMetrics:
    """The relay's counters and histogram (in the default registry, created on first use)."""

    published: Counter
    lag: Histogram


@cache
def relay_metrics() -> RelayMetrics:
    """The process's relay metrics, created on first use."""
    return RelayMetrics(
        published=Counter("taskq_outbox_published_total", "Outbox rows published to Kafka by a relay"),
        lag=Histogram(
            "taskq_outbox_lag_seconds",
            "Time from staging an outbox row (in the application's transaction) to its publication",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0),
        ),
    )


class OutboxRelay:
    """Publishes one namespace's outbox. `run()` until `stop()`; `relay_once()` publishes one batch."""

    def __init__(
        self,
        settings: Settings,
        *,
        broker: Broker | None = None,
        database: Database | None = None,
        batch: int = DEFAULT_BATCH,
        idle: float = 1.0,
        publish_timeout: float = 30.0,
    ) -> None:
        if batch < 1:
            raise ConfigurationError(f"batch must be >= 1, got {batch}")
        for name, value in (("idle", idle), ("publish_timeout", publish_timeout)):
            if not value > 0:
                raise ConfigurationError(f"{name} must be > 0 seconds, got {value}")
        self.settings = settings
        self.namespace = settings.namespace
        self.batch = batch
        self.idle = idle  # longest wait between looks at the outbox when no notification arrives
        self.publish_timeout = publish_timeout
        self._database = database or Database(settings.database_url, schema=settings.database_schema)
        self._store = Store(self._database)
        # A record not acknowledged within publish_timeout fails then, rather than reaching Kafka later,
        # after its row was given back: the next batch would publish it a second time.
        timeout: dict[str, Any] = {"message.timeout.ms": int(publish_timeout * 1000)}
        self._sink: RecordSink = (broker or KafkaBroker(settings)).sink(**timeout)
        self._conn: Connection | None = None
        self._stop = threading.Event()
        self._metrics = relay_metrics()

    def stop(self) -> None:
        """Ask run() to return after the batch in hand."""
        self._stop.set()

    def relay_once(self) -> int:
        """Publish the oldest batch and delete it; the number of rows published (0: the outbox is empty).

        Raises KafkaUnavailableError if Kafka did not acknowledge every record (the rows stay staged) and
        StoreUnavailableError if Postgres failed (the rows stay staged, or were deleted with the commit).
        """
        conn = self._conn
        if conn is None or conn.closed:
            conn = self._conn = self._database.connect(autocommit=False)
        try:
            with self._database.transaction(conn) as tx:
                rows = self._store.outbox_claim(tx, self.namespace, self.batch)
                if not rows:
                    return 0
                failures: list[str] = []
                for row in rows:
                    self._sink.send(
                        row.topic, row.value, key=row.key, headers=row.headers, on_failure=failures.append
                    )
                left = self._sink.flush(self.publish_timeout + 5)
                if failures or left:
                    why = failures[0] if failures else f"not acknowledged within {self.publish_timeout:g}s"
                    raise KafkaUnavailableError(
                        f"outbox relay: {len(failures) or left} of {len(rows)} record(s) not published "
                        f"({why}); they stay in the outbox"
                    )
                self._store.outbox_delete(tx, [row.id for row in rows])
        except StoreUnavailableError:
            self.close()
            raise
        self._metrics.published.inc(len(rows))
        for row in rows:
            self._metrics.lag.observe(row.age)
        return len(rows)

    def run(self) -> None:
        """Publish until stop(): batch after batch while rows wait, then sleep until a commit notifies.

        Raises KafkaAuthenticationError when the broker refuses the settings: retrying cannot help, and the
        batch it refused stays in the outbox for the next relay.
        """
        listener: Connection | None = None
        backoff = 0.5
        try:
            while not self._stop.is_set():
                try:
                    if listener is None:
                        listener = self._listen()
                    published = self.relay_once()
                    backoff = 0.5
                    if published < self.batch:
                        self._wait(listener)
                except KafkaAuthenticationError:
                    raise
                except TaskqError as exc:
                    log.warning("%s; retrying in %.1fs", exc, backoff)
                    if listener is not None:
                        listener.close()
                        listener = None
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, 10.0)
        finally:
            if listener is not None:
                listener.close()
            self.close()
        self._sink.flush(self.publish_timeout)

    def _listen(self) -> Connection:
        conn = self._database.connect(autocommit=True)
        Transaction(self._database, conn).execute("outbox_listen")
        return conn

    def _wait(self, listener: Connection) -> None:
        # Until a staging transaction commits (its notification), stop(), or `idle` seconds: whichever first.
        deadline = time.monotonic() + self.idle
        try:
            while not self._stop.is_set() and (left := deadline - time.monotonic()) > 0:
                for _ in listener.notifies(timeout=min(left, 0.25), stop_after=1):
                    return
        except psycopg.Error as exc:
            raise StoreUnavailableError(
                redact(f"outbox relay: listening for staged tasks failed: {exc}", self.settings.database_url)
            ) from exc

    def close(self) -> None:
        """Release the relay's Postgres connection (run() does it when it returns)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> OutboxRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
