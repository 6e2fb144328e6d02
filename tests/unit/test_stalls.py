"""Partitions that stand still with records to read are reported once, with their position."""

from __future__ import annotations

from taskq.consumer.stalls import Stalls

A = ("ns.critical", 1)
B = ("ns.normal", 0)


def test_a_partition_with_records_to_read_and_no_progress_is_reported_once_after_the_wait() -> None:
    stalls = Stalls(60.0)
    assert stalls.check(0.0, {A: (10, 43), B: (5, 5)}, holding=()) == []
    assert stalls.check(59.0, {A: (10, 43), B: (5, 5)}, holding=()) == []
    # B read to its end: nothing to fetch is no stall.
    assert stalls.check(60.0, {A: (10, 43), B: (5, 5)}, holding=()) == [(A, 10, 43)]
    assert stalls.check(200.0, {A: (10, 43), B: (5, 5)}, holding=()) == []  # once
    assert stalls.check(201.0, {A: (11, 43)}, holding=()) == []  # it moved: watched anew
    assert stalls.check(261.0, {A: (11, 43)}, holding=()) == [(A, 11, 43)]


def test_a_partition_never_fetched_is_a_stall_and_one_whose_records_the_worker_holds_is_not() -> None:
    stalls = Stalls(60.0)
    stalls.check(0.0, {A: (-1, -1), B: (3, 90)}, holding={B})
    assert stalls.check(60.0, {A: (-1, -1), B: (3, 90)}, holding={B}) == [(A, -1, -1)]
    # Revoked, then assigned again: its wait starts over.
    assert stalls.check(61.0, {B: (3, 90)}, holding=()) == []
    assert stalls.check(62.0, {A: (-1, -1), B: (3, 90)}, holding=()) == []
    assert stalls.check(121.0, {A: (-1, -1), B: (3, 90)}, holding=()) == [(B, 3, 90)]
    assert stalls.check(122.0, {A: (-1, -1), B: (3, 90)}, holding=()) == [(A, -1, -1)]
