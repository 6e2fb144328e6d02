"""Workflows declared with `TaskSpec`s: `chain` (each step when the one before completed) and `group` (all at
once, then a callback when every member has ended), nested freely; what `enqueue_workflow` writes, and
`WorkflowReceipt`, which asks what became of one.

A workflow's tasks are validated and encoded when it is enqueued (an invalid one means nothing is), kept in
Postgres, and each is staged in the outbox in the transaction that records the end of the step that makes
it due (see `taskq._core.workflows`).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from taskq._core.envelope import WORKFLOW_HEADER
from taskq._core.errors import InvalidTaskError
from taskq._core.store import NodeRecord
from taskq.producer.tasks import TaskSpec

__all__ = ["Chain", "Group", "WorkflowReceipt", "WorkflowStatus", "chain", "group"]

OnFailure = Literal["run", "skip"]


@dataclass(frozen=True, slots=True)
class Chain:
    """Steps run one after another: each starts when the one before completed, and gets its result as
    `ctx.parent_result` (a group's, without a callback: `ctx.group_results`). A step that does not complete
    (dead, cancelled, skipped) ends the chain so, and the steps after it never run."""

    steps: tuple[Step, ...]


@dataclass(frozen=True, slots=True)
class Group:
    """Members run at once; once every member has ended, the callback `then` runs once with
    `ctx.group_results` (per member: task id, state, result or error). With a member not completed,
    `on_failure` decides: "run" the callback anyway (the default), or "skip" it (the group ends skipped)."""

    members: tuple[Step, ...]
    then: Step | None = None
    on_failure: OnFailure = "run"


Step = TaskSpec | Chain | Group


def chain(*steps: Step) -> Chain:
    """A chain of steps (TaskSpecs, chains, groups), run one after another."""
    if not steps:
        raise InvalidTaskError("a chain needs at least one step")
    _check(steps)
    return Chain(tuple(steps))


def group(*members: Step, then: Step | None = None, on_failure: OnFailure = "run") -> Group:
    """A group of steps run at once, and `then`, a step run once when every member has ended."""
    if not members:
        raise InvalidTaskError("a group needs at least one member")
    if on_failure not in ("run", "skip"):
        raise InvalidTaskError(f"on_failure must be 'run' or 'skip', got {on_failure!r}")
    _check((*members, *(() if then is None else (then,))))
    return Group(tuple(members), then, on_failure)


def _check(steps: Sequence[Any]) -> None:
    for step in steps:
        if not isinstance(step, TaskSpec | Chain | Group):
            raise InvalidTaskError(f"a workflow's steps are TaskSpecs, chains and groups, got {step!r:.80}")


@dataclass(slots=True)
class _Flat:
    """A workflow's tree in preorder: its nodes (tasks without their records yet) and its TaskSpecs."""

    nodes: list[NodeRecord] = field(default_factory=list)
    specs: list[tuple[int, TaskSpec]] = field(default_factory=list)


def flatten(workflow_id: str, root: Step) -> tuple[list[NodeRecord], list[tuple[int, TaskSpec]]]:
    """The nodes of a workflow's tree in preorder, and each task node's TaskSpec, given the workflow header
    and, unless it has one, an idempotency key of its own (`<workflow id>:<node>`): two steps of one
    workflow with the same payload are two tasks."""
    flat = _Flat()

    def visit(step: Step, parent: int | None, position: int) -> None:
        node = len(flat.nodes)
        flat.nodes.append(NodeRecord(node, node, parent, position, "task"))  # `last` set below
        if isinstance(step, TaskSpec):
            spec = replace(
                step,
                idempotency_key=step.idempotency_key or f"{workflow_id}:{node}",
                extra_headers=(*step.extra_headers, (WORKFLOW_HEADER, f"{workflow_id}:{node}".encode())),
            )
            flat.specs.append((node, spec))
        elif isinstance(step, Chain):
            for i, s in enumerate(step.steps):
                visit(s, node, i)
        else:
            for i, s in enumerate(step.members):
                visit(s, node, i)
            if step.then is not None:
                visit(step.then, node, -1)
        kind = "task" if isinstance(step, TaskSpec) else "chain" if isinstance(step, Chain) else "group"
        on_failure = step.on_failure if isinstance(step, Group) else None
        flat.nodes[node] = NodeRecord(node, len(flat.nodes) - 1, parent, position, kind, on_failure)

    visit(root, None, 0)
    return flat.nodes, flat.specs


def new_workflow_id() -> str:
    """A new workflow's id."""
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class WorkflowStatus:
    """What became of a workflow: its state, whether it is done, and its tasks counted by state (waiting,
    running, completed, dead, cancelled, skipped)."""

    workflow_id: str
    #: unknown (no such workflow), running, completed (its last step completed), failed, or cancelled.
    state: str
    counts: dict[str, int]
    cancelled: bool = False

    @property
    def done(self) -> bool:
        """Whether the workflow has ended: nothing more of it will run."""
        return self.state in ("completed", "failed", "cancelled")


@dataclass(frozen=True, slots=True)
class WorkflowReceipt:
    """What enqueue_workflow() accepted: the workflow's id, and the producer to ask what became of it."""

    workflow_id: str
    producer: Any = field(default=None, repr=False, compare=False)

    def status(self) -> WorkflowStatus:
        """The workflow's status (TaskProducer.workflow_status)."""
        status: WorkflowStatus = self.producer.workflow_status(self.workflow_id)
        return status

    def cancel(self) -> int:
        """Cancel the workflow (TaskProducer.cancel_workflow); how many of its tasks never start."""
        stopped: int = self.producer.cancel_workflow(self.workflow_id)
        return stopped
