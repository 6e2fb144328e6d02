"""Fixtures for worker processes: the test app's schemas registered, a ledger table, worker spawning."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from taskq._core.db import Database
from taskq._core.envelope import PRIORITIES
from taskq._core.settings import Settings
from taskq.producer.producer import TaskProducer, TaskSpec
from taskq.schemas import Registry
from tests.acceptance.helpers import WorkerProcess
from tests.apps.app import CREATE_LEDGER, schemas


class App:
    """The test app in one namespace: register its schemas, enqueue, spawn workers, read the ledger."""

    def __init__(self, settings: Settings, env_of: Callable[..., dict[str, str]], tmp_path: Path) -> None:
        self.settings = settings
        self.ns = settings.namespace
        self.env_of = env_of
        self.tmp_path = tmp_path
        self.db = Database(settings.database_url, schema=settings.database_schema)
        with Registry(settings.schema_registry_url) as registry:
            for schema in schemas(self.ns).values():
                registry.register(schema)
        with self.db.connection() as conn:
            conn.execute(CREATE_LEDGER)
        self.producer = TaskProducer(settings)
        self.workers: list[WorkerProcess] = []

    def type(self, name: str) -> str:
        """The full task type of one of the app's records."""
        return f"{self.ns}.{name}"

    def spawn(self, *args: str, **env: str) -> WorkerProcess:
        """Start a worker process."""
        w = WorkerProcess(self.env_of(**env), self.tmp_path / f"worker-{len(self.workers)}.log", *args)
        self.workers.append(w)
        return w

    def query(self, sql: str, *params: Any) -> list[dict[str, Any]]:
        """Rows of a query in the test's schema."""
        with self.db.connection() as conn:
            return list(conn.execute(sql, params).fetchall())

    def scalar(self, sql: str, *params: Any) -> Any:
        """The first column of the first row."""
        rows = self.query(sql, *params)
        return next(iter(rows[0].values())) if rows else None

    def enqueue_ledger(self, keys: list[str], *, copies: int = 2, sleep: float = 0.0) -> None:
        """Each key's Ledger task `copies` times (one idempotency key per key), spread over the tiers."""
        specs = [
            TaskSpec(
                task_type=self.type("Ledger"),
                payload={"key": k, "amount": i, "sleep": sleep},
                idempotency_key=f"ledger:{k}",
                priority=PRIORITIES[i % 4],
            )
            for _ in range(copies)
            for i, k in enumerate(keys)
        ]
        for start in range(0, len(specs), 500):
            self.producer.enqueue_many(specs[start : start + 500])
        self.producer.flush(60)

    def assert_once_each(self, keys: list[str]) -> None:
        """Every key has exactly one ledger row: none doubled, none missing."""
        counts = {r["key"]: r["n"] for r in self.query("SELECT key, count(*) AS n FROM ledger GROUP BY key")}
        doubled = {k: n for k, n in counts.items() if n != 1}
        missing = set(keys) - set(counts)
        assert not doubled, (
            f"{len(doubled)} keys ran more than once, e.g. {list(doubled.items())[:5]}\n{self.logs()}"
        )
        assert not missing, f"{len(missing)} keys never ran, e.g. {sorted(missing)[:5]}\n{self.logs()}"

    def close(self) -> None:
        """Stop every worker and the producer, and close the database."""
        for w in self.workers:
            w.close()
        self.producer.close()
        self.db.close()  # the kept connection, if a test ran named queries on it (`Store(app.db)`)

    def logs(self) -> str:
        """Every worker's output, for failure messages."""
        return "\n".join(f"--- {w.log.name}\n{w.output()[-3000:]}" for w in self.workers)


@pytest.fixture
def app(settings: Settings, env_of: Callable[..., dict[str, str]], tmp_path: Path) -> Iterator[App]:
    """The test app, with its workers stopped at the end."""
    a = App(settings, env_of, tmp_path)
    yield a
    a.close()
