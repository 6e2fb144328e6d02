"""compose/_stack.py reads its environment in `main` (StackConfig.from_env), never at import."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import REPO

SOURCE = REPO / "compose" / "_stack.py"

BOGUS = {
    "TASKQ_STACK_DIR": "/nonexistent/bogus-state",
    "TASKQ_STACK_TIMEOUT": "not-a-number",
    "TASKQ_STACK_KAFKA_PORT": "not-a-port",
    "TASKQ_STACK_KAFKA_CONTROLLER_PORT": "not-a-port",
    "TASKQ_STACK_REGISTRY_PORT": "not-a-port",
    "TASKQ_STACK_REGISTRY_MANAGEMENT_PORT": "not-a-port",
    "TASKQ_STACK_POSTGRES_PORT": "not-a-port",
}

PORTS = {
    "TASKQ_STACK_KAFKA_PORT": "29092",
    "TASKQ_STACK_KAFKA_CONTROLLER_PORT": "29093",
    "TASKQ_STACK_REGISTRY_PORT": "28081",
    "TASKQ_STACK_REGISTRY_MANAGEMENT_PORT": "28082",
    "TASKQ_STACK_POSTGRES_PORT": "25432",
}


class _NoEnviron(Mapping[str, str]):
    """Stands in for os.environ: any read fails the test."""

    def __getitem__(self, key: str) -> str:
        raise AssertionError(f"os.environ[{key!r}] read at import")

    def __iter__(self) -> Iterator[str]:
        raise AssertionError("os.environ iterated at import")

    def __len__(self) -> int:
        raise AssertionError("len(os.environ) at import")


def _load(monkeypatch: pytest.MonkeyPatch, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, SOURCE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look the module up while building classes
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def stack(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return _load(monkeypatch, "_stack_under_test")


def test_importing_with_bogus_settings_does_not_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in BOGUS.items():
        monkeypatch.setenv(name, value)
    module = _load(monkeypatch, "_stack_bogus")
    for old_global in ("STATE", "CACHE", "LOGS", "RUN", "TIMEOUT"):
        assert not hasattr(module, old_global)
    with pytest.raises(module.StackError, match="TASKQ_STACK_TIMEOUT='not-a-number'"):
        module.StackConfig.from_env(os.environ)


def test_importing_reads_no_environment(monkeypatch: pytest.MonkeyPatch, stack: ModuleType) -> None:
    # `stack` has loaded the module once, so its standard-library imports are cached; load it again with
    # an os.environ that fails on any read.
    with monkeypatch.context() as m:
        m.setattr(os, "environ", _NoEnviron())
        module = _load(m, "_stack_no_environ")
    assert callable(module.main)


def test_config_comes_from_the_mapping_given(tmp_path: Path, stack: ModuleType) -> None:
    environ = {
        **PORTS,
        "TASKQ_STACK_DIR": str(tmp_path / "state"),
        "TASKQ_STACK_TIMEOUT": "7.5",
        "TASKQ_STACK_JAVA": "/opt/jdk17/bin/java",
        "TASKQ_STACK_JAVA21": "/opt/jdk21/bin/java",
        "TASKQ_STACK_M2": str(tmp_path / "m2"),
        "XDG_CACHE_HOME": str(tmp_path / "xdg"),
        "JAVA_HOME": "/opt/jdk",
        "HOME": str(tmp_path / "home"),
        "PATH": "/nowhere",
    }
    cfg = stack.StackConfig.from_env(environ)
    assert cfg.repo == REPO
    assert cfg.state == (tmp_path / "state").resolve()
    assert (cfg.logs, cfg.run) == (cfg.state / "logs", cfg.state / "run")
    assert cfg.cache == tmp_path / "xdg" / "kafka-taskq"
    assert cfg.m2 == tmp_path / "m2"
    assert cfg.timeout == 7.5
    assert (cfg.kafka_port, cfg.kafka_controller_port) == (29092, 29093)
    assert (cfg.registry_port, cfg.registry_management_port, cfg.postgres_port) == (28081, 28082, 25432)
    assert (cfg.java, cfg.java21, cfg.java_home) == ("/opt/jdk17/bin/java", "/opt/jdk21/bin/java", "/opt/jdk")
    assert cfg.path == "/nowhere"
    assert dict(cfg.environ) == environ
    with pytest.raises(AttributeError):
        cfg.timeout = 1.0  # frozen

    # The services take their ports and paths from it.
    s = stack.Stack(cfg)
    [kafka] = s.kafkas
    assert [s.postgres.port, kafka.port, s.registry.port] == [25432, 29092, 28081]
    assert kafka.ports() == [29092, 29093] and s.registry.ports() == [28081, 28082]
    assert s.postgres.record_path == cfg.state / "run" / "postgres.json"
    assert kafka.libs.is_relative_to(tmp_path / "xdg" / "kafka-taskq")
    assert s.registry.home.parent == tmp_path / "xdg" / "kafka-taskq"


def test_defaults(tmp_path: Path, stack: ModuleType) -> None:
    cfg = stack.StackConfig.from_env({"HOME": str(tmp_path)}, repo=tmp_path / "repo")
    assert cfg.state == (tmp_path / "repo" / ".stack").resolve()
    assert cfg.compose == tmp_path / "repo" / "compose"
    assert cfg.cache == tmp_path / ".cache" / "kafka-taskq"
    assert cfg.m2 == tmp_path / ".m2" / "repository"
    assert cfg.timeout == 180.0
    assert (cfg.postgres_port, cfg.kafka_port, cfg.kafka_controller_port) == (15432, 19092, 19093)
    assert (cfg.registry_port, cfg.registry_management_port) == (18081, 18082)
    assert (cfg.java, cfg.java21, cfg.java_home) == (None, None, None)


@pytest.mark.parametrize("name", ["TASKQ_STACK_POSTGRES_PORT", "TASKQ_STACK_REGISTRY_MANAGEMENT_PORT"])
def test_a_bad_port_is_named(stack: ModuleType, name: str) -> None:
    with pytest.raises(stack.StackError, match=f"{name}='x' is not a port number"):
        stack.StackConfig.from_env({"HOME": "/", name: "x"})


def test_main_reads_the_environ_it_is_given(
    tmp_path: Path, stack: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    environ = {**os.environ, **PORTS, "TASKQ_STACK_DIR": str(tmp_path / "state")}
    assert stack.main(["env"], environ) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "export TASKQ_BOOTSTRAP_SERVERS=127.0.0.1:29092",
        "export TASKQ_SCHEMA_REGISTRY_URL=http://127.0.0.1:28081/apis/ccompat/v7",
        "export TASKQ_DATABASE_URL=postgresql://postgres@127.0.0.1:25432/taskq",
    ]


def _props(kafka: object) -> dict[str, str]:
    kafka.write_props()  # type: ignore[attr-defined]
    lines = kafka.props.read_text().splitlines()  # type: ignore[attr-defined]
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


def test_one_broker_keeps_its_names_and_one_copy_of_everything(tmp_path: Path, stack: ModuleType) -> None:
    cfg = stack.StackConfig.from_env({**PORTS, "HOME": str(tmp_path), "TASKQ_STACK_DIR": str(tmp_path)})
    [kafka] = stack.Stack(cfg).kafkas
    assert (kafka.name, kafka.base, kafka.log_path) == (
        "kafka",
        tmp_path / "kafka",
        tmp_path / "logs/kafka.out",
    )
    props = _props(kafka)
    assert props["node.id"] == "1" and props["controller.quorum.voters"] == "1@127.0.0.1:29093"
    assert props["default.replication.factor"] == props["offsets.topic.replication.factor"] == "1"
    assert props["min.insync.replicas"] == props["transaction.state.log.min.isr"] == "1"


def test_three_brokers_take_consecutive_ports_and_replicate_everything_three_times(
    tmp_path: Path, stack: ModuleType
) -> None:
    env = {"HOME": str(tmp_path), "TASKQ_STACK_DIR": str(tmp_path)}
    s = stack.Stack(stack.StackConfig.from_env(env), 3)
    # The default controller port (19093) is among the client ports: the controllers come after them.
    assert [(k.name, k.ports()) for k in s.kafkas] == [
        ("kafka-1", [19092, 19095]),
        ("kafka-2", [19093, 19096]),
        ("kafka-3", [19094, 19097]),
    ]
    assert s.names == ["postgres", "kafka-1", "kafka-2", "kafka-3", "registry"]
    assert s.closure(["kafka"]) == ["kafka-1", "kafka-2", "kafka-3"]
    assert s.closure(["registry"]) == ["postgres", "registry"]
    assert s.exports()[0] == "export TASKQ_BOOTSTRAP_SERVERS=127.0.0.1:19092,127.0.0.1:19093,127.0.0.1:19094"
    props = _props(s.kafkas[1])
    assert props["node.id"] == "2"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:19095,2@127.0.0.1:19096,3@127.0.0.1:19097"
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:19093,CONTROLLER://127.0.0.1:19096"
    assert props["log.dirs"] == str(tmp_path / "kafka-2" / "data")
    for name in ("default", "offsets.topic", "transaction.state.log", "share.coordinator.state.topic"):
        assert props[f"{name}.replication.factor"] == "3", name
    for name in (
        "min.insync.replicas",
        "transaction.state.log.min.isr",
        "share.coordinator.state.topic.min.isr",
    ):
        assert props[name] == "2", name

    # A controller port clear of the client ports is kept.
    cfg = stack.StackConfig.from_env({**env, **PORTS, "TASKQ_STACK_KAFKA_CONTROLLER_PORT": "39000"})
    assert [k.ports() for k in stack.Stack(cfg, 3).kafkas] == [[29092, 39000], [29093, 39001], [29094, 39002]]


def test_the_state_dir_remembers_its_cluster_size(
    tmp_path: Path, stack: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    environ = {**os.environ, **PORTS, "TASKQ_STACK_DIR": str(tmp_path)}
    cfg = stack.StackConfig.from_env(environ)
    assert stack.brokers_of(cfg, None) == 1
    (tmp_path / "kafka.brokers").write_text("3\n")
    assert stack.brokers_of(cfg, None) == 3
    assert stack.main(["env"], environ) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "export TASKQ_BOOTSTRAP_SERVERS=127.0.0.1:29092,127.0.0.1:29093,127.0.0.1:29094"
    )
    # Another size is refused once Kafka's storage is formatted for this one.
    assert stack.brokers_of(cfg, 1) == 1
    (tmp_path / "kafka-1" / "data").mkdir(parents=True)
    (tmp_path / "kafka-1" / "data" / "meta.properties").write_text("")
    with pytest.raises(stack.StackError, match="holds a 3-broker Kafka, not 1; run `compose/stack down`"):
        stack.brokers_of(cfg, 1)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["up", "--brokers", "0"], "--brokers takes a number of Kafka nodes from 1 to 5, got '0'"),
        (["up", "--brokers=many"], "--brokers takes a number of Kafka nodes from 1 to 5, got 'many'"),
        (["up", "--brokers"], "--brokers takes a number of Kafka nodes from 1 to 5, got ''"),
        (["status", "--brokers", "3"], "`status` takes no --brokers (only up, start and restart do)"),
        (["kill", "kafka-2"], "usage: compose/stack kill {postgres|kafka|registry}"),
    ],
)
def test_a_bad_cluster_command_is_one_line(
    tmp_path: Path, stack: ModuleType, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        stack.main(argv, {**os.environ, "TASKQ_STACK_DIR": str(tmp_path)})
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"stack: error: {message}\n"
