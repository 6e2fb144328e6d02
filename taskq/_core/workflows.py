"""How a workflow moves on: the nodes of its tree (tasks, chains, groups), and `advance`, which ends nodes and
starts the next ones, in the transaction that records the end of the task that moved it.

A workflow is a tree numbered in preorder (a node's subtree is the nodes `node..last`). A chain starts its
first step and each next one when the one before completed; a group starts all its members and, once every
member has ended, its callback (position -1) or, without one, ends itself. `advance` runs over `Nodes`, the
node records of Postgres (`PostgresNodes`, in one transaction) or of `taskq.testing.InMemoryStore`.

Exactly once: a node ends only while it is open (a redelivered task ends nothing twice), and a group is
decided once (`fired`) by the one transaction that sees all its members ended. In Postgres no row is a
hotspot: members end on their own rows, and a transaction takes the group's row lock only when every open
member is being ended by a transaction in flight, i.e. at the group's very end (`wf_group_unlocked`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from taskq._core.db import Database, Row, Transaction

NodeKind = Literal["task", "chain", "group"]
NodeState = Literal["waiting", "running", "completed", "dead", "cancelled", "skipped"]


@dataclass(frozen=True, slots=True)
class Node:
    """A node of a workflow's tree, as its record says."""

    workflow_id: str
    node: int
    last: int
    parent: int | None
    position: int
    kind: str
    on_failure: str | None
    state: str
    result_key: str | None

    @property
    def ref(self) -> tuple[str, int]:
        """(workflow id, node)."""
        return self.workflow_id, self.node


@dataclass(frozen=True, slots=True)
class Ended:
    """A node's end to record: its state, and the idempotency key whose record holds its result."""

    workflow_id: str
    node: int
    state: str
    result_key: str | None = None


#: The states that end a workflow's step (a failed attempt that will be retried does not).
STEP_ENDS = frozenset({"completed", "dead", "cancelled"})


def step_ends(steps: Sequence[tuple[str, str, str]]) -> list[Ended]:
    """The node ends of (workflow header, idempotency key, state) steps whose state ends them; a step's
    result is its key's."""
    out = []
    for header, key, state in steps:
        if state in STEP_ENDS:
            workflow_id, node = parse_header(header)
            out.append(Ended(workflow_id, node, state, key))
    return out


def parse_header(value: bytes | str) -> tuple[str, int]:
    """(workflow id, node) of a task's workflow header; ValueError if it is not one."""
    text = value.decode() if isinstance(value, bytes) else value
    workflow_id, _, node = text.rpartition(":")
    if not workflow_id:
        raise ValueError(f"not a workflow header: {text!r}")
    return workflow_id, int(node)


class Nodes(Protocol):
    """The node records `advance` reads and writes, in one transaction."""

    def end(self, ended: Sequence[Ended]) -> list[Node]: ...
    def get(self, refs: Iterable[tuple[str, int]]) -> dict[tuple[str, int], Node]: ...
    def child(self, parent: Node, position: int) -> Node | None: ...
    def group_may_be_done(self, group: Node, after: int) -> bool: ...
    def group_fire(self, group: Node) -> dict[str, int] | None: ...
    def start(self, refs: Sequence[tuple[str, int]]) -> list[Node]: ...
    def first_steps(self, started: Sequence[Node]) -> list[tuple[str, int]]: ...
    def stage(self, tasks: Sequence[Node]) -> None: ...
    def close(self, below: Node, state: str) -> None: ...
    def cancelled(self, workflow_ids: Iterable[str]) -> set[str]: ...
    def finish(self, workflow_id: str, state: str) -> None: ...


def advance(nodes: Nodes, ended: Sequence[Ended] = (), start: Sequence[tuple[str, int]] = ()) -> None:
    """End `ended` and start `start`, then whatever follows from them, until nothing more moves."""
    to_end = list(ended)
    to_start = list(start)
    while to_end or to_start:
        if to_start:
            refs, to_start = to_start, []
            stopped = nodes.cancelled({wf for wf, _ in refs})
            if stopped:
                # A cancelled workflow starts nothing more: what would start ends cancelled, with its subtree.
                for row in nodes.get(r for r in refs if r[0] in stopped).values():
                    nodes.close(row, "cancelled")
                    to_end.append(Ended(row.workflow_id, row.node, "cancelled"))
                refs = [r for r in refs if r[0] not in stopped]
            while refs:
                started = nodes.start(refs)
                nodes.stage([n for n in started if n.kind == "task"])
                refs = nodes.first_steps([n for n in started if n.kind != "task"])
        if not to_end:
            continue
        done, to_end = nodes.end(to_end), []
        parents = nodes.get({(n.workflow_id, n.parent) for n in done if n.parent is not None})
        groups: dict[tuple[str, int], Node] = {}
        after: dict[tuple[str, int], int] = {}  # per group, the last of its members ended here
        for n in done:
            if n.parent is None:
                state = {"completed": "completed", "cancelled": "cancelled"}.get(n.state, "failed")
                nodes.finish(n.workflow_id, state)
                continue
            parent = parents[(n.workflow_id, n.parent)]
            if parent.kind == "chain":
                following = nodes.child(parent, n.position + 1) if n.state == "completed" else None
                if following is not None:
                    to_start.append(following.ref)
                    continue
                if n.state != "completed":
                    # The steps after one that did not complete never run (cancelled with it, or skipped).
                    nodes.close(parent, "cancelled" if n.state == "cancelled" else "skipped")
                to_end.append(Ended(n.workflow_id, parent.node, n.state, n.result_key))
            elif n.position == -1:  # a group's callback: its outcome is the group's
                to_end.append(Ended(n.workflow_id, parent.node, n.state, n.result_key))
            else:
                groups[parent.ref] = parent
                after[parent.ref] = max(after.get(parent.ref, 0), n.last)
        # In one order for every transaction: two deciding the same groups wait for each other in turn.
        for ref in sorted(groups):
            group = groups[ref]
            if not nodes.group_may_be_done(group, after[ref]):
                continue  # a member not being ended now will be, after this commits, and decide then
            states = nodes.group_fire(group)
            if states is None:
                continue  # members still open (their ends in flight decide it), or decided already
            cancelled = bool(nodes.cancelled([group.workflow_id]))
            run = set(states) == {"completed"} or group.on_failure == "run"
            callback = nodes.child(group, -1)
            if callback is None:
                state = "cancelled" if cancelled else "completed" if run else "dead"
                to_end.append(Ended(group.workflow_id, group.node, state))
            elif run and not cancelled:
                to_start.append(callback.ref)
            else:
                state = "cancelled" if cancelled else "skipped"
                nodes.close(callback, state)
                to_end.append(Ended(group.workflow_id, callback.node, state))


def _node(row: Row) -> Node:
    return Node(
        row["workflow_id"],
        int(row["node"]),
        int(row["last"]),
        row["parent"],
        int(row["position"]),
        row["kind"],
        row["on_failure"],
        row["state"],
        row["result_key"],
    )


class PostgresNodes:
    """The node records of one namespace in Postgres, in the transaction `tx` (or, to read only, on the
    database's kept connection)."""

    def __init__(self, tx: Transaction | Database, namespace: str) -> None:
        self.tx = tx
        self.namespace = namespace
        self._places: dict[tuple[str, int], Node] = {}  # parents of ended nodes, by (workflow id, node)

    def end(self, ended: Sequence[Ended]) -> list[Node]:
        """End the open ones of these nodes; returns those ended."""
        rows = self.tx.all(
            "wf_end",
            namespace=self.namespace,
            steps=[f"{e.workflow_id}:{e.node}" for e in ended],
            states=[e.state for e in ended],
            result_keys=[e.result_key for e in ended],
        )
        for r in rows:
            if r["parent_place"] is not None:
                node, last, parent, position, kind, on_failure = r["parent_place"]
                wf = r["workflow_id"]
                place = Node(wf, node, last, parent, position, kind, on_failure, "running", None)
                self._places[place.ref] = place
        return [_node(r) for r in rows]

    def get(self, refs: Iterable[tuple[str, int]]) -> dict[tuple[str, int], Node]:
        """Nodes by (workflow id, node); the parents of nodes `end` ended are known already (their place,
        not their state: `advance` reads only that of a parent)."""
        refs = list(refs)
        out = {r: self._places[r] for r in refs if r in self._places}
        steps = [f"{wf}:{n}" for wf, n in refs if (wf, n) not in out]
        if steps:
            rows = self.tx.all("wf_nodes", namespace=self.namespace, steps=steps)
            out.update({(r["workflow_id"], int(r["node"])): _node(r) for r in rows})
        return out

    def child(self, parent: Node, position: int) -> Node | None:
        """The child of `parent` at `position`, or None."""
        row = self.tx.one(
            "wf_child",
            namespace=self.namespace,
            workflow_id=parent.workflow_id,
            parent=parent.node,
            last=parent.last,
            position=position,
        )
        return None if row is None else _node(row)

    def group_may_be_done(self, group: Node, after: int) -> bool:
        """False if an open member is not being ended by a transaction in flight (share-locked, so that its
        ender sees this transaction's ends); looked for after node `after` first, then before it."""
        params = {"namespace": self.namespace, "workflow_id": group.workflow_id, "group": group.node}
        for start, end in ((after + 1, group.last), (group.node + 1, after)):
            if start <= end and self.tx.one("wf_group_unlocked", **params, **{"from": start, "to": end}):
                return False
        return True

    def group_fire(self, group: Node) -> dict[str, int] | None:
        """Under the group's row lock: None if a member is still open or the group was decided; else mark
        it decided and count its members by state."""
        params = {"namespace": self.namespace, "workflow_id": group.workflow_id, "group": group.node}
        lock = self.tx.one("wf_group_lock", **params)
        if lock is None or lock["fired"]:
            return None
        still = self.tx.one("wf_group_open", **params)
        if still is not None and int(still["n"]):
            return None
        return {r["state"]: int(r["n"]) for r in self.tx.all("wf_group_fire", **params)}

    def start(self, refs: Sequence[tuple[str, int]]) -> list[Node]:
        """Start the waiting ones of these nodes; returns those started."""
        rows = self.tx.all("wf_start", namespace=self.namespace, steps=[f"{wf}:{n}" for wf, n in refs])
        return [_node(r) for r in rows]

    def first_steps(self, started: Sequence[Node]) -> list[tuple[str, int]]:
        """What started chains (their first step) and groups (their members) start."""
        if not started:
            return []
        rows = self.tx.all(
            "wf_first_steps",
            namespace=self.namespace,
            workflow_ids=[n.workflow_id for n in started],
            nodes=[n.node for n in started],
            lasts=[n.last for n in started],
            groups=[n.kind == "group" for n in started],
        )
        return [(r["workflow_id"], int(r["node"])) for r in rows]

    def stage(self, tasks: Sequence[Node]) -> None:
        """Stage started tasks' records in the outbox."""
        if tasks:
            steps = [f"{n.workflow_id}:{n.node}" for n in tasks]
            self.tx.all("wf_stage", namespace=self.namespace, steps=steps)

    def close(self, below: Node, state: str) -> None:
        """Close the waiting nodes below `below` with `state`."""
        self.tx.execute(
            "wf_close",
            namespace=self.namespace,
            workflow_id=below.workflow_id,
            node=below.node,
            last=below.last,
            state=state,
        )

    def cancelled(self, workflow_ids: Iterable[str]) -> set[str]:
        """Which of these workflows were cancelled."""
        ids = list(workflow_ids)
        if not ids:
            return set()
        rows = self.tx.all("wf_cancelled", namespace=self.namespace, workflow_ids=ids)
        return {r["workflow_id"] for r in rows}

    def finish(self, workflow_id: str, state: str) -> None:
        """Mark a workflow done."""
        self.tx.execute("wf_finish", namespace=self.namespace, workflow_id=workflow_id, state=state)

    def members(self, group: Node) -> list[dict[str, Any]]:
        """A group's members in order: task id, state, result, error (a task's, or a chain's last step's)."""
        rows = self.tx.all(
            "wf_results", namespace=self.namespace, workflow_id=group.workflow_id, group=group.node
        )
        return [member_result(r) for r in rows]

    def result(self, idempotency_key: str) -> Any:
        """The result recorded for a key."""
        row = self.tx.one("get", namespace=self.namespace, key=idempotency_key)
        return None if row is None else row["result"]


def member_result(row: Any) -> dict[str, Any]:
    """What ctx.group_results says of one member: its task id, state, and result (completed) or error."""
    state = row["state"]
    return {
        "task_id": row["task_id"],
        "state": state,
        "result": row["result"] if state == "completed" else None,
        "error": None if state == "completed" else row["last_error"],
    }


def workflow_inputs(nodes: Any, workflow_id: str, node: int) -> tuple[Any, list[dict[str, Any]] | None]:
    """(parent_result, group_results) of a workflow's task: what the step before it gave (a task's or a
    chain's result; a group's per-member results), or, for a group's callback, its group's members.

    `nodes` answers `get`, `child`, `result(key)` and `members(group)`.
    """
    here = nodes.get([(workflow_id, node)]).get((workflow_id, node))
    while here is not None and here.parent is not None:
        parent = nodes.get([(workflow_id, here.parent)])[(workflow_id, here.parent)]
        if here.position == -1:
            return None, nodes.members(parent)
        if parent.kind == "chain" and here.position > 0:
            before = nodes.child(parent, here.position - 1)
            if before is None:
                return None, None
            if before.kind == "group" and nodes.child(before, -1) is None:
                return None, nodes.members(before)
            return (nodes.result(before.result_key) if before.result_key else None), None
        here = parent  # a chain's first step or a group's member: what came before its parent
    return None, None
