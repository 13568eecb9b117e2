"""Protobuf Timestamp conversions, and durations as people write them, in one place.

Tide keeps wall-clock times as float seconds since the epoch (domain code) or
as aware UTC datetimes (the store); the API carries ``google.protobuf.Timestamp``.
An unset message field means "unknown", never the epoch, so the readers take
the parent message and the field name and return None when it is not set.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from tide.base.errors import InvalidArgument

_UNITS_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
_PART = r"(\d+(?:\.\d+)?)([smhdw])"
#: One or more number+unit parts, largest unit first, each unit once: 1h30m, 2d12h, 90s.
DURATION = re.compile(rf"^\s*(?:{_PART})+\s*$")
_ORDER = "wdhms"


def parse_duration_s(text: str) -> float:
    """``90s`` / ``15m`` / ``1h30m`` / ``7d`` / ``2w`` in seconds (Go's and kubectl's form)."""
    compact = text.strip()
    parts = re.findall(_PART, compact)
    if not DURATION.match(text) or "".join(n + u for n, u in parts) != compact:
        raise InvalidArgument(f"expected a duration like 30s, 15m, 1h30m, 7d; got {text!r}")
    units = [u for _, u in parts]
    if [_ORDER.index(u) for u in units] != sorted({_ORDER.index(u) for u in units}):
        raise InvalidArgument(f"duration {text!r}: each unit once, largest first (1h30m)")
    return sum(float(n) * _UNITS_S[u] for n, u in parts)


def ts_from_seconds(seconds: float | None) -> Timestamp | None:
    """A Timestamp for epoch seconds (nanosecond precision); None for None or non-finite."""
    if seconds is None or not math.isfinite(seconds):
        return None
    ts = Timestamp()
    whole = math.floor(seconds)
    ts.seconds = int(whole)
    ts.nanos = min(round((seconds - whole) * 1e9), 999_999_999)
    return ts


def ts_from_datetime(dt: datetime | None) -> Timestamp | None:
    """A Timestamp for an aware datetime (a naive one is taken as UTC); None for None."""
    if dt is None:
        return None
    ts = Timestamp()
    ts.FromDatetime(dt.astimezone(UTC) if dt.tzinfo else dt.replace(tzinfo=UTC))
    return ts


def seconds_of(ts: Timestamp) -> float:
    """Epoch seconds of a Timestamp."""
    return ts.seconds + ts.nanos / 1e9


def datetime_of(ts: Timestamp) -> datetime:
    """An aware UTC datetime of a Timestamp."""
    return ts.ToDatetime(tzinfo=UTC)


def field_seconds(msg: Any, name: str) -> float | None:
    """Epoch seconds of ``msg.<name>``, or None when the field is not set."""
    return seconds_of(getattr(msg, name)) if msg.HasField(name) else None


def field_datetime(msg: Any, name: str) -> datetime | None:
    """An aware UTC datetime of ``msg.<name>``, or None when the field is not set."""
    return datetime_of(getattr(msg, name)) if msg.HasField(name) else None
