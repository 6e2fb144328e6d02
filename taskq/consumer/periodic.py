"""Periodic tasks: schedules (cron or a fixed interval), their slots, and the scheduler every worker runs.

A slot is one scheduled time of one periodic task. Every worker runs the scheduler; for each periodic task,
the first to lock its row in `taskq_periodic` stages the due slots in the outbox and advances the row's last
slot, in one transaction, so a slot is staged once whatever the number of workers, and never lost to a crash
in between (the relay publishes what was staged). Each slot's task carries the idempotency key
`periodic:<name>:<slot time>`, so even a slot staged twice by hand runs once.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal, Protocol

from taskq._core.errors import ConfigurationError, TaskqError

if TYPE_CHECKING:  # a handlers module imports this one: it loads no Postgres code until a worker runs it
    from taskq._core.db import Database

log = logging.getLogger("taskq.periodic")

CatchUp = Literal["skip", "last", "all"]
CATCH_UPS: tuple[CatchUp, ...] = ("skip", "last", "all")

#: A slot later than this is missed (downtime), and catch_up decides whether it runs.
GRACE = timedelta(seconds=30)
#: At most this many missed slots are staged at once with catch_up="all".
MAX_CATCH_UP = 1000


class Schedule(Protocol):
    """When a periodic task is due: its slots, in UTC."""

    @property
    def text(self) -> str:
        """The schedule as written (a cron expression, or the interval)."""
        ...

    def next_after(self, t: datetime) -> datetime:
        """The first slot strictly after `t`."""
        ...

    def last_at_or_before(self, t: datetime) -> datetime | None:
        """The latest slot at or before `t` (None if there is none within a reasonable past)."""
        ...


@dataclass(frozen=True)
class Every:
    """Slots at whole multiples of an interval since the Unix epoch: every worker computes the same ones."""

    seconds: float
    text: str

    def next_after(self, t: datetime) -> datetime:
        n = int(t.timestamp() // self.seconds) + 1
        return datetime.fromtimestamp(n * self.seconds, UTC)

    def last_at_or_before(self, t: datetime) -> datetime | None:
        return datetime.fromtimestamp(int(t.timestamp() // self.seconds) * self.seconds, UTC)


_NAMES = {
    3: {m: i for i, m in enumerate("jan feb mar apr may jun jul aug sep oct nov dec".split(), 1)},
    4: {d: i for i, d in enumerate("sun mon tue wed thu fri sat".split())},
}
#: (low, high) of minute, hour, day of month, month, day of week (0 and 7 are Sunday).
_BOUNDS = ((0, 59), (0, 23), (1, 31), (1, 12), (0, 7))


@dataclass(frozen=True)
class Cron:
    """A standard five-field cron expression (minute hour day-of-month month day-of-week), in UTC.

    Fields take `*`, numbers, `a-b`, lists `a,b`, steps `*/n` and `a-b/n`, and month and weekday names. As in
    cron, when both day fields are restricted a day matches either of them.
    """

    text: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    any_day: bool  # day of month is *
    any_weekday: bool  # day of week is *

    @classmethod
    def parse(cls, text: str) -> Cron:
        fields = text.split()
        if len(fields) != 5:
            raise ConfigurationError(
                f"cron expression {text!r} needs 5 fields (minute hour day-of-month month day-of-week)"
            )
        sets = [_field(f, i, text) for i, f in enumerate(fields)]
        weekdays = frozenset(0 if d == 7 else d for d in sets[4])
        return cls(text, sets[0], sets[1], sets[2], sets[3], weekdays, fields[2] == "*", fields[4] == "*")

    def _day_matches(self, d: datetime) -> bool:
        if d.month not in self.months:
            return False
        dom = d.day in self.days
        dow = (d.isoweekday() % 7) in self.weekdays
        if self.any_day or self.any_weekday:
            return dom and dow
        return dom or dow

    def _times(self, day: datetime) -> Iterator[datetime]:
        for h in sorted(self.hours):
            for m in sorted(self.minutes):
                yield day.replace(hour=h, minute=m)

    def next_after(self, t: datetime) -> datetime:
        t = t.astimezone(UTC).replace(second=0, microsecond=0)
        day = t.replace(hour=0, minute=0)
        for _ in range(366 * 5):
            if self._day_matches(day):
                for slot in self._times(day):
                    if slot > t:
                        return slot
            day += timedelta(days=1)
        raise ConfigurationError(f"cron expression {self.text!r} has no time in the next five years")

    def last_at_or_before(self, t: datetime) -> datetime | None:
        t = t.astimezone(UTC)
        day = t.replace(hour=0, minute=0, second=0, microsecond=0)
        for _ in range(366 * 5):
            if self._day_matches(day):
                for slot in reversed(list(self._times(day))):
                    if slot <= t:
                        return slot
            day -= timedelta(days=1)
        return None


def _field(text: str, index: int, whole: str) -> frozenset[int]:
    low, high = _BOUNDS[index]
    names = _NAMES.get(index, {})
    values: set[int] = set()

    def number(s: str) -> int:
        v = names.get(s.lower()) if not s.isdigit() else int(s)
        if v is None or not low <= v <= high:
            raise ConfigurationError(f"cron expression {whole!r}: {s!r} is not in {low}-{high}")
        return v

    for part in text.split(","):
        m = re.fullmatch(r"(\*|[0-9a-zA-Z]+(?:-[0-9a-zA-Z]+)?)(?:/(\d+))?", part)
        if m is None:
            raise ConfigurationError(f"cron expression {whole!r}: cannot read {part!r}")
        span, step = m[1], int(m[2]) if m[2] else 1
        if step < 1:
            raise ConfigurationError(f"cron expression {whole!r}: step must be >= 1 in {part!r}")
        if span == "*":
            start, end = low, high
        elif "-" in span:
            a, b = span.split("-")
            start, end = number(a), number(b)
            if start > end:
                raise ConfigurationError(f"cron expression {whole!r}: range {span!r} runs backwards")
        else:
            start = number(span)
            end = high if m[2] else start
        values.update(range(start, end + 1, step))
    return frozenset(values)


def schedule_of(cron: str | None, every: str | float | timedelta | None) -> Schedule:
    """The schedule of `cron` or `every` (exactly one of them); ConfigurationError names a bad one."""
    if (cron is None) == (every is None):
        raise ConfigurationError("a periodic task takes a cron expression or every=, not both or neither")
    if cron is not None:
        return Cron.parse(cron)
    from taskq._core.durations import parse_duration

    if isinstance(every, timedelta):
        seconds = every.total_seconds()
    elif isinstance(every, str):
        seconds = parse_duration(every).total_seconds()
    else:
        seconds = float(every or 0)
    if not seconds >= 1:
        raise ConfigurationError(f"every= must be at least 1 second, got {every!r}")
    return Every(seconds, every if isinstance(every, str) else f"{seconds:g}s")


def schedule_from_text(text: str) -> Schedule:
    """A schedule from its `text` as stored (five fields: cron; otherwise an interval)."""
    return Cron.parse(text) if len(text.split()) == 5 else schedule_of(None, text)


def due_slots(
    schedule: Schedule, last: datetime | None, now: datetime, catch_up: CatchUp, grace: timedelta = GRACE
) -> list[datetime]:
    """The slots to stage now, given the last slot staged (None: the task was never scheduled).

    Slots later than `grace` are missed; catch_up decides: "all" stages them all (at most MAX_CATCH_UP, the
    latest), "last" the latest of them, "skip" none. A slot within `grace` of now always runs. A task seen
    for the first time starts with the current slot if it is within `grace`, else with the next one.
    """
    latest = schedule.last_at_or_before(now)
    if latest is None or (last is not None and latest <= last):
        return []
    if last is None:
        return [latest] if now - latest <= grace else []
    slots: list[datetime] = []
    t = last
    while len(slots) < MAX_CATCH_UP + 1:
        t = schedule.next_after(t)
        if t > now:
            break
        slots.append(t)
    if len(slots) > MAX_CATCH_UP:  # a long outage: more than can be listed; the latest are what matter
        slots = _latest(schedule, now, MAX_CATCH_UP)
    on_time = [s for s in slots if now - s <= grace]
    missed = [s for s in slots if now - s > grace]
    if catch_up == "all":
        return slots
    if catch_up == "last":
        return on_time or missed[-1:]
    return on_time


def _latest(schedule: Schedule, now: datetime, n: int) -> list[datetime]:
    out: list[datetime] = []
    t: datetime | None = now
    while t is not None and len(out) < n:
        t = schedule.last_at_or_before(t)
        if t is None:
            break
        out.append(t)
        t = t - timedelta(microseconds=1)
    return out[::-1]


@dataclass(frozen=True)
class PeriodicSpec:
    """A periodic task: its name, task type, schedule, payload and tier, and what to do after downtime."""

    name: str
    task_type: str
    schedule: Schedule
    payload: dict[str, Any]
    priority: str
    catch_up: CatchUp

    def idempotency_key(self, slot: datetime) -> str:
        """`periodic:<name>:<slot time>`: one effect per slot, whoever staged it."""
        return f"periodic:{self.name}:{slot.astimezone(UTC).isoformat()}"


class Stager(Protocol):
    """What stages a slot's task in the outbox on a connection (TaskProducer.enqueue with conn=)."""

    def __call__(self, spec: PeriodicSpec, slot: datetime, conn: Any) -> None: ...


class PeriodicScheduler:
    """Stages the due slots of periodic tasks; every worker runs one (`run()` on a thread until `stop()`)."""

    def __init__(
        self,
        specs: Sequence[PeriodicSpec],
        database: Database,
        namespace: str,
        stage: Stager,
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        tick: float = 1.0,
    ) -> None:
        from taskq._core.store import Store

        self.specs = list(specs)
        self.namespace = namespace
        self._database = database
        self._store = Store(database)
        self._stage = stage
        self._clock = clock
        self._tick = tick
        self._stop = threading.Event()
        self._conn: Any = None  # the kept connection of the scheduler's transactions

    def stop(self) -> None:
        """Ask run() to return."""
        self._stop.set()

    def close(self) -> None:
        """Release the scheduler's connection (run() does it when it returns)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def run_once(self) -> int:
        """Stage every due slot of every periodic task whose row no other worker holds; slots staged."""
        staged = 0
        now = self._clock()
        if self._conn is None or self._conn.closed:
            self._conn = self._database.connect(autocommit=False)
        for spec in self.specs:
            with self._database.transaction(self._conn) as tx:
                locked, last = self._store.periodic_lock(tx, self.namespace, spec.name)
                if not locked:  # another worker is staging this task's slots right now
                    continue
                slots = due_slots(spec.schedule, last, now, spec.catch_up)
                for slot in slots:
                    self._stage(spec, slot, tx.connection)
                if slots:
                    self._store.periodic_advance(
                        tx, self.namespace, spec.name, slots[-1], spec.schedule.text, spec.catch_up
                    )
                    staged += len(slots)
                    log.info("periodic %s: staged %s", spec.name, ", ".join(s.isoformat() for s in slots))
        return staged

    def run(self) -> None:
        """Stage due slots until stop(), waking at each next slot (and at least every `tick` seconds)."""
        while not self._stop.is_set():
            try:
                self.run_once()
            except TaskqError as exc:
                log.warning("periodic scheduler: %s; retrying", exc)
                self.close()
            now = self._clock()
            wake = min((s.schedule.next_after(now) for s in self.specs), default=now + timedelta(seconds=60))
            self._stop.wait(max(0.05, min(self._tick, (wake - now).total_seconds() + 0.01)))
        self.close()
