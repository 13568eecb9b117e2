"""Durations and times as an SRE types them, compound durations included."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tide.base.errors import InvalidArgument
from tide.services.cli.timeparse import parse_duration_s, parse_time

pytestmark = pytest.mark.unit

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90.0),
        ("15m", 900.0),
        ("1h30m", 5400.0),
        ("2d12h", 216000.0),
        ("1w2d3h4m5s", 7 * 86400 + 2 * 86400 + 3 * 3600 + 4 * 60 + 5),
        ("1.5h", 5400.0),
        (" 24h ", 86400.0),
    ],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration_s(text) == seconds


@pytest.mark.parametrize("text", ["", "h", "1", "30m1h", "1h1h", "1h 30m", "-5m", "1y"])
def test_bad_durations_say_what_is_expected(text: str) -> None:
    with pytest.raises(InvalidArgument, match="1h30m"):
        parse_duration_s(text)


def test_a_compound_duration_is_a_time_before_now() -> None:
    assert parse_time("1h30m", NOW) == NOW - timedelta(minutes=90)
    assert parse_time("2026-12-02T14:05", NOW) == datetime(2026, 12, 2, 14, 5, tzinfo=UTC)
