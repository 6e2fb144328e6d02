"""A KIP-848 member re-sends its subscription while its group settles (`Settling`): a heartbeat sooner."""

from __future__ import annotations

import dataclasses

from taskq._core.kafka_clients import Source
from taskq._core.settling import Settling
from taskq._core.settings import Settings


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _nudges(settling: Settling, clock: _Clock, until: float, step: float = 0.01) -> list[float]:
    """The times at which a poll every `step` seconds up to `until` would nudge."""
    out = []
    while clock.now < until:
        if settling.due():
            out.append(round(clock.now, 2))
        clock.now = round(clock.now + step, 2)
    return out


def test_a_settling_member_nudges_every_period_until_the_window_after_its_last_change() -> None:
    clock = _Clock()
    settling = Settling(nudge=0.1, window=0.5, clock=clock)
    assert not settling.due() and settling.next is None  # settled before it subscribed: nothing to do
    settling.changed()  # subscribed at 100.0
    assert _nudges(settling, clock, 100.8) == [100.1, 100.2, 100.3, 100.4]
    assert settling.next is None  # settled: poll's test is one attribute again

    clock.now = 200.0
    settling.changed()  # its assignment changed: settles again, from this change
    assert _nudges(settling, clock, 200.25) == [200.1, 200.2]
    settling.changed()  # a second change extends the window, without putting the next nudge off
    assert _nudges(settling, clock, 201.0) == [200.3, 200.4, 200.5, 200.6, 200.7]


def test_a_poll_waits_no_longer_than_the_next_nudge() -> None:
    clock = _Clock()
    settling = Settling(nudge=0.1, window=5.0, clock=clock)
    assert settling.wait(0.25) == 0.25  # settled: the poll's own timeout
    settling.changed()
    clock.now += 0.04
    assert abs(settling.wait(0.25) - 0.06) < 1e-9
    assert settling.wait(0.0) == 0.0
    clock.now += 0.5
    assert settling.wait(0.25) == 0.0  # overdue: poll at once, nudging first


def test_only_a_kip848_member_settles() -> None:
    # Re-subscribing a classic member makes its whole group rebalance: it never nudges.
    settings = Settings(bootstrap_servers="127.0.0.1:1", namespace="unit")
    classic = Source(dataclasses.replace(settings, group_protocol="classic"), group="g")
    consumer = Source(dataclasses.replace(settings, group_protocol="consumer"), group="g")
    try:
        assert classic._settling is None
        assert consumer._settling is not None
    finally:
        classic.close()
        consumer.close()
