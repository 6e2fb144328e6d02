"""Durations and rates as people write them ("250ms", "1h30m", "100/s"), and the delay tiers that retries
and delays use."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Final

from taskq._core.errors import ConfigurationError

__all__ = ["DEFAULT_DELAY_TIERS", "Rate", "parse_duration", "parse_rate", "pick_delay_tier", "tier_name"]

#: Delay tiers, one delay topic each (`<ns>.delay.<tier_name>`), shortest first.
DEFAULT_DELAY_TIERS: Final[tuple[timedelta, ...]] = (
    timedelta(seconds=1),
    timedelta(seconds=5),
    timedelta(seconds=30),
    timedelta(minutes=2),
    timedelta(minutes=10),
    timedelta(hours=1),
)

_UNIT_SECONDS: Final[dict[str, float]] = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
# "ms" precedes "m" in the alternation so that "250ms" is not read as 250 minutes and a stray "s".
_PART: Final = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_NUMBER: Final = re.compile(r"\d+(?:\.\d+)?")



def parse_duration(text: str) -> timedelta:
    """Parse "250ms", "5s", "2m", "1h", "1d", "1h30m", or a bare number of seconds."""
    stripped = text.strip()
    if _NUMBER.fullmatch(stripped):
        try:
            return timedelta(seconds=float(stripped))
        except OverflowError:
            raise ConfigurationError(f"duration {text!r} is too long") from None
    total = 0.0
    pos = 0
    for match in _PART.finditer(stripped):
        if match.start() != pos:
            break
        total += float(match[1]) * _UNIT_SECONDS[match[2]]
        pos = match.end()
    if pos == 0 or pos != len(stripped):
        raise ConfigurationError(
            f"invalid duration {text!r}: expected e.g. '250ms', '5s', '2m', '1h', '1d', '1h30m' or seconds"
        )
    try:
        return timedelta(seconds=total)
    except OverflowError:
        raise ConfigurationError(f"duration {text!r} is too long") from None


def tier_name(delay: timedelta) -> str:
    """Name a delay compactly in its largest whole unit: "1s", "30s", "2m", "1h", "90m", "250ms"."""
    millis, remainder = divmod(delay, timedelta(milliseconds=1))
    if delay <= timedelta(0) or remainder:
        raise ConfigurationError(
            f"a delay tier must be a positive whole number of milliseconds, got {delay.total_seconds():g}s"
        )
    for unit, unit_millis in (("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if millis % unit_millis == 0:
            return f"{millis // unit_millis}{unit}"
    return f"{millis}ms"


def pick_delay_tier(delay: timedelta, tiers: Sequence[timedelta]) -> timedelta:
    """Return the smallest tier >= delay, or the largest tier when none is long enough."""
    if not tiers:
        raise ConfigurationError("no delay tiers configured")
    # A tier shorter than the delay is never picked while a longer one exists; when none fits, the
    # forwarder of the largest tier holds the task until its not-before time, so it never runs early.
    fitting = [tier for tier in tiers if tier >= delay]
    return min(fitting) if fitting else max(tiers)


_RATE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*/\s*(\S+)\s*")


@dataclass(frozen=True, slots=True)
class Rate:
    """A rate limit: `per_second` tokens a second, and bursts of up to `burst` after a quiet spell."""

    per_second: float
    burst: float
    text: str


def parse_rate(text: str) -> Rate:
    """Parse "100/s", "10/m", "5/h", "20/10s": N tasks per period, and bursts of up to N."""
    match = _RATE.fullmatch(text) if isinstance(text, str) else None
    if match is not None:
        count, period = float(match.group(1)), match.group(2)
        try:
            seconds = parse_duration(period if period[0].isdigit() else f"1{period}").total_seconds()
        except ConfigurationError:
            seconds = 0.0
        if count > 0 and seconds > 0:
            return Rate(count / seconds, max(1.0, count), text.strip())
    raise ConfigurationError(
        f"rate_limit must be tasks per period, like '100/s', '10/m' or '20/10s' (a count > 0), got {text!r}"
    )
