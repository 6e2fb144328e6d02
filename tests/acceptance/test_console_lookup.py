"""The console's task lookup: a record shows how often it was taken over from workers that died, and how
many of those runs were known to be running."""

from __future__ import annotations

import json
import re
import urllib.request
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from taskq._core.db import Database
from taskq._core.settings import Settings
from taskq.consumer.store import ClaimRequest, IdempotencyStore, WorkerRecord
from tests.acceptance.helpers import console_process, wait_until


def test_a_task_taken_over_from_dead_workers_says_so(
    env_of: Callable[..., dict[str, str]], settings: Settings, tmp_path: Path
) -> None:
    db = Database(settings.database_url, schema=settings.database_schema)
    a, b = (IdempotencyStore(db, owner=o, namespace=settings.namespace, stale_after=0.3) for o in "ab")
    for store in (a, b):
        store.enter(WorkerRecord(store.owner, settings.namespace, "g", "h", 1, 4, datetime.now(UTC)), lambda p: True)
    req = [ClaimRequest("k", "id-k", "t.Task", 300.0)]

    def take(store: IdempotencyStore) -> None:
        def taken() -> bool:
            # A live worker beats: only a worker that beats judges the others by their heartbeats.
            store.beat(WorkerRecord(store.owner, settings.namespace, "g", "h", 1, 4, datetime.now(UTC)), 0)
            return store.claim(req)[0].outcome == "claimed"

        wait_until(taken, timeout=10, what="a stale heartbeat")

    try:
        a.claim(req)
        take(b)  # a died with k claimed ahead: a takeover
        assert b.mark_started([("k", 1)]) == {"k"}
        take(a)  # b died running it: a takeover of a run known to be running
        with console_process(env_of(), tmp_path / "console.log", probe="/") as url:
            with urllib.request.urlopen(url + "/tasks?q=k", timeout=30) as r:
                page = r.read().decode()
        cell = re.search(r'id="task-attempts">([^<]*)<', page)
        assert cell is not None, page
        assert cell[1] == "1 (taken over 2 time(s) from workers that died, 1 of them while known to be running)"
    finally:
        a.close()
        b.close()


def test_the_console_of_a_namespace_with_no_topics_yet_serves_its_pages_with_the_hint(
    env_of: Callable[..., dict[str, str]], tmp_path: Path
) -> None:
    env = env_of(TASKQ_NAMESPACE=f"bare{uuid.uuid4().hex[:10]}")  # nobody created its topics
    with console_process(env, tmp_path / "console.log", "--host", "127.0.0.1", probe="/") as url:
        with urllib.request.urlopen(url + "/", timeout=30) as r:
            assert r.status == 200
            assert "no topics yet: run `taskq topics create`" in r.read().decode()
        with urllib.request.urlopen(url + "/api/overview", timeout=30) as r:
            data = json.loads(r.read())
        assert data["hint"] == "no topics yet: run `taskq topics create`" and len(data["missing_topics"]) == 5
