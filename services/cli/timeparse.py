"""Times and durations as an SRE types them: ``24h``, ``90m``, ``2026-12-02T14:05``.

A relative value (``24h``, ``1h30m``) means that long before now. An absolute value is
ISO 8601; one without a zone is UTC, because every time Tide stores and shows
is UTC and a shell's local zone is rarely what a runbook means.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from tidebase.errors import InvalidArgument

_UNITS_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
_PART = r"(\d+(?:\.\d+)?)([smhdw])"
#: One or more number+unit parts, largest unit first, each unit once: 1h30m, 2d12h, 90s.
_DURATION = re.compile(rf"^\s*(?:{_PART})+\s*$")
_ORDER = "wdhms"


def parse_duration_s(text: str) -> float:
    """``90s`` / ``15m`` / ``1h30m`` / ``7d`` / ``2w`` in seconds (Go's and kubectl's form)."""
    compact = text.strip()
    parts = re.findall(_PART, compact)
    if not _DURATION.match(text) or "".join(n + u for n, u in parts) != compact:
        raise InvalidArgument(f"expected a duration like 30s, 15m, 1h30m, 7d; got {text!r}")
    units = [u for _, u in parts]
    if [_ORDER.index(u) for u in units] != sorted({_ORDER.index(u) for u in units}):
        raise InvalidArgument(f"duration {text!r}: each unit once, largest first (1h30m)")
    return sum(float(n) * _UNITS_S[u] for n, u in parts)


def parse_time(text: str, now: datetime) -> datetime:
    """A relative duration before ``now``, ``now`` itself, or an ISO 8601 time (UTC if naive)."""
    value = text.strip()
    if value == "now":
        return now
    if _DURATION.match(value):
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
    return ts.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
