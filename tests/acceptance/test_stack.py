"""compose/stack refuses a broken set-up with a message that names the problem (no services are started)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from tests.acceptance.helpers import share_group_reads
from tests.conftest import REPO

STACK = REPO / "compose" / "stack"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stack(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    ports = {
        name: str(_free_port())
        for name in (
            "TASKQ_STACK_KAFKA_PORT",
            "TASKQ_STACK_KAFKA_CONTROLLER_PORT",
            "TASKQ_STACK_KAFKA_SASL_PORT",
            "TASKQ_STACK_REGISTRY_PORT",
            "TASKQ_STACK_REGISTRY_MANAGEMENT_PORT",
            "TASKQ_STACK_POSTGRES_PORT",
        )
    }
    return subprocess.run(
        [str(STACK), *args],
        env={**os.environ, "TASKQ_STACK_DIR": str(tmp_path / "state"), **ports, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_port_in_use_is_named(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _stack(tmp_path, "up", TASKQ_STACK_POSTGRES_PORT=str(port))
    assert done.returncode != 0
    assert f"port {port}" in done.stderr and "postgres" in done.stderr, done.stderr
    assert done.stdout == ""  # no export lines for a stack that did not start


def test_a_missing_tool_is_named(tmp_path: Path) -> None:
    # An empty jar cache, and a PATH with python but no Maven: fetching Kafka's jars cannot work.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(os.path.realpath(sys.executable))
    done = _stack(tmp_path, "start", "kafka", PATH=str(bin_dir), XDG_CACHE_HOME=str(tmp_path / "cache"))
    assert done.returncode != 0
    assert "`mvn` not found" in done.stderr, done.stderr


def test_status_of_a_stack_that_never_ran(tmp_path: Path) -> None:
    done = _stack(tmp_path, "status")
    assert done.returncode == 3
    assert all(
        f"{name}" in done.stdout and "stopped" in done.stdout for name in ("postgres", "kafka", "registry")
    )


def test_a_bad_setting_is_named(tmp_path: Path) -> None:
    done = _stack(tmp_path, "env", TASKQ_STACK_TIMEOUT="soon")
    assert done.returncode == 1
    assert "TASKQ_STACK_TIMEOUT='soon'" in done.stderr, done.stderr
    assert done.stdout == ""


def test_kafka_storage_formats_with_a_cluster_id_that_starts_with_a_dash(tmp_path: Path) -> None:
    # A base64url cluster id starts with "-" one time in 64. Kafka's StorageTool took such an id for an option
    # ("argument --cluster-id/-t: expected one argument"), and `up` failed on a fresh state directory.
    spec = importlib.util.spec_from_file_location("_stack_format_under_test", REPO / "compose" / "_stack.py")
    assert spec is not None and spec.loader is not None
    stack = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = stack  # dataclasses look the module up while building classes
    try:
        spec.loader.exec_module(stack)
        cfg = stack.StackConfig.from_env({**os.environ, "TASKQ_STACK_DIR": str(tmp_path / "state")})
        kafka = stack.Stack(cfg, 1).kafkas[0]
        kafka.shared("cluster.id").parent.mkdir(parents=True)
        kafka.shared("cluster.id").write_text("-mhQvkcHTcyJgyEyZ_YP8A\n")
        kafka.prepare()  # the real StorageTool, from the jars the suite's stack runs on
        meta = (kafka.data / "meta.properties").read_text()
    finally:
        del sys.modules[spec.name]
    assert "cluster.id=-mhQvkcHTcyJgyEyZ_YP8A" in meta.splitlines()


def test_a_storage_an_older_kafka_formatted_is_upgraded_to_share_groups_at_start(tmp_path: Path) -> None:
    # A stack whose storage Kafka 4.1 formatted has no share.version: the broker refused share groups
    # ("ShareGroupHeartbeat ... API version not supported") until its features were upgraded.
    env = {**os.environ, "TASKQ_STACK_DIR": str(tmp_path / "state")}
    for name in ("KAFKA_PORT", "KAFKA_CONTROLLER_PORT", "KAFKA_SASL_PORT", "REGISTRY_PORT",
                 "REGISTRY_MANAGEMENT_PORT", "POSTGRES_PORT"):
        env[f"TASKQ_STACK_{name}"] = str(_free_port())
    spec = importlib.util.spec_from_file_location("_stack_features", REPO / "compose" / "_stack.py")
    assert spec is not None and spec.loader is not None
    stack = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = stack
    try:
        spec.loader.exec_module(stack)
        kafka = stack.Stack(stack.StackConfig.from_env(env), 1).kafkas[0]
        kafka.prepare()  # formats the storage as this Kafka does, then again as 4.1 did
        cluster_id = kafka.shared("cluster.id").read_text().strip()
        shutil.rmtree(kafka.data)
        kafka.features.unlink()
        old = kafka.tool(
            "kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}", "-c", str(kafka.props),
            "--release-version", "4.1-IV1",
        )
        assert old.returncode == 0, old.stderr
    finally:
        del sys.modules[spec.name]
    run = lambda *args: subprocess.run(  # noqa: E731
        [str(STACK), *args], env=env, capture_output=True, text=True, timeout=180
    )
    started = run("start", "kafka")
    try:
        assert started.returncode == 0, started.stderr
        assert "upgrading the cluster's features" in started.stderr
        bootstrap = f"127.0.0.1:{env['TASKQ_STACK_KAFKA_PORT']}"
        assert share_group_reads(bootstrap, records=3) == [1, 1, 1]
        again = run("start", "kafka")  # once: the next start finds the features recorded
        assert again.returncode == 0 and "upgrading" not in again.stderr, again.stderr
    finally:
        run("stop", "kafka")
