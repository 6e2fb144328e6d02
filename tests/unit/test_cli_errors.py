"""The CLI turns the project's own errors into one line and lets any other exception keep its traceback."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from taskq import cli


def test_a_bad_argument_is_one_line_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["worker", "tests.apps.app:handlers", "--weights", "8,4,two,1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "taskq: error: --weights must be integers, got '8,4,two,1'"


def test_a_bad_setting_is_one_line_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--namespace", "no spaces allowed", "stats"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "namespace 'no spaces allowed'" in err


def test_a_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(args: argparse.Namespace) -> int:
        raise ValueError("a bug, not a user's mistake")  # not a project error: no one-liner

    parser = cli.build_parser()
    real_parse = parser.parse_args
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    monkeypatch.setattr(parser, "parse_args", lambda argv: argparse.Namespace(**{**vars(real_parse(argv)),
                                                                                   "fn": broken}))  # fmt: skip
    with pytest.raises(ValueError, match="a bug"):
        cli.main(["stats"])


def test_an_unknown_kafka_setting_is_one_line_naming_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TASKQ_KAFKA_NO_SUCH_PROPERTY", "1")
    assert cli.main(["enqueue", "demo.SendEmail", "--json", "{}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'No such configuration property: "no.such.property"' in err


@pytest.mark.parametrize(
    ("source", "named"),
    [("import no_such_module_anywhere\n", "No module named"), ("def broken(:\n", "invalid syntax")],
)
def test_a_handlers_module_that_cannot_be_imported_is_one_line(
    source: str, named: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "brokenapp.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["worker", "brokenapp:handlers"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot import brokenapp" in err and named in err
