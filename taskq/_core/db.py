"""The one module that talks to Postgres (psycopg 3): a connector running named queries, and migrations."""

from __future__ import annotations

import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from importlib import resources
from typing import TypeAlias, TypeVar

import psycopg
from psycopg.rows import DictRow, dict_row

from taskq._core.errors import StoreUnavailableError
from taskq._core.settings import redact

#: One result row: column name -> value.
Row: TypeAlias = DictRow
#: A connection whose rows are `Row`s.
Connection: TypeAlias = psycopg.Connection[Row]
_Cursor: TypeAlias = psycopg.Cursor[Row]
T = TypeVar("T")

#: Advisory lock key serialising concurrent migrations (any 64-bit constant unique to taskq).
_MIGRATION_LOCK = 0x7461736B71  # "taskq"


@cache
def queries() -> dict[str, str]:
    """The named statements of sql/queries.sql, without their comment lines: psycopg caches the parse of a
    query only up to 4 KiB, and comments are for the file's readers."""
    text = resources.files(__package__).joinpath("sql/queries.sql").read_text(encoding="utf-8")
    out: dict[str, str] = {}
    for block in re.split(r"^-- name: ", text, flags=re.M)[1:]:
        name, _, body = block.partition("\n")
        lines = [line for line in body.splitlines() if not line.lstrip().startswith("--")]
        out[name.strip()] = "\n".join(lines).strip().rstrip(";")
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


class _Queries(ABC):
    """The three ways to run a named query; subclasses say on which connection."""

    @abstractmethod
    def _run(self, name: str, params: dict[str, object], read: Callable[[_Cursor], T]) -> T:
        """Run the named query and read its cursor, wrapping driver errors."""

    def one(self, name: str, /, **params: object) -> Row | None:
        """The first row of a named query, or None."""
        return self._run(name, params, lambda cur: cur.fetchone())

    def all(self, name: str, /, **params: object) -> list[Row]:
        """Every row of a named query."""
        return self._run(name, params, lambda cur: cur.fetchall())

    def execute(self, name: str, /, **params: object) -> int:
        """Run a named query; returns its row count."""
        return self._run(name, params, lambda cur: cur.rowcount)

    def send(self, name: str, /, **params: object) -> _Cursor:
        """Send a named query on a connection in pipeline mode without waiting: read the returned cursor's
        rows once the pipeline has synced (a server-side error is raised by the sync)."""
        return self._run(name, params, lambda cur: cur)


#: The kept connection runs only the named queries, each written to reach its rows by key. On a new table
#: without statistics the planner picks sequential scans and nested loops over them (a completion batch of
#: 500 keys took 50 ms on 30,000 rows), and keeps such generic plans while the table grows. Disabled here
#: (and JIT, which their penalty cost would trigger), every plan takes the primary key from the first task.
_KEYED = " -c enable_seqscan=off -c enable_nestloop=off -c jit=off"


class Database(_Queries):
    """The project's Postgres database in one schema: named queries on a kept connection, transactions."""

    def __init__(self, url: str, *, schema: str = "public") -> None:
        self.url = url
        self.schema = schema
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    def _run(self, name: str, params: dict[str, object], read: Callable[[_Cursor], T]) -> T:
        with self._lock:
            conn = self._conn
            if conn is None or conn.closed:
                conn = self._conn = self.connect(keyed=True)
            try:
                return self._query(conn, name, params, read)
            except StoreUnavailableError:
                # Drop the connection after any driver error: the next query reconnects (Postgres may have
                # restarted, and a connection that failed once is not trusted again).
                conn.close()
                self._conn = None
                raise

    def _query(
        self, conn: Connection, name: str, params: dict[str, object], read: Callable[[_Cursor], T]
    ) -> T:
        """Run a named query on `conn`: the one place a driver error becomes StoreUnavailableError."""
        try:
            return read(conn.execute(queries()[name], params))
        except psycopg.Error as exc:
            raise self._unavailable(f"query {name!r} failed", exc) from exc

    def _unavailable(self, what: str, exc: psycopg.Error) -> StoreUnavailableError:
        # The caller raises it `from exc`, so __cause__ keeps the driver's error.
        return StoreUnavailableError(redact(f"Postgres {what}: {exc}", self.url))

    @contextmanager
    def transaction(self, conn: Connection | None = None) -> Iterator[Transaction]:
        """Named queries in one transaction, committed on clean exit and rolled back otherwise.

        It runs on a new connection closed on exit, or on `conn` (autocommit off), which the caller keeps.
        """
        tx = Transaction(self, conn if conn is not None else self.connect(autocommit=False))
        try:
            yield tx
            try:
                tx.connection.commit()
            except psycopg.Error as exc:
                raise self._unavailable("commit failed", exc) from exc
        except BaseException:
            try:
                if not tx.connection.closed:
                    tx.connection.rollback()
            except psycopg.Error:
                tx.connection.close()  # closing rolls back too; the caller replaces a closed connection
            raise
        finally:
            if conn is None:
                tx.connection.close()

    @contextmanager
    def pipeline(self) -> Iterator[Transaction]:
        """Named queries sent on the kept connection in one pipeline: `send` them in the block and read
        their cursors after it. One round trip, and one implicit transaction: they commit, or fail, together.
        """
        with self._lock:
            conn = self._conn
            if conn is None or conn.closed:
                conn = self._conn = self.connect(keyed=True)
            try:
                with conn.pipeline():
                    yield Transaction(self, conn)
            except psycopg.Error as exc:
                conn.close()
                self._conn = None
                raise self._unavailable("pipeline failed", exc) from exc
            except StoreUnavailableError:
                conn.close()
                self._conn = None
                raise

    def close(self) -> None:
        """Close the kept connection; the next query opens a new one."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def connect(self, *, autocommit: bool = True, keyed: bool = False) -> Connection:
        """A new connection, search_path set to the project's schema; StoreUnavailableError if unreachable.

        `keyed`: planner settings for a connection that runs only the named queries (see `_KEYED`).
        """
        try:
            return psycopg.connect(
                self.url,
                autocommit=autocommit,
                row_factory=dict_row,
                options=f"-c search_path={self.schema}" + (_KEYED if keyed else ""),
                connect_timeout=10,
            )
        except psycopg.Error as exc:
            raise self._unavailable(f"unreachable at {self.url}", exc) from exc

    def warm(self) -> threading.Thread:
        """Open the kept connection in a thread of its own, so that a start does other work meanwhile (named
        queries wait for it). A failure is left to the next query, which connects again and reports it."""

        def connect() -> None:
            with self._lock:
                if self._conn is None or self._conn.closed:
                    try:
                        self._conn = self.connect(keyed=True)
                    except StoreUnavailableError:
                        pass

        thread = threading.Thread(target=connect, name="taskq-db-connect", daemon=True)
        thread.start()
        return thread

    @contextmanager
    def connection(self, *, autocommit: bool = True) -> Iterator[Connection]:
        """A new connection, closed on exit."""
        conn = self.connect(autocommit=autocommit)
        try:
            yield conn
        finally:
            conn.close()

    def migrate(self, *, namespace: str = "taskq") -> list[str]:
        """Apply the missing migrations in one transaction under an advisory lock; returns their names.

        `namespace` is the one records written before namespaces were kept (migration 0003) belong to.
        """
        applied: list[str] = []
        with self.connection() as conn:
            if self._up_to_date(conn):
                return applied  # one round trip: every worker's start checks, and nearly always finds none
            conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
                conn.execute("SELECT set_config('taskq.namespace', %s, true)", (namespace,))
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

    def _up_to_date(self, conn: Connection) -> bool:
        """Whether every migration is applied already, in one statement and without the lock (migrations
        commit whole, each with its row, so one seen applied is applied); False where there is no schema or
        no migrations table yet."""
        try:
            done = {r["version"] for r in conn.execute("SELECT version FROM taskq_migrations")}
        except psycopg.errors.UndefinedTable:
            return False
        return all(version in done for version, _, _ in migrations())

    def drop_schema(self) -> None:
        """Drop the schema and everything in it (tests and `taskq db reset`)."""
        if self.schema == "public":
            raise ValueError("refusing to drop the public schema")
        with self.connection() as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')


class Transaction(_Queries):
    """Named queries inside one open transaction of `Database.transaction`."""

    def __init__(self, database: Database, connection: Connection) -> None:
        self.connection = connection
        self._database = database

    def _run(self, name: str, params: dict[str, object], read: Callable[[_Cursor], T]) -> T:
        return self._database._query(self.connection, name, params, read)


def in_transaction(conn: Connection) -> bool:
    """Whether a connection is inside a transaction (or broken), i.e. not safe to hand to the next task."""
    return conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE
