"""Helpers for tests that run `taskq` workers as real processes."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from taskq._core.envelope import Topics
from taskq._core.kafka import Admin, Record, Source
from taskq._core.settings import Settings

T = TypeVar("T")


def uncommitted(settings: Settings) -> dict[tuple[str, int], int] | None:
    """Records of the priority topics past the worker group's committed offsets, per partition.

    Not `committed >= end offset`: retries come back through the forwarder's transactions, whose commit
    markers take an offset at the end of a partition that no consumer receives or commits past. None when
    the broker does not answer.
    """
    try:
        admin = Admin(settings)
        topics = Topics(settings.namespace).priority_topics
        end = admin.end_offsets(topics)
        committed = admin.committed(settings.worker_group, topics)
    except Exception:
        return None
    behind = {tp: max(0, committed.get(tp, -1)) for tp, hw in end.items() if committed.get(tp, -1) < hw}
    if not behind:
        return {}
    source = Source(settings, group=f"{settings.namespace}.checker")  # read_committed, like the workers
    source.assign([(t, p, o) for (t, p), o in behind.items()])
    left: Counter[tuple[str, int]] = Counter()
    try:
        idle = 0
        while idle < 3:
            records = source.poll(1000, 0.3)
            idle = 0 if records else idle + 1
            left.update(r.tp for r in records)
    finally:
        source.close()
    return dict(left)


def all_committed(settings: Settings) -> bool:
    """Whether the worker group has committed past every record of the namespace's priority topics."""
    return uncommitted(settings) == {}


def process_gone(pid: int) -> bool:
    """Whether no process has this pid (a child must have been reaped to be gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_until(check: Callable[[], T], *, timeout: float, what: str, every: float = 0.2) -> T:
    """Poll `check` until it returns something truthy; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {value!r})")
        time.sleep(every)


class WorkerProcess:
    """`taskq worker` in a subprocess, its output in a log file."""

    def __init__(
        self,
        env: dict[str, str],
        log: Path,
        *args: str,
        command: tuple[str, ...] | None = None,
        taskq: tuple[str, ...] = (sys.executable, "-m", "taskq.cli"),
        cwd: Path | None = None,
    ) -> None:
        self.log = log
        self._out = log.open("wb")
        argv = command if command is not None else ("worker", "tests.apps.app:handlers", *args)
        self.proc = subprocess.Popen(
            [*taskq, *argv],
            cwd=cwd,
            env={**env, "PYTHONFAULTHANDLER": "1"},  # a hung process can be made to show where (`wait`)
            stdout=self._out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    @classmethod
    def command(cls, env: dict[str, str], log: Path, *argv: str) -> WorkerProcess:
        """Any `taskq` command as a process (e.g. the forwarder)."""
        return cls(env, log, command=argv)

    def kill(self) -> None:
        """kill -9."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def terminate(self) -> None:
        """SIGTERM: graceful shutdown."""
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        """Wait for the exit code. A process still running after `timeout` is made to print every thread's
        stack (SIGABRT, with faulthandler on) and the test fails with the end of its log: where it hung."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            raise AssertionError(
                f"{' '.join(self.proc.args[2:4])} did not exit within {timeout}s; its log ends:\n"
                + self.output()[-12000:]
            ) from None

    def output(self) -> str:
        """What the worker logged."""
        return self.log.read_text(errors="replace")

    def close(self) -> None:
        """Make sure the process is gone."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._out.close()


def port_free(port: int) -> bool:
    """Whether nothing listens on a loopback port and it can be bound (for stacks of a test's own)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return True
    return False


def xdist_worker() -> int:
    """This pytest-xdist worker's number (gw2 -> 2); 0 when the suite runs in one process."""
    return int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))


#: Ports for stacks that a test starts itself: each xdist worker has a block of its own from 20000 (12 blocks,
#: below the kernel's ephemeral range, 32768 up, where connections take their local ports), so the private
#: stacks of tests running side by side never pick the same port.
PRIVATE_PORTS, PORT_BLOCK, PORT_BLOCKS = 20000, 1000, 12


def private_ports(count: int) -> int:
    """The first of `count` (at most 20) consecutive free loopback ports in this xdist worker's block.

    The block's runs of 20 are tried in random order, so that another suite running on the machine at the
    same time (its worker of the same number has the same block) is unlikely to try the same ones first.
    """
    assert count <= 20, count
    block = PRIVATE_PORTS + PORT_BLOCK * (xdist_worker() % PORT_BLOCKS)
    bases = random.sample(range(block, block + PORT_BLOCK, 20), PORT_BLOCK // 20)
    base = next((b for b in bases if all(port_free(b + i) for i in range(count))), None)
    if base is None:
        raise AssertionError(f"no {count} consecutive free ports in {block}-{block + PORT_BLOCK - 1}")
    return base


def tier_records(settings: Settings, topics: Sequence[str] = ()) -> list[Record]:
    """Every committed record on the namespace's priority topics (or `topics`), read from the start until
    idle."""
    topics = list(topics) or Topics(settings.namespace).priority_topics
    end = Admin(settings).end_offsets(topics)
    source = Source(settings, group=f"{settings.namespace}.reader")  # read_committed, like every Source
    source.assign([(t, p, 0) for (t, p) in end])
    out: list[Record] = []
    try:
        idle = 0
        while idle < 3:
            records = source.poll(1000, 0.5)
            idle = 0 if records else idle + 1
            out += records
    finally:
        source.close()
    return out


@contextmanager
def console_process(env: dict[str, str], log: Path, *args: str, probe: str) -> Iterator[str]:
    """`taskq console ARGS` on a free loopback port, once `probe` (a path) answers: its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = WorkerProcess.command(env, log, "console", *args, "--port", str(port))
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        assert proc.proc.poll() is None, proc.output()
        try:
            urllib.request.urlopen(url + probe, timeout=10).close()
            return True
        except OSError:  # not listening yet, or an HTTP error (the stack not ready)
            return False

    try:
        wait_until(answers, timeout=60, what="the console to answer")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        proc.close()


def share_group_reads(bootstrap: str, *, records: int, release_first: bool = False) -> list[int]:
    """Write `records` records to a new topic and read them in a new share group (KIP-932), accepting
    each: the delivery count of each read, in the order read. With `release_first` the first read of each
    record is released instead, so the broker delivers it again."""
    from confluent_kafka import AcknowledgeType, Producer, ShareConsumer
    from confluent_kafka.admin import (
        AdminClient,
        AlterConfigOpType,
        ConfigEntry,
        ConfigResource,
        NewTopic,
    )

    topic = group = f"share-probe-{random.getrandbits(40):010x}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(30)
    # A share group starts at the end of its topics unless told otherwise: the records are written first.
    earliest = ConfigEntry("share.auto.offset.reset", "earliest", incremental_operation=AlterConfigOpType.SET)
    config = ConfigResource(ConfigResource.Type.GROUP, group, incremental_configs=[earliest])
    admin.incremental_alter_configs([config])[config].result(30)
    producer = Producer({"bootstrap.servers": bootstrap})
    for i in range(records):
        producer.produce(topic, str(i).encode())
    assert producer.flush(30) == 0
    consumer = ShareConsumer(
        {"bootstrap.servers": bootstrap, "group.id": group, "share.acknowledgement.mode": "explicit"}
    )
    counts: list[int] = []
    accepted = 0
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + 60
        while accepted < records and time.monotonic() < deadline:
            for message in consumer.poll(1.0):
                assert message.error() is None, message.error()
                count = message.delivery_count()
                counts.append(count)
                if release_first and count == 1:
                    consumer.acknowledge(message, AcknowledgeType.RELEASE)
                else:
                    consumer.acknowledge(message, AcknowledgeType.ACCEPT)
                    accepted += 1
            consumer.commit_sync(30)
    finally:
        consumer.close()
        admin.delete_topics([topic])
    return counts
