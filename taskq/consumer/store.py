"""The idempotency store: one Postgres row per idempotency key, claimed with a lease before a task runs."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from taskq._core.db import Database, Error, in_transaction, queries
from taskq._core.errors import StoreUnavailableError

T = TypeVar("T")
ClaimOutcome = Literal["claimed", "completed", "running", "duplicate"]


class LeaseLostError(Exception):
    """Another worker took over this key's lease; this attempt's completion was not recorded."""


@dataclass(frozen=True, slots=True)
class ClaimRequest:
    """A task asking to run: its idempotency key and how long its lease must last."""

    idempotency_key: str
    task_id: str
    task_type: str
    lease_seconds: float


@dataclass(frozen=True, slots=True)
class Claim:
    """The store's answer: run it (claimed, with its attempt number), skip it (completed), or hold it."""

    idempotency_key: str
    outcome: ClaimOutcome
    attempts: int
    lease_left: float = 0.0


@dataclass(frozen=True, slots=True)
class Finished:
    """An attempt's end, to record: completed (with a small result) or failed/dead (with its error)."""

    idempotency_key: str
    attempts: int
    state: Literal["completed", "failed", "dead"]
    result: Any = None
    error: str = ""


class IdempotencyStore:
    """Claims, completions and failures of idempotency keys, batched: one round trip for many tasks."""

    def __init__(self, database: Database, *, owner: str) -> None:
        self.database = database
        self.owner = owner
        self._conn: Any = None
        self._lock = threading.Lock()
        self._local = threading.local()
        self._thread_conns: list[Any] = []
        self._q = queries()

    def _execute(self, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        return self._run(name, params, lambda cur: list(cur.fetchall()))

    def _run(self, name: str, params: dict[str, Any], read: Callable[[Any], T]) -> T:
        with self._lock:
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = self.database.connect()
                return read(self._conn.execute(self._q[name], params))
            except Error as exc:
                # Drop the connection: the next call reconnects (Postgres may have restarted).
                if self._conn is not None:
                    try:
                        self._conn.close()
                    finally:
                        self._conn = None
                raise StoreUnavailableError(f"idempotency store ({name}): {exc}") from exc

    def claim(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """Claim each key for one attempt; answers in request order. A key twice in one batch: 'duplicate'."""
        seen: set[str] = set()
        unique: list[ClaimRequest] = []
        for r in requests:
            if r.idempotency_key not in seen:
                seen.add(r.idempotency_key)
                unique.append(r)
        rows = (
            self._execute(
                "claim",
                {
                    "keys": [r.idempotency_key for r in unique],
                    "task_ids": [r.task_id for r in unique],
                    "task_types": [r.task_type for r in unique],
                    "leases": [r.lease_seconds for r in unique],
                    "owner": self.owner,
                },
            )
            if unique
            else []
        )
        by_key = {row["idempotency_key"]: row for row in rows}
        out: list[Claim] = []
        answered: set[str] = set()
        for r in requests:
            row = by_key[r.idempotency_key]
            if r.idempotency_key in answered:
                out.append(Claim(r.idempotency_key, "duplicate", int(row["attempts"] or 0)))
                continue
            answered.add(r.idempotency_key)
            outcome = row["outcome"]
            if outcome not in ("claimed", "completed"):
                outcome = "running"  # leased by a live worker (or this one, for a redelivered copy)
            out.append(
                Claim(r.idempotency_key, outcome, int(row["attempts"] or 0), float(row["lease_left"] or 0.0))
            )
        return out

    def finish(self, finished: Sequence[Finished]) -> set[str]:
        """Record completions and failures; returns the keys whose lease was lost (nothing recorded)."""
        lost: set[str] = set()
        done = [f for f in finished if f.state == "completed"]
        failed = [f for f in finished if f.state != "completed"]
        if done:
            rows = self._execute(
                "complete",
                {
                    "keys": [f.idempotency_key for f in done],
                    "attempts": [f.attempts for f in done],
                    "results": [_result_json(f.result) for f in done],
                    "owner": self.owner,
                },
            )
            lost |= {f.idempotency_key for f in done} - {r["idempotency_key"] for r in rows}
        if failed:
            rows = self._execute(
                "fail",
                {
                    "keys": [f.idempotency_key for f in failed],
                    "attempts": [f.attempts for f in failed],
                    "states": [f.state for f in failed],
                    "errors": [f.error[:4000] for f in failed],
                    "owner": self.owner,
                },
            )
            lost |= {f.idempotency_key for f in failed} - {r["idempotency_key"] for r in rows}
        return lost

    @contextmanager
    def transaction(self, idempotency_key: str, attempts: int, result: Any = None) -> Iterator[Any]:
        """A connection in a transaction that records the key's completion when the block exits cleanly.

        The handler's writes and the completion commit together or not at all: exactly-once for effects in
        Postgres. LeaseLostError (and a rollback) if another worker took the lease meanwhile.
        """
        conn = self._thread_connection()
        try:
            yield conn
            rows = conn.execute(
                self._q["complete"],
                {
                    "keys": [idempotency_key],
                    "attempts": [attempts],
                    "results": [_result_json(result)],
                    "owner": self.owner,
                },
            ).fetchall()
            if not rows:
                conn.rollback()
                raise LeaseLostError(f"lease of {idempotency_key!r} attempt {attempts} was taken over")
            conn.commit()
        except BaseException:
            try:
                if not conn.closed:
                    conn.rollback()
            except Error:
                conn.close()
            raise
        finally:
            if conn.closed or in_transaction(conn):
                conn.close()
                self._local.conn = None

    def _thread_connection(self) -> Any:
        # One connection per executor thread, kept between tasks: a connect per task would cost more than
        # most handlers. A connection left in any state but idle is closed and replaced.
        conn = getattr(self._local, "conn", None)
        if conn is None or conn.closed or conn.broken:
            conn = self._local.conn = self.database.connect(autocommit=False)
            with self._lock:
                self._thread_conns = [c for c in self._thread_conns if not c.closed] + [conn]
        return conn

    def get(self, idempotency_key: str) -> dict[str, Any] | None:
        """The record of one key, or None."""
        rows = self._execute("get", {"key": idempotency_key})
        return rows[0] if rows else None

    def reset_for_replay(self, idempotency_key: str) -> bool:
        """Start a dead key's attempts over (DLQ replay); False if it is not dead (e.g. completed)."""
        return bool(self._execute("reset_for_replay", {"key": idempotency_key}))

    def purge(self, ttl_seconds: float, *, batch: int = 10_000) -> int:
        """Delete completed and dead records older than the TTL; returns how many."""
        total = 0
        while True:
            n = self._run(
                "purge", {"ttl_seconds": ttl_seconds, "batch": batch}, lambda cur: int(cur.rowcount)
            )
            total += max(0, n)
            if n < batch:
                return total

    def retries(self) -> tuple[int, int]:
        """(tasks that needed more than one attempt, attempts beyond the first), over all workers."""
        row = self._execute("retries", {})[0]
        return int(row["tasks"]), int(row["retries"])

    def counts(self) -> dict[str, int]:
        """Number of records per state."""
        return {r["state"]: int(r["n"]) for r in self._execute("counts", {})}

    def close(self) -> None:
        """Close the connections (the loop's, and the handler threads' idle ones)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            for conn in self._thread_conns:
                if not conn.closed and not in_transaction(conn):
                    conn.close()
            self._thread_conns = []


def _result_json(result: Any) -> str | None:
    if result is None:
        return None
    try:
        text = json.dumps(result, default=str)
    except (TypeError, ValueError):
        text = json.dumps(repr(result))
    # Results are for inspection, not storage: keep rows small.
    return text if len(text) <= 8192 else json.dumps({"truncated": text[:8000]})
