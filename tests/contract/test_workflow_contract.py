"""How workflows move on, the same for InMemoryStore and Postgres: each step staged once, in the transaction
that records the end of the step before it."""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

from taskq import TaskSpec, chain, group
from taskq._core.envelope import WORKFLOW_HEADER
from taskq._core.errors import StoreUnavailableError
from taskq.consumer.store import ClaimRequest, Finished
from taskq.producer.workflows import Step, flatten, new_workflow_id


def create(records: Any, root: Step) -> tuple[str, dict[str, str]]:
    """Write a workflow whose tasks' records are stand-ins; (its id, {task name: workflow header})."""
    workflow_id = new_workflow_id()
    nodes, specs = flatten(workflow_id, root)
    names = {}
    for node, spec in specs:
        header = dict(spec.extra_headers)[WORKFLOW_HEADER]
        names[spec.payload["name"]] = header.decode()
        nodes[node] = replace(
            nodes[node],
            task_id=f"id-{spec.payload['name']}",
            idempotency_key=spec.idempotency_key,
            task_type="contract.Step",
            topic="contract.normal",
            value=spec.payload["name"].encode(),
            headers=list(spec.extra_headers),
        )
    records.workflow_create(workflow_id, nodes)
    return workflow_id, names


def t(name: str) -> TaskSpec:
    return TaskSpec(task_type="contract.Step", payload={"name": name})


def run(store: Any, header: str, *, state: str = "completed", result: Any = None) -> None:
    """Claim a step by its header's key and record its end."""
    key = header  # a workflow's task without a key of its own gets `<workflow id>:<node>`
    (claim,) = store.claim([ClaimRequest(key, f"id-{key}", "contract.Step", 30.0)])
    assert claim.outcome == "claimed", claim
    ended = Finished(key, claim.attempts, state, result=result, error="boom", workflow=header)  # type: ignore[arg-type]
    assert store.finish([ended]) == set()


def test_a_chain_around_a_group_stages_each_step_once_when_the_steps_before_it_ended(
    stores: tuple[Any, Any], records: Any, staged: Any
) -> None:
    a, b = stores
    wf, h = create(records, chain(t("a"), group(t("b"), t("c"), then=t("d")), t("e")))
    assert staged() == [h["a"]]
    assert records.workflow_status(wf) == ("running", False, {"running": 1, "waiting": 4})
    run(a, h["a"], result={"from": "a"})
    assert staged() == [h["b"], h["c"]]
    assert b.workflow_inputs(h["b"]) == ({"from": "a"}, None)  # a group's member gets what came before
    run(b, h["b"], result=2)
    assert staged() == []  # c is still open
    run(a, h["c"], state="dead")  # a member that dies does not block the callback (on_failure="run")
    assert staged() == [h["d"]]
    parent, members = a.workflow_inputs(h["d"])
    assert parent is None and [(m["task_id"], m["state"], m["result"]) for m in members] == [
        (f"id-{h['b']}", "completed", 2),
        (f"id-{h['c']}", "dead", None),
    ]
    assert members[1]["error"] == "boom"
    run(a, h["d"], result="d")
    assert staged() == [h["e"]] and b.workflow_inputs(h["e"]) == ("d", None)
    run(b, h["e"])
    assert staged() == []
    assert records.workflow_status(wf) == ("completed", False, {"completed": 4, "dead": 1})
    # A step delivered again after its end (its offset was not committed) ends nothing twice.
    b.workflow_ended([(h["e"], h["e"], "completed"), (h["b"], h["b"], "completed")])
    assert staged() == [] and records.workflow_status(wf)[0] == "completed"
    # Purged once ended longer than the TTL: the running ones stay.
    other, _ = create(records, chain(t("f")))
    assert a.purge_workflows(3600) == 0 and a.purge_workflows(-60) == 1
    assert records.workflow_status(wf) == (None, False, {})
    assert records.workflow_status(other)[0] == "running"


def test_a_group_that_skips_its_callback_ends_its_chain_and_the_steps_after_it_never_run(
    stores: tuple[Any, Any], records: Any, staged: Any
) -> None:
    a, _ = stores
    wf, h = create(records, chain(group(t("m1"), t("m2"), then=t("cb"), on_failure="skip"), t("after")))
    run(a, h["m1"], state="dead")
    run(a, h["m2"])
    assert staged() == [h["m1"], h["m2"]]  # the members only
    assert records.workflow_status(wf) == ("failed", False, {"completed": 1, "dead": 1, "skipped": 2})


def test_a_cancelled_workflow_starts_nothing_more_and_cancels_its_staged_tasks(
    stores: tuple[Any, Any], records: Any, staged: Any
) -> None:
    a, b = stores
    wf, h = create(records, chain(group(t("x"), t("y"), then=t("cb")), t("z")))
    run(a, h["x"])
    assert records.workflow_cancel(wf) == (1, 1)  # y is staged and not started: it never will be
    (claim,) = b.claim([ClaimRequest(h["y"], "id-y", "contract.Step", 30.0)])
    assert claim.outcome == "cancelled"
    b.workflow_ended([(h["y"], h["y"], "cancelled")])  # what the worker records for it
    assert staged() == [h["x"], h["y"]]
    assert records.workflow_status(wf) == ("cancelled", True, {"completed": 1, "cancelled": 3})


def test_members_ending_at_once_on_many_workers_fire_the_callback_exactly_once(
    stores: tuple[Any, Any], records: Any, staged: Any
) -> None:
    a, b = stores
    size = 120
    wf, h = create(records, group(*(t(f"m{i}") for i in range(size)), then=t("cb")))
    members = [h[f"m{i}"] for i in range(size)]
    for store, half in ((a, members[::2]), (b, members[1::2])):
        claims = store.claim([ClaimRequest(k, f"id-{k}", "contract.Step", 60.0) for k in half])
        assert {c.outcome for c in claims} == {"claimed"}
    retried = []

    def finish(store: Any, keys: list[str]) -> None:
        # Small batches from two stores at once: the group's last members end in concurrent transactions.
        for i in range(0, len(keys), 3):
            batch = [Finished(k, 1, "completed", workflow=k) for k in keys[i : i + 3]]
            while True:
                try:
                    assert store.finish(batch) == set()
                    break
                except StoreUnavailableError:  # a deadlock between two deciders: the batch is recorded again
                    retried.append(batch)

    threads = [
        threading.Thread(target=finish, args=(a, members[::2])),
        threading.Thread(target=finish, args=(b, members[1::2])),
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert staged().count(h["cb"]) == 1
    assert records.workflow_status(wf) == ("running", False, {"completed": size, "running": 1})


def test_a_step_whose_workflow_is_unknown_is_recorded_and_ends_no_node(
    stores: tuple[Any, Any], records: Any, staged: Any
) -> None:
    # A well-formed header naming a workflow that is not there (another namespace's, or one purged): the
    # task's outcome is recorded, and there is no node to end or step to stage.
    a, _ = stores
    run(a, f"{new_workflow_id()}:1")
    assert staged() == []
