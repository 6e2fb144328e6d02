"""A record whose outcome is long in coming holds its partition's commits back: the worker says where."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from taskq._core.kafka import TP
from taskq._core.settings import Settings
from taskq._core.store import Pauses
from taskq.consumer.handlers import Handlers
from taskq.consumer.stalls import HELD_BACK_AFTER
from taskq.consumer.store import ClaimRequest, WorkerRecord
from taskq.consumer.worker import Worker, WorkerConfig
from taskq.testing import InMemoryRegistry, InMemoryStore
from tests.unit.test_worker_claims import Clock, GatedStore, record, stop
from tests.unit.test_worker_rebalance import NS, SCHEMA, SCHEMA_ID, RecordingSource

PART: TP = (f"{NS}.normal", 0)


class LaggingSource(RecordingSource):
    """Where the worker's periodic checks read positions: `at` is each partition's (position, end)."""

    def __init__(self) -> None:
        super().__init__()
        self.at: dict[TP, tuple[int, int]] = {}

    def lag(self) -> dict[TP, int]:
        return {}

    def position(self, tp: TP) -> int:
        return self.at.get(tp, (-1, -1))[0]

    def high_watermarks(self, tps: Any) -> dict[TP, int]:
        return {tp: self.at.get(tp, (-1, -1))[1] for tp in tps}


def worker(
    job: Callable[[dict[str, Any], Any], None],
    store: InMemoryStore | None = None,
    *,
    recorder: bool = False,
    **config: Any,
) -> tuple[Worker, Clock, LaggingSource]:
    """A worker of one task type running `job`, on a fake clock, its one partition assigned; with `recorder`
    its store records on a thread of its own."""
    handlers = Handlers()
    handlers.task(f"{NS}.Job", schema=SCHEMA)(job)
    registry = InMemoryRegistry()
    registry._by_id[SCHEMA_ID] = registry.register(SCHEMA)
    w = Worker(
        handlers,
        Settings(namespace=NS),
        WorkerConfig(forwarder=False, **config),
        store=(store := store or InMemoryStore(owner="w", namespace=NS)),
        recorder=store if recorder else None,
        registry=registry,
        clock=(clock := Clock()),
    )
    w._source = source = LaggingSource()  # type: ignore[assignment]
    w._assigned_cb([PART])
    return w, clock, source


def test_a_running_task_holding_back_finished_ones_is_named_once_at_info_with_where_it_is(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = threading.Event()

    def job(payload: dict[str, Any], ctx: Any) -> None:
        if payload["n"] == 0:
            release.wait(30)

    w, clock, _ = worker(job, concurrency=4)
    try:
        for offset in range(4):
            w._accept(record(PART, offset))
        w._claim_arrived()
        w._dispatch()
        while w._offsets.tracker.pending(PART) > 1:  # 1..3 finish and are recorded; 0 runs on
            w._collect(block=1.0)
            w._completer.flush()
        with caplog.at_level(logging.INFO, logger="taskq.worker"):
            w._observe()  # the sample that first sees offset 0 at the watermark
            clock.now += HELD_BACK_AFTER
            w._observe()
            clock.now += HELD_BACK_AFTER
            w._observe()
        # A long task holds the commits back by design: said at info, not as a warning.
        [(level, line)] = [
            (r.levelno, r.getMessage()) for r in caplog.records if "held back" in r.getMessage()
        ]
        assert level == logging.INFO
        held = f"{PART[0]}[0] offset 0 has held back the commit of 3 finished record(s)"
        assert line.startswith(held), line
        assert f"task id-{PART[0]}-0-0 is running, attempt 1" in line, line
    finally:
        release.set()
        stop(w)


def test_where_names_a_claim_unanswered_and_a_task_held_for_its_key() -> None:
    store = GatedStore()
    w, clock, _ = worker(lambda payload, ctx: None, store, recorder=True, concurrency=1)
    try:
        w._accept(record(PART, 0))
        w._claim_arrived()
        assert store.entered.wait(10)
        clock.now += 75
        assert w._watch.where(PART, 0) == f"task id-{PART[0]}-0-0: claim sent 75 s ago, unanswered"
        [task] = next(iter(w._claims.sent.values()))[1]
        store.gate.set()
        w._completer.wait_claimed(10)
        w._claims.held.clear()
        w._scheduler.remove_if(lambda t: True)
        w._claims.hold([task], 2.0)
        assert w._watch.where(PART, 0).startswith(f"task id-{PART[0]}-0-0 is held (its key leased elsewhere")
        past = "its outcome is being recorded, or its retry or DLQ record acknowledged"
        assert w._watch.where(PART, 1) == past
    finally:
        store.gate.set()
        stop(w)


@pytest.mark.parametrize(
    ("at", "said"),
    [
        ((10, 43), "has 33 record(s) to read from offset 10 and none fetched for over 60 s (not paused)"),
        ((-1, -1), "has not been fetched for over 60 s since it was assigned (not paused)"),
    ],
)
def test_a_partition_standing_still_with_records_to_read_is_named_once(
    caplog: pytest.LogCaptureFixture, at: tuple[int, int], said: str
) -> None:
    # CI's Postgres-restart failure: 33 records of one partition uncommitted for 2 minutes, every key done
    # (by the other copies, on other partitions), and nothing in the logs. Never fetched, or held in the
    # worker: the warnings tell them apart.
    w, clock, source = worker(lambda payload, ctx: None)
    source.at[PART] = at
    try:
        with caplog.at_level(logging.WARNING, logger="taskq.worker"):
            for _ in range(3):
                w._observe()
                clock.now += HELD_BACK_AFTER / 2
        lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert lines == [f"{PART[0]}[0] {said}"], lines
        source.at[PART] = (at[1], at[1])  # read to its end: no more warnings
        with caplog.at_level(logging.WARNING, logger="taskq.worker"):
            clock.now += HELD_BACK_AFTER * 2
            w._observe()
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    finally:
        stop(w)


def test_a_partition_of_a_tier_an_operator_paused_stands_still_without_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    w, clock, source = worker(lambda payload, ctx: None)
    w._dispatcher.pauses = Pauses(tiers=frozenset({"normal"}))
    source.at[PART] = (10, 43)
    try:
        with caplog.at_level(logging.WARNING, logger="taskq.worker"):
            for _ in range(4):
                w._observe()
                clock.now += HELD_BACK_AFTER / 2
        assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    finally:
        stop(w)


def test_a_task_held_for_its_key_holding_back_finished_ones_is_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = InMemoryStore(owner="w", namespace=NS)
    # Another worker, alive, leases the first record's key for an hour: its claim answers "running".
    other = InMemoryStore(owner="other", namespace=NS, rows=store.rows, workers=store.workers)
    other.enter(WorkerRecord("other", NS, "g", "h", 1, 4, datetime.now(UTC)), lambda pid: True)
    other.claim([ClaimRequest(f"k-{PART[0]}-0-0", "t", f"{NS}.Job", 3600.0)])
    w, clock, _ = worker(lambda payload, ctx: None, store, concurrency=2)
    try:
        for offset in range(3):
            w._accept(record(PART, offset))
        w._claim_arrived()
        w._dispatch()
        while w._offsets.tracker.pending(PART) > 1:  # 1 and 2 finish; 0 waits for its key
            w._collect(block=1.0)
            w._completer.flush()
        with caplog.at_level(logging.WARNING, logger="taskq.worker"):
            w._observe()
            clock.now += HELD_BACK_AFTER
            w._observe()
        [line] = [r.getMessage() for r in caplog.records if "held back" in r.getMessage()]
        assert f"task id-{PART[0]}-0-0 is held (its key leased elsewhere" in line, line
    finally:
        stop(w)
