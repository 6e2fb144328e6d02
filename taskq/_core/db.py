"""The one module that talks to Postgres (psycopg 3): a connector running named queries, and migrations."""

from __future__ import annotations

import re
import select
import struct
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from importlib import resources
from typing import TypeAlias, TypeVar

import psycopg
from psycopg import pq
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
        self._wire: _Wire | None = None  # what the kept connection has prepared for `round_trip`
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

    def round_trip(self, *named: tuple[str | Statement, dict[str, object]]) -> list[list[Row]]:
        """Named queries (or `Statement`s) sent through libpq itself in one pipeline, on the kept connection:
        one round trip and one implicit transaction (they commit, or fail, together). The rows of each.

        The recorder's round trip of every loop pass (claims and outcomes) goes this way. Through psycopg's
        cursors the same pipeline of a completion and a claim of one key each cost the process 270-300 µs of
        CPU; through libpq, 50-60 (see `_Wire`). What a query may take is `_Wire`'s to say.
        """
        with self._lock:
            conn = self._conn
            if conn is None or conn.closed:
                conn = self._conn = self.connect(keyed=True)
            wire = self._wire
            if wire is None or wire.conn is not conn:
                wire = self._wire = _Wire(conn)
            try:
                return wire.round_trip(named)
            except psycopg.Error as exc:
                conn.close()
                self._conn = None
                raise self._unavailable("pipeline failed", exc) from exc
            except BaseException:  # interrupted mid-pipeline (KeyboardInterrupt): its state is unknown
                conn.close()
                self._conn = None
                raise

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


class _Wire:
    """Named queries prepared on one connection and run in pipelines through libpq (psycopg's `pq` layer),
    without psycopg's cursors: `Database.round_trip`.

    The saving is psycopg's work around each statement (adapting every parameter, a cursor and its
    generators, the pipeline's bookkeeping, dict rows), not the server's. It counts most where a statement
    carries few keys and a round trip is made for every task or two: the recorder at a steady rate.

    Parameters go in binary. A list is an array whose element type is the query's cast of it
    (`%(keys)b::text[]`); str, int, float, bool and None are text, int8, float8, bool and NULL. Rows come
    back in text and are read by their columns' types: integers, floats, booleans, and text for the rest.
    Each (query, parameter types) is prepared once per connection, in the pipeline of its first use.
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._encoding = conn.info.encoding
        self._prepared: set[bytes] = set()

    def round_trip(self, named: tuple[tuple[str | Statement, dict[str, object]], ...]) -> list[list[Row]]:
        pg = self.conn.pgconn
        if pg.transaction_status != pq.TransactionStatus.IDLE:
            raise psycopg.InterfaceError("the kept connection is inside a transaction")
        # Everything is encoded before the pipeline starts: a value that cannot be sent leaves the
        # connection as it was.
        sends = []
        for name, params in named:
            query = name if isinstance(name, Statement) else _statement(name)
            typed = [_param(params[p], elems, self._encoding) for p, elems in query.params]
            types = [oid for oid, _ in typed]
            key = b"_".join([query.name, *(b"%d" % oid for oid in types)])
            sends.append((query, key, types, [v for _, v in typed]))
        preparing: list[bytes] = []
        pg.enter_pipeline_mode()
        for query, key, types, _ in sends:  # the preparations first: their results come first
            if key not in self._prepared and key not in preparing:
                pg.send_prepare(key, query.sql, param_types=types)
                preparing.append(key)
        for _, key, _, values in sends:
            pg.send_query_prepared(key, values, param_formats=[1] * len(values))
        pg.pipeline_sync()
        results = self._exchange(pg)
        pg.exit_pipeline_mode()
        error = next((r for r in results if r.status == pq.ExecStatus.FATAL_ERROR), None)
        if error is not None:
            raise psycopg.errors.error_from_result(error, encoding=self._encoding)
        self._prepared.update(preparing)
        answers = results[len(preparing) :] if preparing else results
        if len(answers) != len(named) or any(r.status != pq.ExecStatus.TUPLES_OK for r in answers):
            raise psycopg.InterfaceError(f"{len(named)} queries sent; their results were {results}")
        return [self._rows(r) for r in answers]

    def _exchange(self, pg: pq.abc.PGconn) -> list[pq.abc.PGresult]:
        """Send what is queued and read results until the pipeline's sync."""
        poll = select.poll()
        poll.register(pg.socket, select.POLLIN | select.POLLOUT)
        while pg.flush():  # the rest waits for room in the socket; read meanwhile, or the server may stall
            if any(ev & select.POLLIN for _, ev in poll.poll()):
                pg.consume_input()
        poll.modify(pg.socket, select.POLLIN)
        results: list[pq.abc.PGresult] = []
        while True:
            while pg.is_busy():
                poll.poll()
                pg.consume_input()
            res = pg.get_result()
            if res is None:  # the end of one query's results
                continue
            if res.status == pq.ExecStatus.PIPELINE_SYNC:
                return results
            results.append(res)

    def _rows(self, res: pq.abc.PGresult) -> list[Row]:
        if not res.ntuples:
            return []
        encoding = self._encoding
        columns = [
            ((res.fname(c) or b"").decode(encoding), _READ.get(res.ftype(c), _text))
            for c in range(res.nfields)
        ]
        out: list[Row] = []
        for i in range(res.ntuples):
            row: Row = {}
            for c, (name, read) in enumerate(columns):
                raw = res.get_value(i, c)
                row[name] = None if raw is None else read(raw, encoding)
            out.append(row)
        return out


class Statement:
    """A query for `Database.round_trip`, its parameters numbered: `%(name)s` and `%(name)b` become $1,
    $2, ... (a name used twice is one parameter), each with the element type of its array cast, if any.
    The named queries of sql/queries.sql are made into statements by name; the benches make their own. A
    statement is prepared under its name: one name, one text."""

    def __init__(self, name: str, text: str) -> None:
        self.name = b"taskq_" + name.encode()
        order: dict[str, int] = {}
        elems: dict[str, int | None] = {}

        def number(m: re.Match[str]) -> str:
            param, cast = m.group(1), m.group(2)
            if param not in order:
                order[param] = len(order) + 1
                elems[param] = _ELEMENT_OIDS[cast] if cast else None
            return f"${order[param]}" + (f"::{cast}" if cast else "")

        self.sql = re.sub(r"%\((\w+)\)[sb](?:::(\w+\[\]))?", number, text).encode()
        self.params = [(p, elems[p]) for p in order]


@cache
def _statement(name: str) -> Statement:
    return Statement(name, queries()[name])


#: The array casts the named queries use, and their element types' oids.
_ELEMENT_OIDS = {"text[]": 25, "int[]": 23, "bigint[]": 20, "float8[]": 701, "jsonb[]": 3802}
_ARRAY_OIDS = {25: 1009, 23: 1007, 20: 1016, 701: 1022, 3802: 3807}
_LEN = struct.Struct(">i")
_ARRAY_HEAD = struct.Struct(">iiiii")  # dimensions, has nulls, element type, length, lower bound
_EMPTY_ARRAY = struct.Struct(">iii")
_NULL = _LEN.pack(-1)
_INT4 = struct.Struct(">ii")
_INT8 = struct.Struct(">iq")
_FLOAT8 = struct.Struct(">id")


def _element(oid: int, value: object, encoding: str) -> bytes:
    """One array element in binary, its length first."""
    if value is None:
        return _NULL
    if oid == 25:
        data = str(value).encode(encoding)
        return _LEN.pack(len(data)) + data
    if oid == 3802:  # jsonb's binary form: a version byte, then the text
        data = str(value).encode(encoding)
        return _LEN.pack(len(data) + 1) + b"\x01" + data
    if oid == 23:
        return _INT4.pack(4, value)
    if oid == 20:
        return _INT8.pack(8, value)
    return _FLOAT8.pack(8, value)


def _param(value: object, elem: int | None, encoding: str) -> tuple[int, bytes | None]:
    """A parameter's (type oid, binary value)."""
    if isinstance(value, list):
        if elem is None:
            raise psycopg.ProgrammingError("a list parameter needs an array cast in its query")
        if not value:
            return _ARRAY_OIDS[elem], _EMPTY_ARRAY.pack(0, 0, elem)
        if elem == 25 and None not in value:  # the common case: keys, ids, types
            parts = []
            for s in value:
                data = s.encode(encoding)
                parts.append(_LEN.pack(len(data)))
                parts.append(data)
            body = b"".join(parts)
        else:
            body = b"".join([_element(elem, v, encoding) for v in value])
        return _ARRAY_OIDS[elem], _ARRAY_HEAD.pack(1, None in value, elem, len(value), 1) + body
    if value is None:
        return 0, None
    if isinstance(value, bool):
        return 16, b"\x01" if value else b"\x00"
    if isinstance(value, str):
        return 25, value.encode(encoding)
    if isinstance(value, int):
        return 20, struct.pack(">q", value)
    if isinstance(value, float):
        return 701, struct.pack(">d", value)
    raise psycopg.ProgrammingError(f"cannot send a {type(value).__name__} parameter this way")


def _text(raw: bytes, encoding: str) -> object:
    return raw.decode(encoding)


#: How a column in text is read, by its type's oid: int2, int4, int8, float4, float8, bool; else text.
_READ: dict[int, Callable[[bytes, str], object]] = {
    21: lambda raw, _: int(raw),
    23: lambda raw, _: int(raw),
    20: lambda raw, _: int(raw),
    700: lambda raw, _: float(raw),
    701: lambda raw, _: float(raw),
    16: lambda raw, _: raw == b"t",
}
