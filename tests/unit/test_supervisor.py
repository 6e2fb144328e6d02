"""The supervisor's restart policy (`taskq worker --processes N`), and what it sends to worker processes."""

from __future__ import annotations

import functools
import os
import pickle
from pathlib import Path

import pytest

from taskq import cli
from taskq._core.settings import Settings
from taskq.consumer.supervisor import _MP, REFUSED, RestartBackoff, _worker_process
from taskq.consumer.worker import WorkerConfig


def test_restarts_wait_one_second_doubling_up_to_thirty() -> None:
    backoff = RestartBackoff(max_deaths=100)
    delays = [backoff.died(now=t * 100.0, ran=1.0) for t in range(7)]  # deaths far apart, short runs
    assert delays == [1, 2, 4, 8, 16, 30, 30]


def test_a_process_that_ran_healthy_for_a_minute_starts_over_at_one_second() -> None:
    backoff = RestartBackoff()
    assert [backoff.died(now=0.0, ran=1.0), backoff.died(now=10.0, ran=1.0)] == [1, 2]
    assert backoff.died(now=100.0, ran=60.0) == 1
    assert backoff.died(now=102.0, ran=1.0) == 2


def test_the_fifth_death_within_sixty_seconds_gives_up() -> None:
    backoff = RestartBackoff()
    assert [backoff.died(now=t, ran=0.5) for t in (0.0, 2.0, 5.0, 10.0)] == [1, 2, 4, 8]
    assert backoff.died(now=59.0, ran=0.5) is None


def test_deaths_older_than_the_window_do_not_count() -> None:
    backoff = RestartBackoff()
    for t in (0.0, 2.0, 5.0, 10.0):
        backoff.died(now=t, ran=0.5)
    assert backoff.died(now=61.0, ran=0.5) == 16  # the death at 0 s has left the window


def test_settings_reach_a_worker_process_unchanged() -> None:
    s = Settings(namespace="n1", kafka={"sasl.mechanism": "PLAIN"}, worker_group="g")
    copy = pickle.loads(pickle.dumps(s))
    assert copy == s and dict(copy.kafka) == {"sasl.mechanism": "PLAIN"}


def test_processes_below_one_is_one_line_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["worker", "tests.apps.app:handlers", "--processes", "0"]) == 2
    assert capsys.readouterr().err.strip() == "taskq: error: --processes must be >= 1, got 0"


def _finalizer_writes(path: str) -> None:
    """In the worker process: a finalizer the interpreter's exit would run, writing `path`."""
    import multiprocessing.util

    multiprocessing.util.Finalize(None, Path(path).write_text, args=("finalized",), exitpriority=0)


def test_a_refused_worker_process_ends_at_once_without_the_interpreters_finalization(tmp_path: Path) -> None:
    # A supervisor's worker refused by Kafka said why in one line, then died of SIGSEGV on its way out in 2
    # of 86 runs: Kafka client objects left to finalization (their threads calling back into Python). So
    # the supervisor restarted it instead of giving up. It ends as the taskq command does: at once.
    marker = tmp_path / "finalized"
    refusals = _MP.SimpleQueue()
    process = _MP.Process(
        target=_worker_process,
        args=(
            0,
            "no_such_module_here:handlers",
            Settings(namespace="unit"),
            WorkerConfig(),
            os.getpid(),
            functools.partial(_finalizer_writes, str(marker)),
            refusals,
        ),
    )
    process.start()
    process.join(60)
    assert process.exitcode in (REFUSED, 2), process.exitcode
    assert not marker.exists(), "the worker process ran the interpreter's finalization"
