"""The one module that talks to Postgres (psycopg 3): connections, named queries, migrations."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from importlib import resources
from typing import Any

import psycopg
from psycopg.rows import dict_row

from taskq._core.errors import StoreUnavailableError

#: Advisory lock key serialising concurrent migrations (any 64-bit constant unique to taskq).
_MIGRATION_LOCK = 0x7461736B71  # "taskq"


@cache
def queries() -> dict[str, str]:
    """The named statements of sql/queries.sql."""
    text = resources.files(__package__).joinpath("sql/queries.sql").read_text(encoding="utf-8")
    out: dict[str, str] = {}
    for block in re.split(r"^-- name: ", text, flags=re.M)[1:]:
        name, _, body = block.partition("\n")
        out[name.strip()] = body.strip().rstrip(";")
    return out


def migrations() -> list[tuple[int, str, str]]:
    """(version, name, sql) of every numbered migration file, in order."""
    folder = resources.files(__package__).joinpath("sql/migrations")
    found = []
    for entry in folder.iterdir():
        m = re.match(r"^(\d{4})_(\w+)\.sql$", entry.name)
        if m:
            found.append((int(m.group(1)), m.group(2), entry.read_text(encoding="utf-8")))
    return sorted(found)


class Database:
    """Connections to the project's Postgres database, in one schema (search_path)."""

    def __init__(self, url: str, *, schema: str = "public") -> None:
        self.url = url
        self.schema = schema

    def connect(self, *, autocommit: bool = True) -> psycopg.Connection[dict[str, Any]]:
        """A connection whose search_path is the project's schema; StoreUnavailableError if unreachable."""
        try:
            return psycopg.connect(
                self.url,
                autocommit=autocommit,
                row_factory=dict_row,
                options=f"-c search_path={self.schema}",
                connect_timeout=10,
            )
        except psycopg.OperationalError as exc:
            raise StoreUnavailableError(f"cannot connect to Postgres at {_redact(self.url)}: {exc}") from exc

    @contextmanager
    def connection(self, *, autocommit: bool = True) -> Iterator[psycopg.Connection[dict[str, Any]]]:
        """A connection closed on exit."""
        conn = self.connect(autocommit=autocommit)
        try:
            yield conn
        finally:
            conn.close()

    def migrate(self) -> list[str]:
        """Apply the missing migrations in one transaction under an advisory lock; returns their names."""
        applied: list[str] = []
        with self.connection() as conn:
            conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
                conn.execute(
                    "CREATE TABLE IF NOT EXISTS taskq_migrations "
                    "(version integer PRIMARY KEY, name text NOT NULL, "
                    "applied_at timestamptz NOT NULL DEFAULT now())"
                )
                done = {r["version"] for r in conn.execute("SELECT version FROM taskq_migrations")}
                for version, name, sql in migrations():
                    if version in done:
                        continue
                    conn.execute(sql.encode())
                    conn.execute(
                        "INSERT INTO taskq_migrations (version, name) VALUES (%s, %s)", (version, name)
                    )
                    applied.append(f"{version:04d}_{name}")
        return applied

    def drop_schema(self) -> None:
        """Drop the schema and everything in it (tests and `taskq db reset`)."""
        if self.schema == "public":
            raise ValueError("refusing to drop the public schema")
        with self.connection() as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')


def in_transaction(conn: psycopg.Connection[Any]) -> bool:
    """Whether a connection is inside a transaction (or broken), i.e. not safe to hand to the next task."""
    return conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE


def _redact(url: str) -> str:
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)


Error = psycopg.Error
OperationalError = psycopg.OperationalError
