"""The records taskq keeps in Postgres: one method per named query of sql/queries.sql, with typed values."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from psycopg import sql

from taskq._core.db import Connection, Database, Row, Transaction, queries
from taskq._core.envelope import PRIORITIES
from taskq._core.errors import ConfigurationError, ResultError, StoreUnavailableError

ClaimOutcome = Literal["claimed", "completed", "dead", "cancelled", "running", "duplicate"]
#: What an operator pauses: a tier (its partitions) or a task type (its tasks, held in the buffer).
PauseKind = Literal["tier", "task_type"]


def pause_target(kind: str, name: str) -> tuple[PauseKind, str]:
    """A pause's kind and name, checked: a known tier, or a task type's full record name."""
    name = name.strip()
    if kind == "tier":
        if name not in PRIORITIES:
            raise ConfigurationError(f"tier must be one of {', '.join(PRIORITIES)}, got {name!r}")
        return "tier", name
    if kind == "task_type":
        if not 0 < len(name) <= 300:
            raise ConfigurationError("task type must be its record's full name (1 to 300 characters)")
        return "task_type", name
    raise ConfigurationError(f"pause kind must be tier or task_type, got {kind!r}")


@dataclass(slots=True, unsafe_hash=True)
class ClaimRequest:
    """A task asking to run: its idempotency key and how long its lease must last."""

    idempotency_key: str
    task_id: str
    task_type: str
    lease_seconds: float


@dataclass(slots=True, unsafe_hash=True)
class Claim:
    """The store's answer: run it (claimed, with its attempt number), skip it (completed, or dead-lettered
    already as this very task), or hold it.

    `takeovers`: claims of the key taken over from workers that died, whether their runs had started or were
    claimed ahead (not counted in `attempts`); `interruptions`: those of runs marked started.
    """

    idempotency_key: str
    outcome: ClaimOutcome
    attempts: int
    lease_left: float = 0.0
    interruptions: int = 0
    takeovers: int = 0


@dataclass(frozen=True, slots=True)
class SlotRequest:
    """A task of a type with `concurrency_limit` asking for one of its key's slots before it starts."""

    idempotency_key: str
    task_type: str
    key: str
    limit: int
    lease_seconds: float


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """A worker's liveness record: who it is and where it runs (its heartbeat and load are written apart)."""

    worker_id: str
    namespace: str
    group: str
    host: str
    pid: int
    concurrency: int
    started_at: datetime


@dataclass(frozen=True, slots=True)
class Pauses:
    """What operators paused in a namespace: tiers (by priority) and task types."""

    tiers: frozenset[str] = frozenset()
    task_types: frozenset[str] = frozenset()


@dataclass(slots=True, unsafe_hash=True)
class Finished:
    """An attempt's end, to record: completed (with its result, a JSON value checked against the worker's
    limit) or failed/dead (with its error; a dead one with the (partition, offset) of its DLQ record)."""

    idempotency_key: str
    attempts: int
    state: Literal["completed", "failed", "dead"]
    result: Any = None
    error: str = ""
    dlq: tuple[int, int] | None = None
    #: The task's workflow header (`<workflow id>:<node>`) if it is a step of a workflow.
    workflow: str | None = None


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """A node of a new workflow's tree, as it is written: its place, and for a task its encoded record."""

    node: int
    last: int
    parent: int | None
    position: int
    kind: str
    on_failure: str | None = None
    task_id: str | None = None
    idempotency_key: str | None = None
    task_type: str | None = None
    topic: str | None = None
    key: bytes | None = None
    value: bytes | None = None
    headers: Sequence[tuple[str, bytes]] | None = None


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """A task staged in the outbox, exactly as it is to be published, and how long it has waited."""

    id: int
    topic: str
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]]
    age: float


#: A record to stage: topic, key, value, headers.
OutboxRecord = tuple[str, bytes | None, bytes, Sequence[tuple[str, bytes]]]


def outbox_stage(
    schema: str, namespace: str, records: Sequence[OutboxRecord]
) -> tuple[sql.Composed, dict[str, Any]]:
    """The statement and parameters staging (topic, key, value, headers) records in the outbox, for the
    application's own connection (sync or async), whose search_path is not the project's."""
    statement = sql.SQL(queries()["outbox_stage"]).format(schema=sql.Identifier(schema))
    return statement, {
        "namespace": namespace,
        "topics": [topic for topic, _, _, _ in records],
        "keys": [key for _, key, _, _ in records],
        "values": [value for _, _, value, _ in records],
        "headers": [json.dumps([[k, v.hex()] for k, v in headers]) for _, _, _, headers in records],
    }


class Store:
    """Every named query of sql/queries.sql, one method each: the only code that names a query.

    Idempotency records belong to a namespace (namespaces may share a database): each of their methods
    takes the namespace first and reads or writes that namespace's records only. Claims, completions and
    failures outside a transaction, the worker's round trips, go through libpq (`Database.round_trip`).
    """

    def __init__(self, database: Database) -> None:
        self.database = database

    # ------------------------------------------------------------------------------- idempotency records
    def claim(
        self, namespace: str, owner: str, requests: Sequence[ClaimRequest], *, stale_after: float
    ) -> list[Claim]:
        """Claim each key (unique in `requests`) for one attempt, leased to `owner`; answers in order.

        Keys leased by a worker whose heartbeat is older than `stale_after` seconds, or that was marked
        dead, are taken over.
        """
        [rows] = self.database.round_trip(("claim", _claim_params(namespace, owner, requests, stale_after)))
        return _claims(requests, rows)

    def finish_and_claim(
        self,
        namespace: str,
        owner: str,
        done: Sequence[Finished],
        failed: Sequence[Finished],
        requests: Sequence[ClaimRequest],
        *,
        stale_after: float,
    ) -> tuple[set[str], set[str], list[Claim]]:
        """`complete(done)`, `fail(failed)` and `claim(requests)` (keys unique) in one round trip and one
        transaction, any of them empty: (the keys completed, the keys failed, the claims in order). The
        recorder's round trip of every loop pass: sent through libpq (`Database.round_trip`)."""
        named: list[tuple[str, dict[str, object]]] = []
        if done:
            named.append(("complete", _complete_params(namespace, owner, done)))
        if failed:
            named.append(("fail", _fail_params(namespace, owner, failed)))
        if requests:
            named.append(("claim", _claim_params(namespace, owner, requests, stale_after)))
        answers = iter(self.database.round_trip(*named) if named else [])
        completed = _recorded(done, next(answers)) if done else set()
        recorded = {r["idempotency_key"] for r in next(answers)} if failed else set()
        return completed, recorded, _claims(requests, next(answers)) if requests else []

    def complete(
        self, namespace: str, owner: str, done: Sequence[Finished], *, tx: Transaction | None = None
    ) -> set[str]:
        """Record completions held by `owner`'s lease, in `tx` if given; returns the keys recorded."""
        params = _complete_params(namespace, owner, done)
        [rows] = [tx.all("complete", **params)] if tx else self.database.round_trip(("complete", params))
        return _recorded(done, rows)

    def send_complete(
        self, namespace: str, owner: str, done: Sequence[Finished], *, tx: Transaction
    ) -> Callable[[], set[str]]:
        """Send completions in `tx`, whose connection is in pipeline mode; once the pipeline has synced,
        the returned call gives the keys recorded (those held by `owner`'s lease)."""
        cursor = tx.send("complete", **_complete_params(namespace, owner, done))
        return lambda: _recorded(done, cursor.fetchall())

    def fail(self, namespace: str, owner: str, failed: Sequence[Finished]) -> set[str]:
        """Record failed or dead attempts held by `owner`'s lease; returns the keys recorded."""
        return set(self.fail_states(namespace, owner, failed))

    def fail_states(
        self, namespace: str, owner: str, failed: Sequence[Finished], *, tx: Transaction | None = None
    ) -> dict[str, str]:
        """Record failed or dead attempts held by `owner`'s lease, in `tx` if given; returns the keys
        recorded with the state each now has (a failed attempt of a task asked to stop is cancelled)."""
        params = _fail_params(namespace, owner, failed)
        [rows] = [tx.all("fail", **params)] if tx else self.database.round_trip(("fail", params))
        return {r["idempotency_key"]: r["state"] for r in rows}

    def cancel(self, namespace: str, idempotency_key: str, task_id: str = "") -> tuple[str, int, bool]:
        """Cancel a key (see the query): (its state before, or "unknown" if it had no record; its attempts;
        whether a worker held its lease)."""
        for _ in range(3):
            row = self.database.one("cancel", namespace=namespace, key=idempotency_key, task_id=task_id)
            if row is not None:
                return str(row["state"]), int(row["attempts"]), row["lease_owner"] is not None
        # A claim inserted the key after the statement's snapshot each time: a claim loop this tight is
        # not what happens; say so rather than spin.
        raise StoreUnavailableError(f"could not cancel {idempotency_key!r}: its record kept changing")

    def cancel_requested(self, namespace: str, idempotency_keys: Sequence[str]) -> set[str]:
        """Which of these keys were asked to stop."""
        rows = self.database.all("cancel_requested", namespace=namespace, keys=list(idempotency_keys))
        return {r["idempotency_key"] for r in rows}

    def release(self, namespace: str, owner: str, claims: Sequence[tuple[str, int]]) -> set[str]:
        """Give back (key, attempt) claims whose attempts never started; returns the keys released."""
        rows = self.database.all(
            "release",
            namespace=namespace,
            keys=[k for k, _ in claims],
            attempts=[a for _, a in claims],
            owner=owner,
        )
        return {r["idempotency_key"] for r in rows}

    def renew(self, namespace: str, owner: str, leases: Sequence[tuple[str, int, float]]) -> set[str]:
        """Extend (key, attempt, seconds from now) leases held by `owner`; returns the keys renewed."""
        rows = self.database.all(
            "renew",
            namespace=namespace,
            keys=[k for k, _, _ in leases],
            attempts=[a for _, a, _ in leases],
            leases=[s for _, _, s in leases],
            owner=owner,
        )
        return {r["idempotency_key"] for r in rows}

    def mark_started(self, namespace: str, owner: str, runs: Sequence[tuple[str, int]]) -> set[str]:
        """Mark started the (key, attempt) runs held by `owner`; returns the keys marked."""
        rows = self.database.all(
            "mark_started",
            namespace=namespace,
            keys=[k for k, _ in runs],
            attempts=[a for _, a in runs],
            owner=owner,
        )
        return {r["idempotency_key"] for r in rows}

    def get(self, namespace: str, idempotency_key: str) -> Row | None:
        """The record of one key (its columns), or None."""
        return self.database.one("get", namespace=namespace, key=idempotency_key)

    def reset_for_replay(self, namespace: str, idempotency_key: str) -> bool:
        """Start a dead key's attempts over (DLQ replay); False if it is not dead (e.g. completed)."""
        return self.database.one("reset_for_replay", namespace=namespace, key=idempotency_key) is not None

    def purge(self, namespace: str, ttl_seconds: float, *, batch: int, keep: Sequence[str] = ()) -> int:
        """Delete up to `batch` completed and dead records older than the TTL, except the keys in `keep`;
        returns how many."""
        return max(
            0,
            self.database.execute(
                "purge", namespace=namespace, ttl_seconds=ttl_seconds, batch=batch, keep=list(keep)
            ),
        )

    def purge_idle(self, namespace: str) -> tuple[int, int]:
        """Delete full shared token buckets and the namespace's expired concurrency slots: (buckets,
        slots)."""
        (row,) = self.database.all("purge_idle", namespace=namespace)
        return int(row["buckets"]), int(row["slots"])

    def counts(self, namespace: str) -> dict[str, int]:
        """Number of records per state."""
        return {r["state"]: int(r["n"]) for r in self.database.all("counts", namespace=namespace)}

    def retries(self, namespace: str) -> tuple[int, int]:
        """(tasks that needed more than one attempt, attempts beyond the first), over all workers."""
        (row,) = self.database.all("retries", namespace=namespace)
        return int(row["tasks"]), int(row["retries"])

    # --------------------------------------------------------------------------------- liveness records
    def worker_beat(self, worker: WorkerRecord, in_flight: int, *, stale_after: float) -> None:
        """Write a worker's liveness record: alive now, with `in_flight` tasks running; a beat more than
        `stale_after` seconds after the last one starts its unbroken beating anew (`beating_since`)."""
        self.database.execute(
            "worker_beat",
            stale_after=stale_after,
            worker_id=worker.worker_id,
            namespace=worker.namespace,
            group=worker.group,
            host=worker.host,
            pid=worker.pid,
            concurrency=worker.concurrency,
            in_flight=in_flight,
            started_at=worker.started_at,
        )

    def worker_leave(self, worker_id: str) -> None:
        """Remove a worker's liveness record (a clean stop)."""
        self.database.execute("worker_leave", worker_id=worker_id)

    def workers_on_host(self, worker: WorkerRecord) -> list[tuple[str, int]]:
        """(worker id, pid) of the other workers of `worker`'s host started before it, not marked dead."""
        rows = self.database.all(
            "workers_on_host", host=worker.host, worker_id=worker.worker_id, started_at=worker.started_at
        )
        return [(r["worker_id"], int(r["pid"])) for r in rows]

    def workers_mark_dead(self, worker_ids: Sequence[str]) -> set[str]:
        """Mark workers dead, so their keys are taken over at once; returns those marked now."""
        rows = self.database.all("workers_mark_dead", worker_ids=list(worker_ids))
        return {r["worker_id"] for r in rows}

    def workers_prune(self, older_than: float) -> int:
        """Delete the liveness records silent for more than `older_than` seconds; how many."""
        return max(0, self.database.execute("workers_prune", older_than=older_than))

    def workers_alive(self, namespace: str, stale_after: float) -> list[Row]:
        """The liveness records of a namespace's workers that beat within `stale_after` seconds."""
        return self.database.all("workers_alive", namespace=namespace, stale_after=stale_after)

    # ---------------------------------------------------------------------------------------- workflows
    def workflow_create(
        self, tx: Transaction, namespace: str, workflow_id: str, nodes: Sequence[NodeRecord]
    ) -> None:
        """Write a new workflow and its nodes in `tx` (its first tasks are started by `advance`)."""
        tx.execute("wf_create", namespace=namespace, workflow_id=workflow_id)
        tx.execute(
            "wf_insert_nodes",
            namespace=namespace,
            workflow_id=workflow_id,
            nodes=[n.node for n in nodes],
            lasts=[n.last for n in nodes],
            parents=[n.parent for n in nodes],
            positions=[n.position for n in nodes],
            kinds=[n.kind for n in nodes],
            on_failures=[n.on_failure for n in nodes],
            task_ids=[n.task_id for n in nodes],
            keys=[n.idempotency_key for n in nodes],
            task_types=[n.task_type for n in nodes],
            topics=[n.topic for n in nodes],
            record_keys=[n.key for n in nodes],
            values=[n.value for n in nodes],
            headers=[
                None if n.headers is None else json.dumps([[k, v.hex()] for k, v in n.headers]) for n in nodes
            ],
        )

    def workflow_purge(self, namespace: str, ttl_seconds: float, *, batch: int) -> int:
        """Delete up to `batch` workflows that ended over `ttl_seconds` ago, with their nodes; how many."""
        row = self.database.one("wf_purge", namespace=namespace, ttl_seconds=ttl_seconds, batch=batch)
        return 0 if row is None else int(row["workflows"])

    def workflow_get(self, namespace: str, workflow_id: str) -> tuple[Row | None, dict[str, int]]:
        """A workflow's row (or None) and its tasks counted by state."""
        row = self.database.one("wf_get", namespace=namespace, workflow_id=workflow_id)
        rows = self.database.all("wf_counts", namespace=namespace, workflow_id=workflow_id)
        return row, {r["state"]: int(r["n"]) for r in rows}

    def workflow_tree(self, namespace: str, workflow_id: str, limit: int) -> list[Row]:
        """A workflow's first `limit` nodes in preorder."""
        return self.database.all("wf_tree", namespace=namespace, workflow_id=workflow_id, limit=limit)

    def workflow_cancel(self, tx: Transaction, namespace: str, workflow_id: str) -> tuple[int, int]:
        """Cancel a workflow in `tx`: its waiting steps never start, its staged ones are cancelled as
        `cancel` would. Returns (staged tasks, of which not started)."""
        staged = tx.all("wf_cancel", namespace=namespace, workflow_id=workflow_id)
        if not staged:
            return 0, 0
        not_started = tx.all(
            "cancel_many",
            namespace=namespace,
            keys=[r["idempotency_key"] for r in staged],
            task_ids=[r["task_id"] for r in staged],
        )
        return len(staged), len(not_started)

    # ------------------------------------------------------------------------------------------ lookups
    def task_by_id(self, namespace: str, task_id: str) -> Row | None:
        """The record of the task with this id (its columns), or None."""
        return self.database.one("task_by_id", namespace=namespace, task_id=task_id)

    def completed_since(self, namespace: str, seconds: float) -> int:
        """How many tasks of a namespace completed in the last `seconds` seconds."""
        row = self.database.one("completed_since", namespace=namespace, seconds=seconds)
        return int(row["n"]) if row is not None else 0

    # ------------------------------------------------------------------------------------------- pauses
    def pause(self, namespace: str, kind: PauseKind, name: str) -> bool:
        """Pause a tier or a task type; False if it was paused already."""
        return self.database.one("pause", namespace=namespace, kind=kind, name=name) is not None

    def resume(self, namespace: str, kind: PauseKind, name: str) -> bool:
        """Resume a tier or a task type; False if it was not paused."""
        return self.database.one("resume", namespace=namespace, kind=kind, name=name) is not None

    def pauses(self, namespace: str) -> list[tuple[PauseKind, str, datetime]]:
        """What is paused in a namespace: (kind, name, paused at)."""
        rows = self.database.all("pauses", namespace=namespace)
        return [(r["kind"], r["name"], r["paused_at"]) for r in rows]

    # ------------------------------------------------------------------------------------- rate limits
    def take_tokens(
        self, bucket: str, *, rate: float, capacity: float, want: float
    ) -> tuple[float, float, float]:
        """Refill a shared bucket and take up to `want` whole tokens: (granted, tokens left, seconds the
        bucket is still paused)."""
        (row,) = self.database.all("take_tokens", name=bucket, rate=rate, capacity=capacity, want=want)
        return float(row["granted"]), float(row["tokens"]), float(row["paused"])

    def pause_tokens(self, bucket: str, *, rate: float, capacity: float, seconds: float) -> None:
        """Empty a shared bucket and grant nothing from it for `seconds`, for every process."""
        self.database.execute("pause_tokens", name=bucket, rate=rate, capacity=capacity, seconds=seconds)

    # ------------------------------------------------------------------------------- concurrency slots
    def acquire_slots(
        self,
        namespace: str,
        owner: str,
        requests: Sequence[SlotRequest],
        *,
        stale_after: float,
        conn: Connection | None = None,
    ) -> set[str]:
        """Take a slot for each request (unique keys) whose concurrency key has room, earlier requests of a
        key first, in one transaction (on `conn` if given, kept by the caller); returns the idempotency keys
        granted."""
        params = {
            "namespace": namespace,
            "task_types": [r.task_type for r in requests],
            "slot_keys": [r.key for r in requests],
        }
        with self.database.transaction(conn) as tx:
            tx.all("slots_lock", **params)
            rows = tx.all(
                "slots_acquire",
                **params,
                keys=[r.idempotency_key for r in requests],
                limits=[r.limit for r in requests],
                leases=[r.lease_seconds for r in requests],
                owner=owner,
                stale_after=stale_after,
            )
        return {r["idempotency_key"] for r in rows}

    def release_slots(self, namespace: str, owner: str, keys: Sequence[str]) -> None:
        """Give back `owner`'s slots of these idempotency keys."""
        self.database.execute("slots_release", namespace=namespace, owner=owner, keys=list(keys))

    # ------------------------------------------------------------------------------------- DLQ replays
    def dlq_replayed(self, topic: str) -> dict[int, tuple[datetime, int]]:
        """{DLQ offset: (last replayed at, number of replays)} of the replayed records of a DLQ topic."""
        rows = self.database.all("dlq_replayed", topic=topic)
        return {int(r["dlq_offset"]): (r["replayed_at"], int(r["replays"])) for r in rows}

    def dlq_replayed_between(self, topic: str, start: int, end: int) -> int:
        """How many records of the DLQ offsets [start, end) were replayed."""
        (row,) = self.database.all("dlq_replayed_between", topic=topic, start=start, end=end)
        return int(row["n"])

    def dlq_record_replay(
        self, tx: Transaction, *, topic: str, offset: int, task_id: str, idempotency_key: str, force: bool
    ) -> int | None:
        """Mark a DLQ record replayed in `tx`: its count of replays, or None if replayed before (unforced)."""
        row = tx.one(
            "dlq_record_replay", topic=topic, offset=offset, task_id=task_id, key=idempotency_key, force=force
        )
        return None if row is None else int(row["replays"])

    # -------------------------------------------------------------------------------- transactional outbox
    def outbox_claim(self, tx: Transaction, namespace: str, limit: int) -> list[OutboxRow]:
        """Lock the oldest staged rows of a namespace that no other relay holds, up to `limit`."""
        return [
            OutboxRow(
                r["id"],
                r["topic"],
                None if r["key"] is None else bytes(r["key"]),
                bytes(r["value"]),
                [(k, bytes.fromhex(v)) for k, v in r["headers"]],
                float(r["age"]),
            )
            for r in tx.all("outbox_claim", namespace=namespace, limit=limit)
        ]

    def outbox_delete(self, tx: Transaction, ids: Sequence[int]) -> None:
        """Delete published rows, in the transaction that claimed them."""
        tx.execute("outbox_delete", ids=list(ids))

    def outbox_backlog(self, namespace: str) -> tuple[int, float]:
        """(rows waiting, seconds the oldest has waited) in a namespace's outbox."""
        row = self.database.one("outbox_backlog", namespace=namespace)
        return (int(row["n"]), float(row["oldest"])) if row is not None else (0, 0.0)


    # ------------------------------------------------------------------------------------- periodic tasks
    def periodic_lock(self, tx: Transaction, namespace: str, name: str) -> tuple[bool, datetime | None]:
        """Lock a periodic task's row in `tx` (creating it): (False, None) if another scheduler holds it,
        else (True, the last slot staged, or None if none ever was)."""
        tx.execute("periodic_ensure", namespace=namespace, name=name)
        row = tx.one("periodic_lock", namespace=namespace, name=name)
        return (False, None) if row is None else (True, row["last_slot"])

    def periodic_advance(
        self, tx: Transaction, namespace: str, name: str, slot: datetime, schedule: str, catch_up: str
    ) -> None:
        """Record `slot` as the last one staged, in the transaction that staged it."""
        tx.execute(
            "periodic_advance",
            namespace=namespace,
            name=name,
            slot=slot,
            schedule=schedule,
            catch_up=catch_up,
        )

    def periodic_list(self, namespace: str) -> list[Row]:
        """Every periodic task of a namespace a scheduler has seen: name, schedule, catch_up, last_slot."""
        return self.database.all("periodic_list", namespace=namespace)


def _claim_params(
    namespace: str, owner: str, requests: Sequence[ClaimRequest], stale_after: float
) -> dict[str, object]:
    return {
        "namespace": namespace,
        "stale_after": stale_after,
        "keys": [r.idempotency_key for r in requests],
        "task_ids": [r.task_id for r in requests],
        "task_types": [r.task_type for r in requests],
        "leases": [r.lease_seconds for r in requests],
        "owner": owner,
    }


def _claims(requests: Sequence[ClaimRequest], rows: Sequence[Row]) -> list[Claim]:
    """The answers to `requests`, in order, from the rows of `claim` (the keys that were not new)."""
    by_key = {row["idempotency_key"]: row for row in rows}
    out: list[Claim] = []
    for r in requests:
        row = by_key.get(r.idempotency_key)
        if row is None:  # a new key: claimed, its first attempt
            out.append(Claim(r.idempotency_key, "claimed", 1))
            continue
        outcome = row["outcome"]
        if outcome not in ("claimed", "completed", "dead", "cancelled"):
            outcome = "running"  # leased by a live worker (or this one, for a redelivered copy)
        out.append(
            Claim(
                r.idempotency_key,
                outcome,
                int(row["attempts"] or 0),
                float(row["lease_left"] or 0.0),
                int(row["interruptions"] or 0),
                int(row["takeovers"] or 0),
            )
        )
    return out


def _fail_params(namespace: str, owner: str, failed: Sequence[Finished]) -> dict[str, object]:
    return {
        "namespace": namespace,
        "keys": [f.idempotency_key for f in failed],
        "attempts": [f.attempts for f in failed],
        "states": [f.state for f in failed],
        "errors": [f.error[:4000] for f in failed],
        "dlq_partitions": [None if f.dlq is None else f.dlq[0] for f in failed],
        "dlq_offsets": [None if f.dlq is None else f.dlq[1] for f in failed],
        "owner": owner,
    }


def _complete_params(namespace: str, owner: str, done: Sequence[Finished]) -> dict[str, object]:
    return {
        "namespace": namespace,
        "keys": [f.idempotency_key for f in done],
        "attempts": [f.attempts for f in done],
        "results": [_result_json(f.result) for f in done],
        "owner": owner,
    }


def _recorded(done: Sequence[Finished], lost: Sequence[Row]) -> set[str]:
    """The keys of `done` recorded, from the rows of `complete` (the keys not recorded)."""
    recorded = {f.idempotency_key for f in done}
    recorded.difference_update(r["idempotency_key"] for r in lost)
    return recorded


def _result_json(result: Any) -> str | None:
    # The worker checked the result (encode_result): JSON within its size limit, never cut short here.
    return None if result is None else encode_result(result)


#: The largest result a worker stores by default (bytes of its JSON): WorkerConfig.result_max_bytes.
RESULT_MAX_BYTES = 64 * 1024


def encode_result(result: Any, limit: int | None = None) -> str:
    """A handler's return value as the JSON text stored as its result; ResultError if it is not JSON (a
    NaN included: Postgres refuses it) or its JSON is over `limit` bytes."""
    try:
        text = json.dumps(result, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise ResultError(f"the handler's return value is not JSON-serialisable: {exc}") from None
    if limit is not None and len(text) > limit:  # ASCII: json.dumps escapes the rest
        raise ResultError(
            f"the handler's result is {len(text)} bytes of JSON, over the limit of {limit} "
            "(WorkerConfig.result_max_bytes)"
        )
    return text
