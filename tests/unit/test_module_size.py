"""No module of `taskq` grows past 800 lines unless it says why: a longer one is a hub to split by what it
does (issue 22)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.conftest import REPO

MAX_LINES = 800
#: A docstring sentence that lets a module be longer.
REASON = re.compile(r"(?:^|[.!?:;]\s)Longer than 800 lines because \S")


def too_long(path: Path) -> str | None:
    """Why `path` breaks the rule (its length), or None if it is short enough or says why it is not."""
    text = path.read_text()
    lines = len(text.splitlines())
    if lines <= MAX_LINES:
        return None
    doc = " ".join((ast.get_docstring(ast.parse(text)) or "").split())
    if REASON.search(doc):
        return None
    return f"{path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path}: {lines} lines"


def test_no_module_is_over_800_lines_without_a_reason() -> None:
    found = [
        why
        for path in sorted((REPO / "taskq").rglob("*.py"))
        if (why := too_long(path))
    ]
    assert not found, (
        f"over {MAX_LINES} lines: {found}; split by what it does, or start a sentence of the module's "
        "docstring with 'Longer than 800 lines because'"
    )


def test_the_allowed_modules_are_still_long() -> None:
    # A reason outlives its module's split only by mistake: remove it once the module is short.
    reasoned = [
        path
        for path in sorted((REPO / "taskq").rglob("*.py"))
        if REASON.search(" ".join((ast.get_docstring(ast.parse(path.read_text())) or "").split()))
    ]
    assert REPO / "taskq" / "consumer" / "worker.py" in reasoned
    for path in reasoned:
        assert len(path.read_text().splitlines()) > MAX_LINES, f"{path} is short now: remove its reason"


def test_a_long_module_passes_only_with_its_reason(tmp_path: Path) -> None:
    body = "x = 1\n" * MAX_LINES
    bare = tmp_path / "bare.py"
    bare.write_text(f'"""A module."""\n{body}')
    assert too_long(bare) == f"{bare}: {MAX_LINES + 1} lines"
    mentioned = tmp_path / "mentioned.py"
    mentioned.write_text(f'"""A module that is Longer than 800 lines because of its loop."""\n{body}')
    assert too_long(mentioned) is not None  # the phrase must start a sentence
    reasoned = tmp_path / "reasoned.py"
    reasoned.write_text(
        f'"""A module.\n\nLonger than 800 lines because its one loop reads best in one place."""\n{body}'
    )
    assert too_long(reasoned) is None
    short = tmp_path / "short.py"
    short.write_text('"""A module."""\nx = 1\n')
    assert too_long(short) is None
