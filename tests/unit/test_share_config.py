"""A worker in share mode knows its share groups' delivery limit as the broker applies it, not as it stood
before the worker set it."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest

from taskq.consumer import shares
from taskq.consumer.shares import DELIVERY_LIMIT, SEND_AGAIN_BEFORE, TierShares


class _Admin:
    """A cluster whose group configs, once altered, read back as they were for the first `stale` reads
    (a broker applies an alteration when it replays the metadata log, after the alter has answered)."""

    def __init__(self, *, most: str | None, stale: int) -> None:
        self.most = most
        self.stale = stale
        self.reads = 0
        self.set: dict[str, int | None] = {}

    def broker_configs(self) -> dict[str, str]:
        return {"group.share.max.delivery.count.limit": self.most} if self.most else {}

    def configure_share_group(
        self, group: str, *, lock_duration_ms: int | None = None, delivery_count_limit: int | None = None
    ) -> None:
        self.set[group] = delivery_count_limit

    def share_group_configs(self, groups: Sequence[str]) -> dict[str, dict[str, str]]:
        self.reads += 1
        applied = self.reads > self.stale
        return {
            g: {"share.delivery.count.limit": str(self.set[g] if applied and self.set[g] else DELIVERY_LIMIT)}
            for g in groups
        }

    def partitions(self, topics: Sequence[str]) -> dict[str, int]:
        return dict.fromkeys(topics, 1)


class _Member:
    def close(self) -> None:
        pass


class _Broker:
    def __init__(self, admin: _Admin) -> None:
        self._admin = admin

    def admin(self) -> _Admin:
        return self._admin

    def share_source(self, **kwargs: object) -> _Member:
        return _Member()


def _joined(admin: _Admin) -> TierShares:
    joined = TierShares(_Broker(admin), consumers=1, max_poll_records=1, on_assign=lambda tps: None)  # type: ignore[arg-type]
    joined.subscribe(["ns.high", "ns.normal"])
    return joined


def test_a_limit_read_back_before_the_broker_applied_it_is_read_again_until_it_has() -> None:
    admin = _Admin(most="10", stale=2)
    joined = _joined(admin)
    assert admin.set == {"ns.workers.high": 10, "ns.workers.normal": 10}
    assert (joined.delivery_limit, joined.send_again_at) == (10, 10 - SEND_AGAIN_BEFORE)
    assert admin.reads == 3


def test_a_limit_never_applied_in_time_is_taken_as_read_and_said(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # What the group was read to have is what it archives at: sending a record again early is safe, late
    # is not.
    monkeypatch.setattr(shares, "_CONFIG_SETTLE", 0.2)
    admin = _Admin(most="10", stale=10**6)
    with caplog.at_level(logging.WARNING, "taskq.worker"):
        joined = _joined(admin)
    assert joined.delivery_limit == DELIVERY_LIMIT
    assert joined.send_again_at == DELIVERY_LIMIT - SEND_AGAIN_BEFORE
    assert admin.reads > 1
    assert "still reads share.delivery.count.limit 5, not the 10 set" in caplog.text


def test_a_cluster_whose_most_is_unreadable_is_read_once_and_its_limit_taken() -> None:
    admin = _Admin(most=None, stale=0)
    joined = _joined(admin)
    assert admin.set == {"ns.workers.high": None, "ns.workers.normal": None}
    assert (joined.delivery_limit, admin.reads) == (DELIVERY_LIMIT, 1)
