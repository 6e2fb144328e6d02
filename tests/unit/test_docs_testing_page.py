"""The how-to page on testing handlers (docs/how-to/testing.md), run as written: its handler module and its
tests are written out and run by pytest, over the in-memory fakes, without services."""

from __future__ import annotations

import os
from pathlib import Path

from tests.docblocks import PageRun


def test_the_testing_page_runs_as_written(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "TASKQ_"))}
    page = PageRun("how-to/testing.md", tmp_path, env)
    page.run_rest()
    assert "4 passed" in page.outputs["pytest"], page.outputs["pytest"]
