import re
from datetime import timedelta

import pytest

from taskq._core.durations import DEFAULT_DELAY_TIERS, parse_duration, pick_delay_tier, tier_name


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("250ms", timedelta(milliseconds=250)),
        ("5s", timedelta(seconds=5)),
        ("2m", timedelta(minutes=2)),
        ("1h", timedelta(hours=1)),
        ("1d", timedelta(days=1)),
        ("1h30m", timedelta(minutes=90)),
        ("1m30s500ms", timedelta(seconds=90.5)),
        ("1.5s", timedelta(seconds=1.5)),
        ("30", timedelta(seconds=30)),
        ("0.25", timedelta(milliseconds=250)),
        (" 10m ", timedelta(minutes=10)),
    ],
)
def test_parse_duration(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["", "s", "5x", "-5s", "5 s", "1h-30m", "h1", "5s!", "1e3", "ms", "1.s"])
def test_parse_duration_rejects_bad_text_and_names_it(text):
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        parse_duration(text)


def test_default_tier_names():
    assert [tier_name(t) for t in DEFAULT_DELAY_TIERS] == ["1s", "5s", "30s", "2m", "10m", "1h"]


@pytest.mark.parametrize(
    ("delay", "name"),
    [
        (timedelta(milliseconds=250), "250ms"),
        (timedelta(milliseconds=1500), "1500ms"),
        (timedelta(seconds=90), "90s"),
        (timedelta(minutes=90), "90m"),
        (timedelta(days=1), "24h"),
    ],
)
def test_tier_name_uses_largest_whole_unit(delay, name):
    assert tier_name(delay) == name
    assert parse_duration(name) == delay


@pytest.mark.parametrize("delay", [timedelta(0), timedelta(seconds=-1), timedelta(microseconds=1500)])
def test_tier_name_rejects_non_positive_or_sub_millisecond(delay):
    with pytest.raises(ValueError, match="delay tier"):
        tier_name(delay)


@pytest.mark.parametrize(
    ("delay", "tier"),
    [
        (timedelta(0), timedelta(seconds=1)),
        (timedelta(seconds=-3), timedelta(seconds=1)),
        (timedelta(seconds=1), timedelta(seconds=1)),
        (timedelta(seconds=3), timedelta(seconds=5)),
        (timedelta(seconds=5), timedelta(seconds=5)),
        (timedelta(seconds=31), timedelta(minutes=2)),
        (timedelta(hours=1), timedelta(hours=1)),
        (timedelta(hours=5), timedelta(hours=1)),
    ],
)
def test_pick_delay_tier(delay, tier):
    assert pick_delay_tier(delay, DEFAULT_DELAY_TIERS) == tier
    assert pick_delay_tier(delay, tuple(reversed(DEFAULT_DELAY_TIERS))) == tier


def test_pick_delay_tier_needs_tiers():
    with pytest.raises(ValueError, match="no delay tiers"):
        pick_delay_tier(timedelta(seconds=1), [])


def test_a_delay_tier_that_is_no_whole_millisecond_is_named_in_seconds_not_as_a_python_repr():
    with pytest.raises(ValueError) as refused:
        tier_name(timedelta(microseconds=1500))
    assert str(refused.value) == "a delay tier must be a positive whole number of milliseconds, got 0.0015s"
