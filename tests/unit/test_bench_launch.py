"""A bench worker's launch counts what a deployed worker's does: a program's start, cached bytecode, as a
wheel's install writes, and the worker's modules without the bench's others."""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from taskq._core.errors import TaskqError
from taskq.tools.bench import runners
from taskq.tools.bench.runners import (
    _RUNNER_IMPORTS,
    _read_frame,
    _Report,
    _Workers,
    _WorkerSpec,
    _write_frame,
    cache_bytecode,
)
from tests.conftest import REPO


def test_bytecode_is_written_even_where_python_writes_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "handlers"
    (package / "sub").mkdir(parents=True)
    modules = [package / "__init__.py", package / "sub" / "tasks.py"]
    for module in modules:
        module.write_text("VALUE = 1\n")
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # PYTHONDONTWRITEBYTECODE, as in the image

    cache_bytecode(str(package))

    for module in modules:
        assert Path(importlib.util.cache_from_source(str(module))).is_file()
    # An interpreter that writes none uses it: its loader compiles nothing.
    probe = (
        "import importlib.util, sys; sys.path.insert(0, sys.argv[1]); "
        "spec = importlib.util.find_spec('handlers.sub.tasks'); "
        "spec.loader.source_to_code = lambda *a, **k: sys.exit('compiled'); "
        "spec.loader.get_code('handlers.sub.tasks')"
    )
    subprocess.run([sys.executable, "-B", "-c", probe, str(tmp_path)], check=True)


def _modules(statement: str) -> set[str]:
    probe = f"import sys; {statement}; print(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    return set(out.split())


def test_a_bench_runner_process_imports_only_what_taskq_worker_does_and_its_own_modules() -> None:
    # Its entry, as `taskq worker`'s, is an interpreter's start and these imports: not the producer, the
    # other benches, their admin client and statistics, nor the profiler (nor, as when multiprocessing
    # spawned it, its bootstrap and the parent's main module imported again: some 25 ms of launch).
    worker = _modules("import taskq.cli, taskq.consumer.worker")
    runner = _modules(_RUNNER_IMPORTS)
    own = {"taskq.tools", "taskq.tools.bench", "taskq.tools.bench.effects", "taskq.tools.bench.runners"}
    assert runner - worker == own


def test_a_runners_reports_cross_its_pipe_whole_and_a_cut_one_ends_the_stream() -> None:
    report = _Report(3, started=[("k", 1.5)], partitions=4, final=True)
    pipe = io.BytesIO()
    _write_frame(pipe, report)
    _write_frame(pipe, ("next", 1))
    data = pipe.getvalue()
    stream = io.BytesIO(data)
    assert _read_frame(stream) == report and _read_frame(stream) == ("next", 1)
    with pytest.raises(EOFError):
        _read_frame(stream)
    first = io.BytesIO()
    _write_frame(first, report)
    with pytest.raises(EOFError):  # the runner died mid-frame
        _read_frame(io.BytesIO(first.getvalue()[:-3]))


def test_runner_processes_that_die_at_once_end_the_bench_with_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Whether a runner is gone before its parent writes what to run (a broken pipe) or after, the bench
    # stops with its one line, not a traceback from the write, and closes the runners' pipes (an unclosed
    # one is a ResourceWarning, an error under this suite's settings).
    monkeypatch.setattr(runners, "_RUNNER", "import sys; sys.exit(3)")
    monkeypatch.setattr(runners, "cache_bytecode", lambda: None)
    spec = _WorkerSpec(settings={}, task_type="t.T", schema={}, handler="noop", concurrency=1)
    with (
        pytest.raises(TaskqError, match=r"^bench: every worker exited$"),
        _Workers(spec, processes=3) as workers,
    ):
        workers.wait(lambda: False, 30, "nothing")


def test_a_runner_imports_taskq_from_where_its_bench_did_not_from_its_working_directory(
    tmp_path: Path,
) -> None:
    # How two versions are compared in alternation: the bench started in one checkout (its working
    # directory holds a `taskq`), with PYTHONPATH naming another. The bench imported the other; its
    # runners, started by `python -c`, imported the working directory's, so both arms ran the same
    # workers. Here the other checkout is a link to this one's package under another name.
    other = tmp_path / "other"
    other.mkdir()
    (other / "taskq").symlink_to(REPO / "taskq")
    bench = tmp_path / "bench.py"  # started as a console script is: its own directory first on sys.path
    bench.write_text(
        "import subprocess, taskq\n"
        "from taskq.tools.bench.runners import _runner_argv\n"
        "print(taskq.__file__)\n"
        "subprocess.run(_runner_argv('import taskq; print(taskq.__file__)'), check=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(other)}
    out = subprocess.run(
        [sys.executable, str(bench)], cwd=REPO, env=env, check=True, capture_output=True, text=True
    ).stdout.split()
    assert out == [str(other / "taskq" / "__init__.py")] * 2
