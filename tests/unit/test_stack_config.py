"""compose/_stack.py reads its environment in `main` (StackConfig.from_env), never at import."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import ssl
import sys
import threading
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
    assert (cfg.kafka_port, cfg.kafka_controller_port, cfg.kafka_sasl_port) == (29092, 29093, 29102)
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
    assert kafka.ports() == [29092, 29093, 29102] and s.registry.ports() == [28081, 28082]
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
    assert cfg.kafka_sasl_port == 19102  # the Kafka port + 10
    assert (cfg.java, cfg.java21, cfg.java_home) == (None, None, None)


def test_the_sasl_port_follows_the_kafka_port_unless_set(stack: ModuleType) -> None:
    assert (
        stack.StackConfig.from_env({"HOME": "/", "TASKQ_STACK_KAFKA_PORT": "23092"}).kafka_sasl_port == 23102
    )
    cfg = stack.StackConfig.from_env({"HOME": "/", "TASKQ_STACK_KAFKA_SASL_PORT": "24000"})
    assert (cfg.kafka_port, cfg.kafka_sasl_port) == (19092, 24000)


@pytest.mark.parametrize(
    "name",
    ["TASKQ_STACK_POSTGRES_PORT", "TASKQ_STACK_REGISTRY_MANAGEMENT_PORT", "TASKQ_STACK_KAFKA_SASL_PORT"],
)
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
        ("kafka-1", [19092, 19095, 19102]),
        ("kafka-2", [19093, 19096, 19103]),
        ("kafka-3", [19094, 19097, 19104]),
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
    assert [k.ports() for k in stack.Stack(cfg, 3).kafkas] == [
        [29092, 39000, 29102],
        [29093, 39001, 29103],
        [29094, 39002, 29104],
    ]


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


def test_the_sasl_ssl_listener_is_configured_and_exported_once_it_runs(
    tmp_path: Path, stack: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    environ = {**os.environ, **PORTS, "TASKQ_STACK_DIR": str(tmp_path / "state")}
    [kafka] = stack.Stack(stack.StackConfig.from_env(environ)).kafkas
    assert kafka.tls == tmp_path / "state" / "kafka" / "tls"  # one broker: where it always was
    kafka.write_props()
    assert "SASL_SSL" not in kafka.props.read_text()  # without openssl: PLAINTEXT only

    kafka.sasl = True
    kafka.write_props()
    props = dict(
        line.split("=", 1) for line in kafka.props.read_text().splitlines() if "=" in line and line[0] != "#"
    )
    assert props["listeners"].split(",") == [
        "PLAINTEXT://127.0.0.1:29092",
        "CONTROLLER://127.0.0.1:29093",
        "SASL_SSL://127.0.0.1:29102",
    ]
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:29092,SASL_SSL://127.0.0.1:29102"
    assert props["inter.broker.listener.name"] == "PLAINTEXT"  # brokers and controller stay as they were
    assert props["listener.name.sasl_ssl.sasl.enabled.mechanisms"] == "SCRAM-SHA-512"
    assert props["listener.name.sasl_ssl.ssl.keystore.location"] == str(kafka.tls / "broker.pem")

    # `env` tells the listener only once a broker that has it runs and the SCRAM user exists.
    kafka.write_record()
    kafka.save_sasl_user("s3cret")
    assert stack.main(["env"], environ) == 0
    assert capsys.readouterr().out.splitlines()[3:] == [
        "export TASKQ_STACK_SASL_BOOTSTRAP=127.0.0.1:29102",
        f"export TASKQ_STACK_SASL_CA={kafka.tls / 'ca.pem'}",
        "export TASKQ_STACK_SASL_USERNAME=taskq",
        "export TASKQ_STACK_SASL_PASSWORD=s3cret",
    ]
    kafka.sasl = False
    kafka.write_record()  # a broker started without the listener
    assert stack.main(["env"], environ) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_the_broker_certificate_verifies_for_127_0_0_1_against_the_ca(
    tmp_path: Path, stack: ModuleType
) -> None:
    tls = tmp_path / "tls"
    stack.make_tls(shutil.which("openssl"), tls)
    made = (tls / "broker.pem").read_bytes()
    stack.make_tls(shutil.which("openssl"), tls)
    assert (tls / "broker.pem").read_bytes() == made  # made once, kept across starts
    assert sorted(p.name for p in tls.iterdir()) == ["broker.pem", "ca.pem"]  # no CA key left to sign with
    assert (tls / "broker.pem").stat().st_mode & 0o077 == 0  # it holds the broker's key

    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tls / "broker.pem")  # the key and the chain, in the one PEM file Kafka reads
    client = ssl.create_default_context(cafile=str(tls / "ca.pem"))
    a, b = socket.socketpair()
    with a, b:
        served: list[BaseException] = []

        def serve() -> None:
            try:
                with server.wrap_socket(a, server_side=True):
                    pass
            except (OSError, ssl.SSLError) as exc:
                served.append(exc)

        t = threading.Thread(target=serve)
        t.start()
        with client.wrap_socket(b, server_hostname="127.0.0.1") as tls_socket:
            assert tls_socket.version() is not None  # the handshake verified the chain and the address
        t.join(10)
    assert not served


def test_every_node_of_a_cluster_has_its_own_sasl_ssl_listener_and_all_are_exported(
    tmp_path: Path, stack: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    environ = {**os.environ, **PORTS, "TASKQ_STACK_DIR": str(tmp_path)}
    s = stack.Stack(stack.StackConfig.from_env(environ), 3)
    assert [k.sasl_port for k in s.kafkas] == [29102, 29103, 29104]  # the SASL port + k - 1
    for k in s.kafkas:
        k.sasl = True
        props = _props(k)
        c = k.controller_port
        assert props["listeners"] == (
            f"PLAINTEXT://127.0.0.1:{k.port},CONTROLLER://127.0.0.1:{c},SASL_SSL://127.0.0.1:{k.sasl_port}"
        )
        assert props["advertised.listeners"] == (
            f"PLAINTEXT://127.0.0.1:{k.port},SASL_SSL://127.0.0.1:{k.sasl_port}"
        )
        assert props["listener.security.protocol.map"] == (
            "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL_SSL:SASL_SSL"
        )
        # One CA and broker certificate and one SCRAM user, beside the nodes, for the whole cluster.
        keystore = props["listener.name.sasl_ssl.ssl.keystore.location"]
        assert keystore == str(tmp_path / "kafka-tls" / "broker.pem")
        assert (k.tls, k.credentials) == (tmp_path / "kafka-tls", tmp_path / "kafka-sasl-user.json")

    (tmp_path / "kafka.brokers").write_text("3\n")
    for k in s.kafkas:
        k.write_record()
    s.kafkas[0].save_sasl_user("s3cret")
    assert stack.main(["env"], environ) == 0
    assert capsys.readouterr().out.splitlines()[3:] == [
        "export TASKQ_STACK_SASL_BOOTSTRAP=127.0.0.1:29102,127.0.0.1:29103,127.0.0.1:29104",
        f"export TASKQ_STACK_SASL_CA={tmp_path / 'kafka-tls' / 'ca.pem'}",
        "export TASKQ_STACK_SASL_USERNAME=taskq",
        "export TASKQ_STACK_SASL_PASSWORD=s3cret",
    ]


def _formats(
    stack: ModuleType, kafkas: list[object], monkeypatch: pytest.MonkeyPatch
) -> dict[str, list[str]]:
    """Prepare `kafkas` together as `up` does, StorageTool stubbed: the arguments each node formats with."""
    formats: dict[str, list[str]] = {}

    def tool(self: object, main_class: str, *args: str) -> object:
        formats[self.name] = list(args)  # type: ignore[attr-defined]
        (self.data / "meta.properties").write_text("")  # type: ignore[attr-defined]
        return stack.subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(stack.Kafka, "tool", tool)
    monkeypatch.setattr(stack.Kafka, "ensure_libs", lambda self: None)
    monkeypatch.setattr(stack, "find_java", lambda *args, **kwargs: ("java", 17))
    monkeypatch.setattr(stack, "which", lambda *args, **kwargs: None)  # no openssl: no certificates to make
    threads = [threading.Thread(target=k.prepare) for k in kafkas]  # type: ignore[attr-defined]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return formats


def test_a_new_cluster_formats_every_node_with_one_cluster_id_and_one_scram_password(
    tmp_path: Path, stack: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = stack.StackConfig.from_env({**PORTS, "HOME": str(tmp_path), "TASKQ_STACK_DIR": str(tmp_path)})
    s = stack.Stack(cfg, 3)
    formats = _formats(stack, s.kafkas, monkeypatch)
    assert sorted(formats) == ["kafka-1", "kafka-2", "kafka-3"]
    username, password = s.kafkas[0].sasl_user()
    cluster_id = (tmp_path / "kafka-cluster.id").read_text().strip()
    for name, args in formats.items():
        assert args[:2] == ["format", f"--cluster-id={cluster_id}"], name
        assert args[-2:] == ["--add-scram", f"SCRAM-SHA-512=[name={username},password={password}]"], name
    assert (tmp_path / "kafka-sasl-user.json").stat().st_mode & 0o077 == 0


def test_a_node_joining_older_storage_leaves_the_scram_user_to_after_ready(
    tmp_path: Path, stack: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # kafka-1 and kafka-3 were formatted before the SASL_SSL listener existed; kafka-2's data was removed.
    cfg = stack.StackConfig.from_env({**PORTS, "HOME": str(tmp_path), "TASKQ_STACK_DIR": str(tmp_path)})
    s = stack.Stack(cfg, 3)
    for k in (s.kafkas[0], s.kafkas[2]):
        k.data.mkdir(parents=True)
        (k.data / "meta.properties").write_text("")
    formats = _formats(stack, s.kafkas, monkeypatch)
    assert list(formats) == ["kafka-2"]
    assert "--add-scram" not in formats["kafka-2"]  # the quorum's metadata decides; a password here would lie
    assert s.kafkas[1].sasl_user() is None  # so after_ready adds the user once the nodes answer


def test_a_new_cluster_id_never_starts_with_a_dash(stack: ModuleType) -> None:
    # As Kafka's own Uuid.randomUuid: command-line tools would read a leading "-" as an option. One base64url
    # id in 64 starts with it, so 2,000 draws without the rule all pass with odds of about 1 in 10^14.
    ids = [stack.new_cluster_id() for _ in range(2000)]
    assert not [i for i in ids if i.startswith("-")]
    assert all(len(i) == 22 for i in ids)


def test_the_registrys_first_write_is_tried_again_while_a_loaded_machine_keeps_it_from_answering(
    tmp_path: Path, stack: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cold registry on a loaded machine took longer than a request's timeout to store its first setting:
    # `up` failed with "HTTP 0". Not answered (or a server error) is tried again; a refusal is not.
    cfg = stack.StackConfig.from_env({**PORTS, "HOME": str(tmp_path), "TASKQ_STACK_DIR": str(tmp_path)})
    registry = stack.Stack(cfg).registry
    registry.proc = object()  # started by this `up`: its own port, not a recorded one
    answers = iter([(0, b""), (503, b"starting"), (200, b'{"compatibility":"BACKWARD"}')])
    asked: list[tuple[str, str]] = []

    def http(method: str, url: str, body: bytes | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
        asked.append((method, url))
        return next(answers)

    monkeypatch.setattr(stack, "http", http)
    monkeypatch.setattr(stack.time, "sleep", lambda seconds: None)
    registry.after_ready()
    assert asked == [("PUT", "http://127.0.0.1:28081/apis/ccompat/v7/config")] * 3

    answers = iter([(422, b'{"message":"invalid"}')])
    asked.clear()
    with pytest.raises(stack.StackError, match="HTTP 422"):
        registry.after_ready()
    assert len(asked) == 1


def test_up_starts_a_stopped_postgres_before_waiting_on_a_registry_that_needs_it(
    tmp_path: Path, stack: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # After `stop postgres`, the registry runs on but cannot answer: `up` waited for it (its whole timeout)
    # before it started Postgres, the one thing the registry was waiting for, and failed.
    cfg = stack.StackConfig.from_env(
        {**PORTS, "HOME": str(tmp_path), "TASKQ_STACK_DIR": str(tmp_path), "TASKQ_STACK_TIMEOUT": "2"}
    )
    s = stack.Stack(cfg)
    started: list[str] = []
    running = {"postgres": False, "kafka": True, "registry": True}

    def service(svc: object) -> None:
        name = svc.name  # type: ignore[attr-defined]
        monkeypatch.setattr(svc, "ours_alive", lambda: 4242 if running[name] else None)
        monkeypatch.setattr(svc, "exited", lambda: not running[name])
        monkeypatch.setattr(svc, "prepare", lambda: None)
        monkeypatch.setattr(svc, "after_ready", lambda: None)
        monkeypatch.setattr(svc, "write_record", lambda **extra: None)
        monkeypatch.setattr(svc, "ports", lambda: [])
        monkeypatch.setattr(svc, "stop", lambda: running.__setitem__(name, False))  # never a real pid

        def launch() -> None:
            started.append(name)
            running[name] = True

        monkeypatch.setattr(svc, "launch", launch)

    for svc in (s.postgres, *s.kafkas, s.registry):
        service(svc)
    monkeypatch.setattr(s.postgres, "answering", lambda: running["postgres"])
    monkeypatch.setattr(s.kafkas[0], "answering", lambda: True)
    # The registry answers only while its database does.
    monkeypatch.setattr(s.registry, "answering", lambda: running["postgres"])
    monkeypatch.setattr(stack.time, "sleep", lambda seconds: None)

    s.up(["registry"])
    assert started == ["postgres"]
