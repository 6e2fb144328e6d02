"""Periodic schedules: cron and interval slots, what runs after downtime, and registration mistakes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from taskq import Handlers, TaskContext
from taskq._core.errors import ConfigurationError
from taskq.consumer.periodic import Cron, Every, due_slots, schedule_of


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


@pytest.mark.parametrize(
    ("expr", "after", "expected"),
    [
        ("*/5 * * * *", "2026-11-30 10:03:20", "2026-11-30 10:05:00"),
        ("*/5 * * * *", "2026-11-30 10:05:00", "2026-11-30 10:10:00"),
        ("0 9 * * mon", "2026-11-30 09:00:00", "2026-12-07 09:00:00"),  # 30 Nov 2026 is a Monday
        ("0 9 * * 1-5", "2026-12-04 10:00:00", "2026-12-07 09:00:00"),  # Friday, after 9: Monday
        ("30 2 1 * *", "2026-11-30 00:00:00", "2026-12-01 02:30:00"),
        ("0 0 29 2 *", "2026-03-01 00:00:00", "2028-02-29 00:00:00"),  # the next leap day
        ("0 12 13 * 5", "2026-11-30 00:00:00", "2026-12-04 12:00:00"),  # day 13 OR a Friday: Friday 4th
        ("15,45 */6 * jan-mar *", "2026-11-30 00:00:00", "2027-01-01 00:15:00"),
        ("0 0 * * 7", "2026-11-30 00:00:00", "2026-12-06 00:00:00"),  # 7 is Sunday too
    ],
)
def test_cron_next_slot(expr: str, after: str, expected: str) -> None:
    assert Cron.parse(expr).next_after(at(after)) == at(expected)


def test_cron_last_slot_at_or_before() -> None:
    cron = Cron.parse("*/15 * * * *")
    assert cron.last_at_or_before(at("2026-11-30 10:14:59")) == at("2026-11-30 10:00:00")
    assert cron.last_at_or_before(at("2026-11-30 10:15:00")) == at("2026-11-30 10:15:00")


@pytest.mark.parametrize(
    ("expr", "problem"),
    [
        ("* * * *", "needs 5 fields"),
        ("60 * * * *", "not in 0-59"),
        ("* * * * funday", "not in 0-7"),
        ("5-1 * * * *", "runs backwards"),
        ("*/0 * * * *", "step must be >= 1"),
        ("a/b * * * *", "cannot read"),
    ],
)
def test_bad_cron_expressions_are_named_in_one_line(expr: str, problem: str) -> None:
    with pytest.raises(ConfigurationError, match=problem) as raised:
        Cron.parse(expr)
    assert "\n" not in str(raised.value)


def test_interval_slots_are_the_same_for_every_worker() -> None:
    every = schedule_of(None, "30s")
    assert isinstance(every, Every)
    assert every.next_after(at("2026-11-30 10:00:10")) == at("2026-11-30 10:00:30")
    assert every.last_at_or_before(at("2026-11-30 10:00:59.9")) == at("2026-11-30 10:00:30")
    with pytest.raises(ConfigurationError, match="at least 1 second"):
        schedule_of(None, "250ms")
    with pytest.raises(ConfigurationError, match="not both or neither"):
        schedule_of("* * * * *", "1m")


def test_a_slot_on_time_runs_whatever_the_catch_up() -> None:
    every = Every(60, "1m")
    last, now = at("2026-11-30 10:00:00"), at("2026-11-30 10:01:02")
    for catch_up in ("skip", "last", "all"):
        assert due_slots(every, last, now, catch_up) == [at("2026-11-30 10:01:00")]  # type: ignore[arg-type]
    assert due_slots(every, at("2026-11-30 10:01:00"), now, "all") == []  # already staged


def test_after_downtime_catch_up_decides_what_runs() -> None:
    every = Every(60, "1m")
    last, now = at("2026-11-30 10:00:00"), at("2026-11-30 10:05:40")  # 10:01..10:05 missed, none on time
    missed = [at(f"2026-11-30 10:0{m}:00") for m in range(1, 6)]
    assert due_slots(every, last, now, "all") == missed
    assert due_slots(every, last, now, "last") == missed[-1:]
    assert due_slots(every, last, now, "skip") == []
    now = at("2026-11-30 10:05:10")  # 10:05 is on time: it runs, and "last" adds nothing older
    assert due_slots(every, last, now, "last") == [at("2026-11-30 10:05:00")]
    assert due_slots(every, last, now, "skip") == [at("2026-11-30 10:05:00")]


def test_a_new_periodic_task_starts_with_the_current_slot_only_if_it_is_on_time() -> None:
    every = Every(3600, "1h")
    assert due_slots(every, None, at("2026-11-30 10:00:05"), "all") == [at("2026-11-30 10:00:00")]
    assert due_slots(every, None, at("2026-11-30 10:20:00"), "all") == []


def test_a_year_of_missed_slots_stages_only_the_latest_thousand() -> None:
    every = Every(60, "1m")
    slots = due_slots(every, at("2025-11-30 10:00:00"), at("2026-11-30 10:00:30"), "all")
    assert len(slots) == 1000 and slots[-1] == at("2026-11-30 10:00:00")
    assert slots == sorted(slots) and slots[-1] - slots[0] == timedelta(minutes=999)


SCHEMA = {
    "type": "record",
    "name": "Report",
    "namespace": "t",
    "fields": [{"name": "kind", "type": "string"}],
}


def report(payload: dict[str, Any], ctx: TaskContext) -> None:
    pass


def test_registration_mistakes_are_one_line_errors() -> None:
    handlers = Handlers()
    with pytest.raises(ConfigurationError, match=r"put it above @handlers\.task"):
        handlers.periodic(every="1m")(report)
    registered = handlers.task("t.Report", schema=SCHEMA)(report)
    with pytest.raises(ConfigurationError, match="kind"):
        handlers.periodic(every="1m", payload={"kind": 3})(registered)
    with pytest.raises(ConfigurationError, match="catch_up"):
        handlers.periodic(every="1m", catch_up="some")  # type: ignore[arg-type]
    handlers.periodic("0 * * * *", payload={"kind": "hourly"})(registered)
    with pytest.raises(ConfigurationError, match="already registered"):
        handlers.periodic(every="1m", payload={"kind": "again"})(registered)
    handlers.periodic(every="1m", payload={"kind": "minutely"}, name="minutely")(registered)
    [hourly, minutely] = handlers.periodic_tasks
    assert (hourly.name, hourly.task_type, hourly.schedule.text) == ("t.Report", "t.Report", "0 * * * *")
    assert (
        minutely.idempotency_key(at("2026-11-30 10:00:00")) == "periodic:minutely:2026-11-30T10:00:00+00:00"
    )
