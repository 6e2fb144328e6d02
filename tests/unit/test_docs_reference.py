"""The docs site: the generated reference names every public name, command, setting and metric; every code
block of the tutorial and the how-to guides is run by a test; and the site builds under --strict."""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

import taskq
from docs import gen_reference as gen
from taskq.cli import build_parser
from taskq.consumer.metrics import PrometheusHook
from tests.docblocks import DOCS, REPO, blocks, covered_pages


def test_every_public_name_is_in_the_python_reference() -> None:
    page = gen.python_api()
    for name in taskq.__all__:
        assert f"::: taskq.{name}\n" in page or f"`taskq.{name}`" in page, name


def test_every_leaf_command_is_in_the_cli_reference_with_every_option() -> None:
    page = gen.cli()
    commands = gen.cli_commands()
    assert len(commands) >= 20
    for path, parser in commands:
        assert f"## `{path}`" in page, path
        for action in parser._actions:
            if not isinstance(action, argparse._HelpAction):
                for flag in action.option_strings:
                    assert f"`{flag}`" in page, (path, flag)


def test_a_subcommand_added_to_the_parser_is_found() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub.add_parser("brand-new").add_subparsers().add_parser("leaf")
    assert "taskq brand-new leaf" in [path for path, _ in gen.cli_commands(parser)]


def test_every_taskq_variable_in_the_code_is_in_the_settings_reference() -> None:
    page = gen.settings()
    found = gen.variables_in_code()
    assert {"TASKQ_BOOTSTRAP_SERVERS", "TASKQ_DATABASE_URL", "TASKQ_LOG_FORMAT"} <= found
    for var in found:
        covered = f"`{var}`" in page or (var.startswith("TASKQ_KAFKA_") and "`TASKQ_KAFKA_*`" in page)
        assert covered, var


def test_every_settings_field_has_a_description_and_its_variable_is_read() -> None:
    import dataclasses

    from taskq._core.settings import Settings

    for f in dataclasses.fields(Settings):
        assert f.metadata.get("doc"), f.name
        var = f.metadata.get("env", "")
        if var and not var.endswith("*"):  # the variable named in the reference is the one from_env reads
            valid = {"group_protocol": "classic", "delay_tiers": "7s", "schema_registry_url": "http://probe"}
            probe = valid.get(f.name, "probe")
            companion = {  # settings valid only beside another one
                "schema_registry_user": {"TASKQ_SCHEMA_REGISTRY_PASSWORD": "p"},
                "schema_registry_password": {"TASKQ_SCHEMA_REGISTRY_USER": "u"},
                "schema_registry_key_file": {"TASKQ_SCHEMA_REGISTRY_CERT_FILE": "c.pem"},
            }.get(f.name, {})
            value = getattr(Settings.from_env({var: probe, **companion}), f.name)
            assert value != getattr(Settings(), f.name), (f.name, var)


def test_the_metrics_reference_matches_the_collectors_the_worker_creates() -> None:
    documented = {m.name: m for m in gen.metrics()}
    hook = PrometheusHook(CollectorRegistry())
    for collector in vars(hook).values():
        if hasattr(collector, "_name") and hasattr(collector, "_labelnames"):
            name = collector._name + ("_total" if collector._type == "counter" else "")
            assert name in documented, name
            assert documented[name].labels == tuple(collector._labelnames), name
    page = gen.metrics_table()
    for name in documented:
        assert f"`{name}`" in page


def test_every_metric_defined_anywhere_in_the_package_is_documented() -> None:
    # A cross-check of the generator's reading of the source, by another reading of it.
    documented = {m.name for m in gen.metrics()}
    in_source = set()
    for path in (REPO / "taskq").rglob("*.py"):
        in_source.update(
            re.findall(r"\b(?:Counter|Gauge|Histogram|Summary)\(\s*\"(taskq_\w+)\"", path.read_text())
        )
    assert {
        "taskq_tier_depth",
        "taskq_dlq_depth",
        "taskq_enqueue_seconds",
        "taskq_outbox_lag_seconds",
    } <= documented
    assert in_source == documented


def test_every_header_and_table_is_in_the_wire_and_schema_references() -> None:
    assert "`taskq-task-id`" in gen.headers() and "`traceparent`" in gen.headers()
    schema = gen.postgres_schema()
    for migration in sorted((gen.MIGRATIONS).glob("*.sql")):
        assert migration.name in schema
    listed = (DOCS / "reference" / "postgres-schema.md").read_text()
    for table in gen.tables():
        assert f"`{table}`" in listed, table


@pytest.mark.parametrize(
    ("page", "marker"),
    [
        ("reference/python.md", "python-api"),
        ("reference/cli.md", "cli"),
        ("reference/settings.md", "settings"),
        ("reference/metrics.md", "metrics"),
        ("reference/wire-format.md", "headers"),
        ("reference/wire-format.md", "topics"),
        ("reference/postgres-schema.md", "postgres-schema"),
    ],
)
def test_each_reference_page_holds_its_generated_part(page: str, marker: str) -> None:
    assert f"<!-- gen:{marker} -->" in (DOCS / page).read_text()


# ------------------------------------------------------------------------------------------------ code blocks
def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_every_code_block_of_the_tutorial_and_how_tos_is_run_by_a_test() -> None:
    pages = covered_pages()
    assert "tutorial.md" in pages and len(pages) >= 14
    all_tests = "\n".join(p.read_text() for p in (REPO / "tests").rglob("test_*.py"))
    for page in pages:
        page_blocks = blocks(page)
        for block in page_blocks:
            assert block.kind, f"{block}: no <!-- run -->, <!-- file: ... --> or <!-- test: ... --> marker"
            if block.kind == "test":
                path, _, name = block.arg.partition("::")
                assert (REPO / path).is_file(), f"{block}: no such test file {path}"
                assert name in _tests_in(REPO / path), f"{block}: no test {name} in {path}"
            if block.kind == "file":
                assert block.arg, f"{block}: file: needs a name"
        if any(b.kind in ("run", "file") for b in page_blocks):  # executed: a test must run this page
            assert f'PageRun(\n        "{page}"' in all_tests or f'PageRun("{page}"' in all_tests, page


def test_the_marker_parser_reads_blocks_markers_and_ids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests import docblocks

    (tmp_path / "p.md").write_text(
        "text\n\n<!-- run #one -->\n\n```sh\necho hi\n```\n\n```python\nx = 1\n```\n\n"
        "1. step\n\n    <!-- file: a.py -->\n\n    ```python\n    y = 2\n    ```\n"
    )
    monkeypatch.setattr(docblocks, "DOCS", tmp_path)
    found = docblocks.blocks("p.md")
    assert [(b.kind, b.arg, b.id, b.lang, b.code) for b in found] == [
        ("run", "", "one", "sh", "echo hi\n"),
        ("", "", "", "python", "x = 1\n"),
        ("file", "a.py", "", "python", "y = 2\n"),
    ]


# ---------------------------------------------------------------------------------------------- the built sit
def test_the_site_builds_strictly_and_names_everything(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": str(Path(sys.executable).parent)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "WARNING" not in out.stderr, out.stderr
    site = tmp_path / "site"
    api = (site / "reference" / "python" / "index.html").read_text()
    for name in taskq.__all__:
        assert f'id="taskq.{name}"' in api or f"taskq.{name}" in api, name
    cli = (site / "reference" / "cli" / "index.html").read_text()
    for path, _ in gen.cli_commands():
        assert path in cli, path
    settings = (site / "reference" / "settings" / "index.html").read_text()
    for var in gen.variables_in_code():
        assert var in settings or var.startswith("TASKQ_KAFKA_"), var
    for page in ("tutorial", "how-to/kubernetes", "explanation/autoscaling", "explanation/architecture"):
        assert (site / page / "index.html").is_file(), page
