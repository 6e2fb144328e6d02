"""The CLI turns the project's own errors into one line and lets any other exception keep its traceback."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from taskq import cli
from taskq._core.errors import ConfigurationError, KafkaAuthenticationError
from taskq._core.service import run_in_thread
from taskq._core.settings import Settings
from taskq.consumer.forwarder import Forwarder
from taskq.consumer.worker import WorkerConfig
from taskq.testing import InMemoryBroker


def test_a_bad_argument_is_one_line_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["worker", "tests.apps.app:handlers", "--weights", "8,4,two,1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "taskq: error: --weights must be integers, got '8,4,two,1'"


def test_a_heartbeat_staleness_too_short_for_the_heartbeat_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["worker", "tests.apps.app:handlers", "--stale-after", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "taskq: error: stale_after must be at least twice heartbeat_interval (3.0 s), got 5.0"


def test_a_bad_setting_is_one_line_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--namespace", "no spaces allowed", "stats"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "namespace 'no spaces allowed'" in err


def test_an_unreachable_database_is_one_line_without_its_password(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # libpq explains a refused connection on a second, tab-indented line.
    monkeypatch.setenv("TASKQ_DATABASE_URL", "postgresql://u:pa55word@127.0.0.1:1/taskq")
    assert cli.main(["db", "migrate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Connection refused; Is the server running" in err, err
    assert "pa55word" not in err


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


class _RefusingBroker(InMemoryBroker):
    """Kafka refusing the credentials, as the clients' error callback reports it."""

    def __init__(self) -> None:
        super().__init__()
        self.attempts = 0
        self.stop: Callable[[], None] = lambda: None

    def sink(self, *, transactional_id: str | None = None, **overrides: Any) -> Any:
        self.attempts += 1
        if self.attempts > 1:
            self.stop()  # a forwarder that starts over would do so for ever: end it here
        raise KafkaAuthenticationError("Kafka refused the connection: SASL authentication error")


def test_the_forwarder_stops_on_refused_credentials_instead_of_restarting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = _RefusingBroker()
    forwarder = Forwarder(Settings(namespace="unit"), broker=broker)
    broker.stop = forwarder.stop
    with pytest.raises(KafkaAuthenticationError):
        forwarder.run()  # starting over cannot fix the settings
    assert broker.attempts == 1

    # In a worker it stops with one line, no traceback: the worker's own clients meet the same refusal.
    broker = _RefusingBroker()
    forwarder = Forwarder(Settings(namespace="unit"), broker=broker)
    broker.stop = forwarder.stop
    thread = run_in_thread(forwarder, "forwarder")
    thread.join(10)
    assert not thread.is_alive()
    stopped = [r for r in caplog.records if r.name == "taskq.forwarder" and "forwarder stopped" in r.message]
    assert len(stopped) == 1 and stopped[0].exc_info is None, caplog.text
    assert "Kafka refused the connection" in stopped[0].message


def _services_nowhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings pointing where nothing answers: an error given before any service is reached is the test's."""
    monkeypatch.setenv("TASKQ_BOOTSTRAP_SERVERS", "127.0.0.1:9")
    monkeypatch.setenv("TASKQ_SCHEMA_REGISTRY_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("TASKQ_DATABASE_URL", "postgresql://nobody@127.0.0.1:9/none")


@pytest.mark.parametrize("count", ["0", "-5"])
@pytest.mark.parametrize("bench", ["produce", "worker", "ceiling"])
def test_a_bench_of_no_tasks_is_one_line_before_any_service_is_reached(
    bench: str, count: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Refused before Kafka, the registry or Postgres is reached: the settings point where nothing answers.
    _services_nowhere(monkeypatch)
    assert cli.main(["bench", bench, "-n", count]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"taskq: error: count must be >= 1, got {count}"


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["bench", "latency", "--rate", "inf"], "taskq: error: rate must be a finite number > 0, got inf"),
        (
            ["bench", "latency", "--rate", "10", "--duration", "inf"],
            "taskq: error: duration must be a finite number > 0, got inf",
        ),
        (["chaos", "--rate", "inf"], "taskq: error: rate must be a finite number > 0, got inf"),
        (["chaos", "--duration", "inf"], "taskq: error: duration must be a finite number > 0, got inf"),
    ],
)
def test_an_infinite_rate_or_duration_is_one_line(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # An OverflowError traceback before: the schedule's task count was rate x duration.
    _services_nowhere(monkeypatch)
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip() == error


@pytest.mark.parametrize(
    "argv",
    [
        ["worker", "tests.apps.app:handlers", "--metrics-port", "99999"],
        ["worker", "tests.apps.app:handlers", "--metrics-port", "-1"],
        ["stats", "--metrics-port", "70000"],
        ["console", "--port", "65536"],
    ],
)
def test_a_port_out_of_range_is_refused_before_anything_starts(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # The worker's metrics server raised OverflowError from bind() with a traceback, after joining nothing.
    with pytest.raises(SystemExit) as exit:
        cli.main(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"must be a port from 0 to 65535, got {argv[-1]!r}") and "argument" in err


def test_a_worker_config_with_a_port_out_of_range_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="metrics_port must be a port from 0 to 65535, got 99999"):
        WorkerConfig(metrics_port=99999)


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        # The relay published batches of nothing, for ever.
        (["relay", "--batch", "0"], "taskq: error: batch must be >= 1, got 0"),
        (
            ["bench", "produce", "-n", "5", "--body-bytes", "-1"],
            "taskq: error: --body-bytes must be >= 0, got -1",
        ),
        # The replication was not given: the error names only what was.
        (["topics", "create", "--partitions", "0"], "taskq: error: partitions must be >= 1, got 0"),
        (
            ["topics", "create", "--replication", "0"],
            "taskq: error: replication must be >= 1, got 0",
        ),
    ],
)
def test_a_count_below_its_least_is_one_line_naming_it_before_any_service_is_reached(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _services_nowhere(monkeypatch)
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip() == error


def test_enqueue_with_a_payload_that_is_not_json_is_one_line_with_the_others_exit_code(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # It exited 1, where every other mistake in the input exits 2, and said it in a form of its own.
    assert cli.main(["enqueue", "demo.SendEmail", "--json", "{"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("taskq: error: --json is not valid JSON: ") and "\n" not in err


def test_a_handlers_attribute_the_module_lacks_is_named_as_missing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # It said "tests.apps.app:nosuch is NoneType, not a taskq.Handlers".
    assert cli.main(["worker", "tests.apps.app:nosuch"]) == 2
    err = capsys.readouterr().err.strip()
    expected = "tests.apps.app has no attribute 'nosuch' (expected MODULE:ATTR of a taskq.Handlers)"
    assert err == f"taskq: error: {expected}"


@pytest.mark.parametrize("value", ["-1", "1001", "nan", "soon"])
@pytest.mark.parametrize(
    "command", [["worker", "tests.apps.app:handlers"], ["bench", "latency", "--rate", "10"]]
)
def test_a_claim_linger_out_of_range_is_refused_in_one_line(
    command: list[str], value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        cli.main([*command, "--claim-linger-ms", value])
    assert exit.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"--claim-linger-ms: must be milliseconds from 0 to 1000, got {value!r}")


@pytest.mark.parametrize("linger", [-0.001, 1.5, float("nan")])
def test_a_worker_config_with_a_claim_linger_out_of_range_is_refused(linger: float) -> None:
    with pytest.raises(ConfigurationError, match="claim_linger must be from 0 to 1 second"):
        WorkerConfig(claim_linger=linger)


def test_the_cli_default_claim_linger_is_the_worker_config_default() -> None:
    # The parser is built without importing the worker, so the default is written twice.
    from taskq.cli.common import CLAIM_LINGER_MS

    assert CLAIM_LINGER_MS / 1000 == WorkerConfig.claim_linger


def test_the_worker_commands_buffer_defaults_are_the_worker_config_defaults() -> None:
    # Written twice, as the claim linger's is.
    args = cli.build_parser().parse_args(["worker", "tests.apps.app:handlers"])
    assert args.buffer == WorkerConfig.buffer_capacity
    assert args.buffer_mb * 1024 * 1024 == WorkerConfig.buffer_bytes
