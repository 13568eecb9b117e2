"""Times and durations as an SRE types them: ``24h``, ``90m``, ``2026-12-02T14:05``.

A relative value (``24h``, ``1h30m``) means that long before now. An absolute value is
ISO 8601; one without a zone is UTC, because every time Tide stores and shows
is UTC and a shell's local zone is rarely what a runbook means.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from tide.base.errors import InvalidArgument
from tide.base.timeconv import DURATION, parse_duration_s

__all__ = ["iso", "parse_duration_s", "parse_time", "short"]


def parse_time(text: str, now: datetime) -> datetime:
    """A relative duration before ``now``, ``now`` itself, or an ISO 8601 time (UTC if naive)."""
    value = text.strip()
    if value == "now":
        return now
    if DURATION.match(value):
        return now - timedelta(seconds=parse_duration_s(value))
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidArgument(
            f"expected a duration (24h) or an ISO 8601 time (2026-12-02T14:05); got {text!r}"
        ) from None
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)


def iso(ts: datetime | None) -> str | None:
    """The one text form of a time in Tide's output: RFC 3339, UTC, millisecond precision."""
    if ts is None:
        return None
    return ts.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def short(ts: datetime | None) -> str:
    """A time for tables: ``2026-12-02 14:05:03``, UTC."""
    if ts is None:
        return "-"
    if ts.tzinfo is not UTC:
        ts = ts.astimezone(UTC)
    # isoformat, not strftime: `tide history --all` formats a time per row.
    return ts.isoformat(" ", "seconds")[:19]
