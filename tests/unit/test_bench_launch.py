"""A spawned bench worker's launch counts what a deployed worker's does: cached bytecode, as a wheel's
install writes, and the worker's modules without the bench's others."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from taskq.tools.bench.runners import cache_bytecode


def test_bytecode_is_written_even_where_python_writes_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
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


def test_a_spawned_bench_worker_imports_neither_the_producer_nor_the_other_benches() -> None:
    probe = (
        "import sys, taskq.tools.bench.runners; "
        "print(' '.join(m for m in ('taskq.producer.producer', 'taskq.tools.bench.ceiling', "
        "'taskq.tools.bench.latency', 'taskq.tools.bench.worker') if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    assert loaded.split() == []
