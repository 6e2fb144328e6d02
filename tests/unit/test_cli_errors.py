"""The CLI turns the project's own errors into one line and lets any other exception keep its traceback."""

from __future__ import annotations

import argparse

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
