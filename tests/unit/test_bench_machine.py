"""How busy the machine was during a bench: its CPU ticks from /proc/stat."""

from __future__ import annotations

from taskq.tools.bench.run import machine_busy_since, machine_cpu


def test_busy_ticks_are_all_but_idle_and_iowait() -> None:
    # user nice system idle iowait irq softirq steal (guest ticks, already in user, are not added again)
    assert machine_cpu("cpu  100 5 50 800 40 3 2 0 7 0\n") == (160, 1000)
    assert machine_cpu("intr 1 2 3") is None


def test_the_busy_fraction_is_of_the_ticks_between_two_readings() -> None:
    assert machine_busy_since((160, 1000), (460, 1400)) == 0.75
    assert machine_busy_since(None, (460, 1400)) is None
    assert machine_busy_since((160, 1000), (160, 1000)) is None  # no tick between them


def test_this_machine_reports_its_ticks() -> None:
    busy, total = machine_cpu() or (0, 0)
    assert 0 < busy < total
