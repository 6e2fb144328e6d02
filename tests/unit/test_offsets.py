import random

import pytest

from taskq.consumer.offsets import OffsetTracker

TP = ("taskq.normal", 0)
OTHER = ("taskq.high", 3)


def tracked(tp=TP, offsets=range(10, 15)):
    tracker = OffsetTracker()
    for offset in offsets:
        tracker.track(tp, offset)
    return tracker


def test_nothing_committable_before_progress():
    tracker = tracked()
    assert tracker.committable() == {}
    assert tracker.pending(TP) == 5
    assert tracker.in_flight() == 5


def test_out_of_order_completion_commits_only_contiguous_prefix():
    tracker = tracked()
    tracker.done(TP, 12)
    tracker.done(TP, 14)
    assert tracker.committable() == {}
    tracker.done(TP, 10)
    assert tracker.committable() == {TP: 11}
    tracker.done(TP, 11)
    assert tracker.committable() == {TP: 13}
    tracker.done(TP, 13)
    assert tracker.committable() == {TP: 15}
    assert tracker.in_flight() == 0


def test_gaps_in_offsets_do_not_block_the_watermark():
    tracker = tracked(offsets=[5, 9, 10, 20])
    tracker.done(TP, 5)
    assert tracker.committable() == {TP: 9}
    tracker.done(TP, 10)
    tracker.done(TP, 9)
    assert tracker.committable() == {TP: 20}
    tracker.done(TP, 20)
    assert tracker.committable() == {TP: 21}


def test_nothing_committable_twice_without_progress():
    tracker = tracked()
    tracker.done(TP, 10)
    assert tracker.committable() == {TP: 11}
    tracker.mark_committed({TP: 11})
    assert tracker.committable() == {}
    tracker.done(TP, 12)
    assert tracker.committable() == {}
    tracker.track(TP, 15)
    assert tracker.committable() == {}
    tracker.done(TP, 11)
    assert tracker.committable() == {TP: 13}


def test_an_older_commit_acknowledged_last_is_what_the_broker_holds_and_the_newer_is_sent_again():
    # A broker restart: commits of 12 then 15 were refused while the coordinator loaded; the client retried
    # them, and the broker applied 15, then 12. Its committed offset is 12: 15 must be committed again.
    tracker = tracked()
    for offset in range(10, 15):
        tracker.done(TP, offset)
    tracker.mark_committed({TP: 15})
    tracker.mark_committed({TP: 12})
    assert tracker.committable() == {TP: 15}
    tracker.mark_committed({TP: 15})
    assert tracker.committable() == {}


def test_partitions_are_independent():
    tracker = tracked()
    tracker.track(OTHER, 0)
    tracker.track(OTHER, 1)
    tracker.done(OTHER, 0)
    assert tracker.committable() == {OTHER: 1}
    tracker.done(TP, 10)
    assert tracker.committable() == {OTHER: 1, TP: 11}
    tracker.mark_committed({OTHER: 1})
    assert tracker.committable() == {TP: 11}
    assert tracker.in_flight() == 5


def test_forget_then_done_is_ignored():
    tracker = tracked()
    tracker.track(OTHER, 7)
    tracker.forget([TP, ("never", 9)])
    assert tracker.in_flight() == 1
    assert tracker.pending(TP) == 0
    tracker.done(TP, 10)
    tracker.mark_committed({TP: 11})
    assert tracker.committable() == {}
    assert tracker.in_flight() == 1


def test_reassigned_partition_starts_afresh():
    tracker = tracked()
    tracker.forget([TP])
    tracker.track(TP, 3)
    tracker.done(TP, 3)
    assert tracker.committable() == {TP: 4}


def test_done_for_untracked_offset_on_live_partition_is_an_error():
    tracker = tracked(offsets=[10, 12])
    with pytest.raises(ValueError, match=r"offset 11 of taskq.normal\[0\] is not pending"):
        tracker.done(TP, 11)
    tracker.done(TP, 10)
    with pytest.raises(ValueError, match="not pending"):
        tracker.done(TP, 10)
    assert tracker.in_flight() == 1


def test_offsets_must_increase():
    tracker = tracked()
    with pytest.raises(ValueError, match="must increase"):
        tracker.track(TP, 14)


@pytest.mark.parametrize("seed", range(25))
def test_random_completion_order_never_commits_past_unfinished(seed):
    rng = random.Random(seed)
    offsets = sorted(rng.sample(range(1000), 200))
    tracker = OffsetTracker()
    finished: set[int] = set()
    unfinished: list[int] = []
    next_index = 0
    committed = offsets[0]
    while next_index < len(offsets) or unfinished:
        if next_index < len(offsets) and (not unfinished or rng.random() < 0.5):
            tracker.track(TP, offsets[next_index])
            unfinished.append(offsets[next_index])
            next_index += 1
        else:
            offset = unfinished.pop(rng.randrange(len(unfinished)))
            tracker.done(TP, offset)
            finished.add(offset)
        commit = tracker.committable().get(TP)
        if commit is not None:
            assert commit > committed
            assert all(o in finished for o in offsets if o < commit)
            if rng.random() < 0.7:
                tracker.mark_committed({TP: commit})
                committed = commit
        assert tracker.in_flight() == len(unfinished)
    assert tracker.committable().get(TP, committed) == offsets[-1] + 1


def test_a_record_holding_back_finished_ones_is_reported_once_after_the_wait():
    tracker = tracked()  # 10..14
    tracker.done(TP, 11)
    tracker.done(TP, 12)
    assert tracker.held_back(0.0, 60.0) == []  # first seen now
    assert tracker.held_back(59.0, 60.0) == []
    assert tracker.held_back(60.0, 60.0) == [(TP, 10, 2)]
    assert tracker.held_back(120.0, 60.0) == []  # once a record
    tracker.done(TP, 10)  # the watermark moves on to 13: a new head, waited for anew
    assert tracker.held_back(121.0, 60.0) == []
    assert tracker.held_back(200.0, 60.0) == []  # nothing finished behind 13: a slow task, not a stall
    tracker.done(TP, 14)
    assert tracker.held_back(260.0, 60.0) == [(TP, 13, 1)]
