"""librdkafka's log flood while a broker is away collapses: the first line of a kind, then a summary at
most every 30 s."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

from taskq._core import kafka
from taskq._core.kafka import LIBRDKAFKA_LOG, RepeatFilter, Sink
from taskq._core.settings import Settings


class Lines(logging.Handler):
    """Keeps the formatted lines that reach it."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def lines() -> Iterator[Lines]:
    handler, level = Lines(), LIBRDKAFKA_LOG.level
    LIBRDKAFKA_LOG.addHandler(handler)
    LIBRDKAFKA_LOG.setLevel(logging.WARNING)  # as in a worker (the CLI's one-off commands quiet it)
    yield handler
    LIBRDKAFKA_LOG.removeHandler(handler)
    LIBRDKAFKA_LOG.setLevel(level)


def connect_failed(log: logging.Logger, client: str, after_ms: int) -> None:
    # As confluent-kafka logs librdkafka's lines: facility, client name, text.
    log.error("%s [%s] %s", "FAIL", client, f"127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: "
              f"Connection refused (after {after_ms}ms in state CONNECT)")  # fmt: skip


def test_repeats_of_a_kind_are_held_back_and_summed_up_at_most_every_window() -> None:
    now = [0.0]
    log = logging.getLogger("tests.repeats")
    log.propagate = False
    handler = Lines()
    log.addHandler(handler)
    log.addFilter(RepeatFilter(window=30.0, clock=lambda: now[0]))
    for i in range(100):  # ten seconds of a broker away, one line every 100 ms and from two clients
        now[0] = i * 0.1
        connect_failed(log, "rdkafka#consumer-1", i % 3)
        connect_failed(log, "rdkafka#producer-2", 0)
    log.warning("%s [%s] %s", "REQTMOUT", "rdkafka#consumer-1", "Timed out 1 in-flight request(s)")
    # The first connection failure of each client, and the other kind.
    assert [line[:27] for line in handler.lines] == [
        "FAIL [rdkafka#consumer-1] 1",
        "FAIL [rdkafka#producer-2] 1",
        "REQTMOUT [rdkafka#consumer-",
    ]
    now[0] = 30.0
    connect_failed(log, "rdkafka#consumer-1", 0)
    assert handler.lines[3].endswith("[repeated 99 times in the last 30 s]"), handler.lines[3]
    connect_failed(log, "rdkafka#consumer-1", 0)  # and held back again for the next 30 s
    assert len(handler.lines) == 4


def test_a_real_client_with_the_broker_away_logs_each_kind_once(
    lines: Lines, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A filter of this test's own: the process's one has counted other tests' clients, and a kind it shows
    # again after its window starts its count over.
    fresh = RepeatFilter()
    monkeypatch.setattr(kafka, "_REPEATS", fresh)  # what every client's configuration installs
    others = [f for f in LIBRDKAFKA_LOG.filters if not isinstance(f, RepeatFilter)]
    monkeypatch.setattr(LIBRDKAFKA_LOG, "filters", others)
    # librdkafka doubles its reconnect backoff up to reconnect.backoff.max.ms: keep it short, so it repeats.
    sink = Sink(Settings(bootstrap_servers="127.0.0.1:1", kafka={"reconnect.backoff.max.ms": "200"}))
    assert [f for f in LIBRDKAFKA_LOG.filters if isinstance(f, RepeatFilter)] == [fresh]

    def held() -> int:
        return sum(n for _, n in fresh._kinds.values())

    deadline = time.monotonic() + 30
    while held() < 10 and time.monotonic() < deadline:
        sink.poll(0.1)
    assert held() >= 10, "librdkafka did not repeat itself"
    failures = [line for line in lines.lines if "Connect to" in line]
    assert len(failures) == 1, lines.lines


def test_transient_retries_of_a_starting_broker_are_kept_out_unless_verbose(lines: Lines) -> None:
    kafka.base_config(Settings())  # installs the filters
    pid = (
        "Failed to acquire idempotence PID from broker 127.0.0.1:19092/1: "
        "Broker: Coordinator load in progress: retrying"
    )
    LIBRDKAFKA_LOG.warning("%s [%s] %s", "GETPID", "rdkafka#producer-1", pid)
    connect_failed(LIBRDKAFKA_LOG, "rdkafka#producer-1", 0)
    assert [line.split(" ")[0] for line in lines.lines] == ["FAIL"]
    LIBRDKAFKA_LOG.setLevel(logging.DEBUG)  # -v
    LIBRDKAFKA_LOG.warning("%s [%s] %s", "GETPID", "rdkafka#producer-2", pid)
    assert lines.lines[-1].startswith("GETPID [rdkafka#producer-2] Failed to acquire idempotence PID")
