"""Share groups (KIP-932) on the stack's Kafka: what a share-group worker builds on (issue 24)."""

from __future__ import annotations

from taskq._core.settings import Settings
from tests.acceptance.helpers import share_group_reads


def test_a_share_group_delivers_each_record_once_and_again_after_a_release(settings: Settings) -> None:
    # Accepted at the first delivery: each record read once, delivery count 1.
    assert share_group_reads(settings.bootstrap_servers, records=5) == [1] * 5
    # Released at the first delivery: the broker hands each out again and counts the second delivery.
    counts = share_group_reads(settings.bootstrap_servers, records=5, release_first=True)
    assert sorted(counts) == [1] * 5 + [2] * 5
