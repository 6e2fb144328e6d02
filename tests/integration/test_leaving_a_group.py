"""A member leaving its group while the group moves partitions to it (another member left just before)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import pytest

from taskq._core.broker import TP
from taskq._core.envelope import Topics
from taskq._core.kafka import Source
from taskq._core.settings import Settings

#: The stack's group.consumer.heartbeat.interval.ms is 1 s: a member's background heartbeat brings it the
#: partitions another member left within that, and queues them for its next poll.
_HEARTBEATS = 2.5


def _poll_until(sources: list[Source], done: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + 30
    while not done():
        assert time.monotonic() < deadline, f"no {what} within 30 s"
        for s in sources:
            s.poll(10, 0.05)


def test_partitions_assigned_to_a_member_as_it_leaves_are_given_back_without_reaching_its_owner(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    # Member `a` is closing when the partitions `b` left reach it. Before, its owner heard of them and read
    # their committed offsets, a read that cannot be answered while the consumer closes: the close waited it
    # out (5 s) before giving them back, and a worker's SIGTERM took that much longer. Now they are given
    # back as part of the close; the owner hears only of what it was told it had.
    # KIP-848's incremental assignment, whatever protocol the suite's settings name: a classic group revokes
    # everything before it assigns, and nothing reaches a member as it leaves.
    settings = dataclasses.replace(settings, group_protocol="consumer")
    topics = list(Topics(settings.namespace).priority_topics)
    group = f"{settings.namespace}.leaving"
    owned: dict[str, set[TP]] = {"a": set(), "b": set()}
    told: list[tuple[str, str, list[TP]]] = []
    closing: set[str] = set()

    def source(name: str) -> Source:
        def assigned(tps: list[TP]) -> None:
            told.append((name, "closing" if name in closing else "running", tps))
            owned[name].update(tps)

        def revoked(tps: list[TP]) -> None:
            assert set(tps) <= owned[name], f"{name} told of revoked partitions it never had: {tps}"
            owned[name].difference_update(tps)

        return Source(settings, group=group, on_assign=assigned, on_revoke=revoked)

    a, b = source("a"), source("b")
    all_partitions = 4 * 3
    a.subscribe(topics)
    try:
        _poll_until([a], lambda: len(owned["a"]) == all_partitions, "assignment of every partition to a")
        b.subscribe(topics)
        try:
            _poll_until(
                [a, b], lambda: owned["b"] and len(owned["a"]) + len(owned["b"]) == all_partitions, "split"
            )
        finally:
            b.close()
        held = set(owned["a"])
        time.sleep(_HEARTBEATS)  # `a` does not poll: what b left waits in its queue (no event to await)
        with caplog.at_level(logging.INFO, logger="taskq"):
            closing.add("a")
            a.close()
    finally:
        if "a" not in closing:
            a.close()
    given_back = [r.getMessage() for r in caplog.records if "assigned while leaving" in r.getMessage()]
    assert [t for t in told if t[1] == "closing"] == [], "a's owner was told of partitions as it left"
    assert given_back, "the partitions b left reached a while it closed (the case under test)"
    assert owned["a"] == set(), f"a's owner still holds {owned['a']} of {held}"
