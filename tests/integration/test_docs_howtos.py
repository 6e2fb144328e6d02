"""How-to pages whose blocks run against the stack as written, in the test's own namespace."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from taskq._core.db import Database
from taskq._core.settings import Settings
from taskq.schemas import Registry
from tests.docblocks import REPO, PageRun


def test_the_schema_evolution_page_runs_as_written(
    settings: Settings, env_of: Callable[..., dict[str, str]], tmp_path: Path
) -> None:
    ns = settings.namespace
    page = PageRun(
        "how-to/schema-evolution.md", tmp_path, env_of(), rename=lambda t: re.sub(r"\bshop\b", ns, t)
    )
    page.run_until("check-compatible")
    assert page.outputs["check-compatible"].split()[:2] == ["compatible", f"{ns}.Charge"]
    with Registry(settings.schema_registry_url) as registry:
        assert registry.versions(f"{ns}.Charge") == [1]  # a check registers nothing
    page.run_rest()
    with Registry(settings.schema_registry_url) as registry:
        assert registry.versions(f"{ns}.Charge") == [1, 2]


def test_the_upgrading_page_runs_as_written(
    settings: Settings, env_of: Callable[..., dict[str, str]], tmp_path: Path
) -> None:
    schema = f"{settings.database_schema}_fresh"  # a database schema no migration has touched yet
    page = PageRun("how-to/upgrading.md", tmp_path, env_of(TASKQ_DATABASE_SCHEMA=schema))
    try:
        page.run_rest()
    finally:
        Database(settings.database_url, schema=schema).drop_schema()
    migrations = sorted(p.stem for p in (REPO / "taskq" / "_core" / "sql" / "migrations").glob("*.sql"))
    assert page.outputs["migrate"].split() == [w for m in migrations for w in ("applied", m)]
    assert page.outputs["again"].strip() == "up to date"
