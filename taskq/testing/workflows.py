"""`InMemoryWorkflows`: workflows' node records in memory, moved on by the same `advance` as in Postgres."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from taskq._core.store import NodeRecord
from taskq._core.workflows import Ended, Node

#: A record staged in the in-memory outbox: topic, key, value, headers.
Staged = tuple[str, bytes | None, bytes, list[tuple[str, bytes]]]


@dataclass
class _Workflow:
    state: str = "running"
    cancelled: bool = False
    ended_at: float | None = None


@dataclass
class InMemoryWorkflows:
    """Every workflow of a namespace: its row, its nodes, and the records staged for the relay (`outbox`,
    drained by `taskq.testing.InMemoryQueue`). Stores of one namespace share one: `workflows=a.workflows`.
    Callers hold their store's lock."""

    workflows: dict[str, _Workflow] = field(default_factory=dict)
    nodes: dict[tuple[str, int], tuple[Node, NodeRecord, bool]] = field(default_factory=dict)
    outbox: list[Staged] = field(default_factory=list)

    def create(self, workflow_id: str, records: Sequence[NodeRecord]) -> None:
        """Write a new workflow's nodes, all waiting."""
        self.workflows[workflow_id] = _Workflow()
        for r in records:
            node = Node(
                workflow_id, r.node, r.last, r.parent, r.position, r.kind, r.on_failure, "waiting", None
            )
            self.nodes[(workflow_id, r.node)] = (node, r, False)

    def view(
        self, result: Callable[[str], tuple[str | None, Any, str | None]], now: Callable[[], float]
    ) -> MemoryNodes:
        """The `Nodes` that `advance` moves on; `result(key)` gives a key's (task id, result, last error),
        `now()` the time."""
        return MemoryNodes(self, result, now)

    def purge(self, cutoff: float) -> int:
        """Forget the workflows that ended before `cutoff`, with their nodes; how many."""
        gone = {w for w, wf in self.workflows.items() if wf.ended_at is not None and wf.ended_at < cutoff}
        for w in gone:
            del self.workflows[w]
        for ref in [r for r in self.nodes if r[0] in gone]:
            del self.nodes[ref]
        return len(gone)


class MemoryNodes:
    """`taskq._core.workflows.Nodes` over `InMemoryWorkflows` (and `workflow_inputs`' reads)."""

    def __init__(
        self,
        held: InMemoryWorkflows,
        result: Callable[[str], tuple[str | None, Any, str | None]],
        now: Callable[[], float],
    ) -> None:
        self.held = held
        self._result = result
        self._now = now

    def _set(self, node: Node, **changes: Any) -> Node:
        _, record, fired = self.held.nodes[node.ref]
        new = replace(node, **{k: v for k, v in changes.items() if k != "fired"})
        self.held.nodes[node.ref] = (new, record, changes.get("fired", fired))
        return new

    def _children(self, parent: Node) -> list[Node]:
        return [
            self.held.nodes[(parent.workflow_id, n)][0]
            for n in range(parent.node + 1, parent.last + 1)
            if self.held.nodes[(parent.workflow_id, n)][0].parent == parent.node
        ]

    def end(self, ended: Sequence[Ended]) -> list[Node]:
        """End the open ones of these nodes."""
        out = []
        for e in ended:
            held = self.held.nodes.get((e.workflow_id, e.node))
            if held is None:
                continue  # no such node (a header naming a workflow that is not there): as in Postgres
            node = held[0]
            if node.state in ("waiting", "running"):
                out.append(self._set(node, state=e.state, result_key=e.result_key))
        return out

    def get(self, refs: Iterable[tuple[str, int]]) -> dict[tuple[str, int], Node]:
        """Nodes by (workflow id, node)."""
        return {r: self.held.nodes[r][0] for r in refs if r in self.held.nodes}

    def child(self, parent: Node, position: int) -> Node | None:
        """The child of `parent` at `position`, or None."""
        return next((n for n in self._children(parent) if n.position == position), None)

    def group_may_be_done(self, group: Node, after: int) -> bool:
        """One transaction at a time here: always worth deciding."""
        return True

    def group_fire(self, group: Node) -> dict[str, int] | None:
        """None if a member is open or the group was decided; else mark it decided and count its members."""
        members = [n for n in self._children(group) if n.position >= 0]
        if self.held.nodes[group.ref][2] or any(n.state in ("waiting", "running") for n in members):
            return None
        self._set(group, fired=True)
        counts: dict[str, int] = {}
        for n in members:
            counts[n.state] = counts.get(n.state, 0) + 1
        return counts

    def start(self, refs: Sequence[tuple[str, int]]) -> list[Node]:
        """Start the waiting ones of these nodes."""
        return [
            self._set(node, state="running")
            for node in (self.held.nodes[r][0] for r in refs)
            if node.state == "waiting"
        ]

    def first_steps(self, started: Sequence[Node]) -> list[tuple[str, int]]:
        """A started chain's first step, a started group's members."""
        return [
            n.ref
            for s in started
            for n in self._children(s)
            if n.position == 0 or (s.kind == "group" and n.position > 0)
        ]

    def stage(self, tasks: Sequence[Node]) -> None:
        """Stage started tasks' records for the relay."""
        for node in tasks:
            r = self.held.nodes[node.ref][1]
            assert r.topic is not None and r.value is not None
            self.held.outbox.append((r.topic, r.key, r.value, list(r.headers or ())))

    def close(self, below: Node, state: str) -> None:
        """Close the waiting nodes below `below`."""
        for n in range(below.node + 1, below.last + 1):
            node = self.held.nodes[(below.workflow_id, n)][0]
            if node.state == "waiting":
                self._set(node, state=state)

    def cancelled(self, workflow_ids: Iterable[str]) -> set[str]:
        """Which of these workflows were cancelled."""
        return {w for w in workflow_ids if w in self.held.workflows and self.held.workflows[w].cancelled}

    def finish(self, workflow_id: str, state: str) -> None:
        """Mark a workflow done."""
        wf = self.held.workflows[workflow_id]
        if wf.state == "running":
            wf.state, wf.ended_at = state, self._now()

    def members(self, group: Node) -> list[dict[str, Any]]:
        """A group's members in order, with their results or errors."""
        out = []
        for n in sorted((n for n in self._children(group) if n.position >= 0), key=lambda n: n.position):
            task_id, result, error = self._result(n.result_key) if n.result_key else (None, None, None)
            done = n.state == "completed"
            out.append(
                {
                    "task_id": task_id,
                    "state": n.state,
                    "result": result if done else None,
                    "error": None if done else error,
                }
            )
        return out

    def result(self, idempotency_key: str) -> Any:
        """The result recorded for a key."""
        return self._result(idempotency_key)[1]
