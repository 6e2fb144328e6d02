"""Installed as a user installs it: a wheel built without warnings, a fresh virtualenv with a working `taskq`,
and an app whose own `schemas.py`, `producer.py` and `consumer.py` keep their names next to the library."""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from collections.abc import Callable
from pathlib import Path

from taskq import Settings, TaskProducer
from taskq.schemas import Registry
from tests.acceptance.helpers import WorkerProcess, wait_until
from tests.conftest import REPO


def run(*argv: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, f"{argv} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout + out.stderr


def test_an_installed_taskq_runs_an_app_whose_own_modules_are_named_like_its_parts(
    settings: Settings, env_of: Callable[..., dict[str, str]], tmp_path: Path
) -> None:
    # The wheel `pip install .` builds: no setuptools warning, and the package data inside.
    wheels = tmp_path / "wheels"
    build = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-v", REPO, "-w", wheels)
    warnings = sorted(set(re.findall(r"\b\w*Warning\b.*", build)))
    assert not warnings, warnings
    (wheel,) = wheels.glob("kafka_taskq-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for data in ("taskq/py.typed", "taskq/_core/sql/queries.sql", "taskq/demo/send_email.avsc"):
        assert data in names, sorted(names)
    assert any(n.endswith("licenses/LICENSE") for n in names), sorted(names)

    # A fresh virtualenv, not editable. Its dependencies come from this one (a .pth path entry), so the
    # test needs no download; the .pth files of that site-packages (an editable taskq) are not processed.
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    purelib = Path(sysconfig.get_paths(vars={"base": str(env_dir), "platbase": str(env_dir)})["purelib"])
    (purelib / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run(env_dir / "bin" / "pip", "install", "--no-deps", "--no-index", "-q", wheel)
    taskq_cmd = env_dir / "bin" / "taskq"
    assert "worker" in run(taskq_cmd, "--help")

    # The app: a FastAPI-style directory with its own schemas.py, producer.py and consumer.py.
    app_dir = tmp_path / "app"
    app_dir.mkdir()
    for name in ("schemas", "producer", "consumer"):
        (app_dir / f"{name}.py").write_text(f'WHO = "the app\'s own {name}"\n')
    task_type = f"{settings.namespace}.Note"
    schema = {"type": "record", "name": "Note", "namespace": settings.namespace,
              "fields": [{"name": "path", "type": "string"}]}  # fmt: skip
    (app_dir / "app.py").write_text(
        textwrap.dedent(
            f"""
            from pathlib import Path

            import consumer, producer, schemas  # the app's own modules, not the library's
            from taskq import Handlers

            handlers = Handlers()

            @handlers.task({task_type!r}, schema={schema!r})
            def note(payload, ctx):
                Path(payload["path"]).write_text(" | ".join([schemas.WHO, producer.WHO, consumer.WHO]))
            """
        )
    )
    env = {k: v for k, v in env_of().items() if k != "PYTHONPATH"}  # nothing of this checkout is importable
    where = run(
        env_dir / "bin" / "python",
        "-c",
        "import taskq, schemas; print(schemas.WHO); print(taskq.__file__)",
        cwd=app_dir,
        env=env,
    )
    assert "the app's own schemas" in where and str(env_dir) in where, where

    with Registry(settings.schema_registry_url) as registry:
        registry.register(schema)
    done = tmp_path / "done.txt"
    with TaskProducer(settings) as producer:
        producer.enqueue(task_type, {"path": str(done)}, wait=True)
    log = tmp_path / "worker.log"
    worker = WorkerProcess(
        env,
        log,
        command=("worker", "app:handlers", "--concurrency", "1"),
        taskq=(str(taskq_cmd),),  # the installed console script, run from the app's directory
        cwd=app_dir,
    )
    try:
        # Until the handler's write_text has written, the file it created reads empty: wait for its text.
        wait_until(
            lambda: done.exists() and done.read_text(),
            timeout=90,
            what=f"the app's task to run\n{log.read_text()}",
        )
        assert done.read_text() == (
            "the app's own schemas | the app's own producer | the app's own consumer"
        ), log.read_text()
        worker.terminate()
        assert worker.wait(60) == 0, log.read_text()
    finally:
        worker.close()
