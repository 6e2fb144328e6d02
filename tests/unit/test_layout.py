"""One import name: the public API of `taskq`, imported lazily, so each kind of process loads only its part."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

import taskq
import taskq.schemas
from tests.conftest import REPO


def loaded_after(code: str) -> set[str]:
    """Modules of taskq and its drivers that a fresh interpreter has loaded after running `code`."""
    probe = (
        f"{code}\nimport json, sys\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('taskq', 'psycopg', 'confluent_kafka', 'prometheus_client'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True, timeout=60
    )
    return set(json.loads(out.stdout.splitlines()[-1]))


@pytest.mark.parametrize("package", [taskq, taskq.schemas])
def test_every_public_name_resolves_from_its_module(package: object) -> None:
    exports = package._EXPORTS  # type: ignore[attr-defined]
    assert set(package.__all__) - {"__version__"} == set(exports)  # type: ignore[attr-defined]
    for name, module in exports.items():
        value = getattr(package, name)
        assert value is getattr(sys.modules[module], name)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        package.Nope  # type: ignore[attr-defined]  # noqa: B018


def test_the_version_is_a_string() -> None:
    assert isinstance(taskq.__version__, str) and taskq.__version__.count(".") == 2


def test_importing_taskq_loads_nothing_until_a_name_is_used() -> None:
    assert loaded_after("import taskq") == {"taskq", "taskq._core", "taskq._core.lazy"}


def test_a_producer_only_service_loads_no_worker_code() -> None:
    for code in ("import taskq.producer.producer", "import taskq; taskq.TaskProducer; taskq.TaskqError"):
        loaded = loaded_after(code)
        assert "taskq.producer.producer" in loaded
        assert not {m for m in loaded if m.startswith("taskq.consumer")}, (code, sorted(loaded))


def test_a_handler_module_loads_no_worker_loop_and_no_drivers() -> None:
    loaded = loaded_after("from taskq import Handlers, Reject, Retry, TaskContext")
    assert "taskq.consumer.handlers" in loaded
    for module in ("taskq.consumer.worker", "taskq.consumer.executor", "psycopg", "confluent_kafka"):
        assert module not in loaded, sorted(loaded)


def test_a_worker_without_periodic_tasks_loads_no_task_producer() -> None:
    # The producer is the periodic scheduler's, imported when a worker has periodic tasks: not on the way
    # to every worker's first task.
    loaded = loaded_after("import taskq.consumer.worker")
    assert "taskq.consumer.worker" in loaded
    assert "taskq.producer.producer" not in loaded, sorted(loaded)


def test_the_enqueue_command_loads_no_worker_code() -> None:
    loaded = loaded_after("import taskq.cli")
    assert not {m for m in loaded if m.startswith("taskq.consumer")}, sorted(loaded)


def test_importing_the_library_registers_no_metrics() -> None:
    # Metrics are created by a producer, a worker's hook or `taskq stats`, never by importing a module.
    code = (
        "import prometheus_client\n"
        "before = set(prometheus_client.REGISTRY._names_to_collectors)\n"
        "import taskq.producer.producer, taskq.consumer.worker, taskq.consumer.dlq, taskq.cli, taskq.testing\n"
        "after = set(prometheus_client.REGISTRY._names_to_collectors)\n"
        "assert after == before, sorted(after - before)\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def test_the_runtime_packages_hold_no_tools_and_import_none() -> None:
    runtime = [REPO / "taskq" / p for p in ("producer", "consumer", "schemas", "_core")]
    for package in runtime:
        for path in package.rglob("*.py"):
            assert path.stem not in ("bench", "chaos"), path
            text = path.read_text()
            assert "taskq.tools" not in text, f"{path} imports the tools package"


def test_the_fakes_are_importable_from_taskq_testing() -> None:
    import taskq.testing

    assert set(taskq.testing.__all__) == {
        "Clock", "InMemoryBroker", "InMemoryQueue", "InMemoryRegistry", "InMemoryStore", "RecordingHook"
    }  # fmt: skip
    for name in taskq.testing.__all__:
        value = getattr(taskq.testing, name)
        assert value.__module__.startswith("taskq.testing."), (name, value.__module__)


#: The only modules that import a driver: the adapters at the edge (and the producer's outbox staging, which
#: runs in the application's own transaction), and the benchmarks that measure the drivers themselves.
DRIVER_MODULES = {
    "confluent_kafka": {
        "taskq/_core/kafka.py",
        "taskq/_core/kafka_admin.py",
        "taskq/_core/kafka_clients.py",
        "taskq/_core/settling.py",
        "taskq/_core/share.py",
        "taskq/tools/bench/ceiling.py",
        "taskq/tools/bench/runners.py",
    },
    "psycopg": {
        "taskq/_core/db.py",
        "taskq/_core/store.py",
        "taskq/consumer/store.py",
        "taskq/producer/aio.py",
        "taskq/producer/outbox.py",
        "taskq/producer/producer.py",
        "taskq/tools/bench/ceiling.py",
    },
}


def test_only_the_adapters_import_the_drivers() -> None:
    importers: dict[str, set[str]] = {driver: set() for driver in DRIVER_MODULES}
    for path in sorted((REPO / "taskq").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                if module.split(".")[0] in importers:
                    importers[module.split(".")[0]].add(path.relative_to(REPO).as_posix())
    assert importers == DRIVER_MODULES


def test_the_records_and_the_broker_protocol_load_no_driver() -> None:
    loaded = loaded_after(
        "import taskq._core.broker, taskq.consumer.events, taskq.consumer.routing\n"
        "import taskq.producer.backpressure"
    )
    assert "taskq._core.broker" in loaded
    assert not {m for m in loaded if m.split(".")[0] in ("confluent_kafka", "psycopg")}, sorted(loaded)


def test_the_registry_client_is_the_standard_librarys_http() -> None:
    # confluent-kafka's registry client brought HTTP and OAuth libraries that took a few hundred ms to
    # import on every producer's and worker's start; the REST calls are made with urllib instead.
    probe = (
        "import json, sys, taskq.cli, taskq.consumer.worker\n"
        "from taskq.schemas.registry import Registry; Registry('http://127.0.0.1:1')\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout.splitlines()[-1]))
    assert "taskq.schemas.rest" in loaded and "urllib.request" in loaded
    assert not {m for m in loaded if m.split(".")[0] in ("httpx", "httpcore", "authlib", "requests")}, sorted(loaded)
    assert not {m for m in loaded if m.startswith("confluent_kafka.schema_registry")}, sorted(loaded)

def test_the_cli_on_the_way_to_a_worker_loads_no_statistics() -> None:
    # `taskq worker` imports the CLI first: a command's arithmetic module (statistics pulls in fractions,
    # decimal and random, 4-5 ms) would count in every worker's launch.
    probe = "import sys, taskq.cli, taskq.consumer.worker; print(sorted({'statistics', 'fractions'} & {*sys.modules}))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_worker_that_reads_no_share_groups_loads_neither_their_consumers_nor_the_admin_client() -> None:
    # Share mode's module brought the admin client (confluent_kafka.admin): 5 ms of every worker's launch.
    probe = (
        "import sys, taskq.cli, taskq.consumer.worker; "
        "print(sorted({'taskq.consumer.shares', 'taskq._core.kafka_admin', 'confluent_kafka.admin'} & {*sys.modules}))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
