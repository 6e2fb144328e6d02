"""The tutorial (docs/tutorial.md), run as written against the stack: every `run` and `file` block in order,
in the test's own namespace, with checks between the steps of what the page says happened."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from taskq._core.settings import Settings
from tests.acceptance.helpers import wait_until
from tests.docblocks import PageRun


def _payments(settings: Settings) -> list[tuple[str, int]]:
    with psycopg.connect(settings.database_url, options=f"-c search_path={settings.database_schema}") as conn:
        return [(r[0], r[1]) for r in conn.execute("SELECT payment_id, cents FROM payments ORDER BY 1")]


def test_the_tutorial_runs_as_written(
    settings: Settings,
    env_of: Callable[..., dict[str, str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ns = settings.namespace
    # The page's Python connects with the bare TASKQ_DATABASE_URL, as a reader's would: libpq's PGOPTIONS
    # points it at the test's schema, where the worker's ctx.db (search_path = TASKQ_DATABASE_SCHEMA) looks.
    env = env_of(PGOPTIONS=f"-c search_path={settings.database_schema}")
    page = PageRun(
        "tutorial.md",
        tmp_path,
        env,
        rename=lambda text: re.sub(r"\bshop\b", ns, text),  # the task type lives in the test's namespace
        setenv=monkeypatch.setenv,
    )
    try:
        page.run_until("enqueue-twice")
        wait_until(lambda: _payments(settings), timeout=60, what="the first payment")
        page.run_until("one-row")
        assert "[('p-1', 1200)]" in capsys.readouterr().out

        page.run_until("flaky")
        wait_until(lambda: len(_payments(settings)) == 2, timeout=60, what="the retried payment")
        page.run_until("two-rows")
        assert "[('flaky-2', 500), ('p-1', 1200)]" in capsys.readouterr().out
        assert "the payment provider timed out" in page.background_log()

        page.run_until("too-large")
        wait_until(lambda: "charge:p-3" in page.run_shell("taskq dlq list"), timeout=60, what="a DLQ record")
        page.run_until("dlq-list")
        listed = page.outputs["dlq-list"]
        assert "charge:p-3" in listed and "rejected by handler" in listed and "1 DLQ record(s)" in listed

        page.run_until("replay")
        wait_until(lambda: len(_payments(settings)) == 3, timeout=60, what="the replayed payment")
        page.run_until("three-rows")
        assert "[('flaky-2', 500), ('p-1', 1200), ('p-3', 25000)]" in capsys.readouterr().out
        page.run_rest()
    finally:
        page.stop_background()
    assert _payments(settings) == [("flaky-2", 500), ("p-1", 1200), ("p-3", 25000)]
