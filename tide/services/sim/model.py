"""The values a scenario is made of: durations, times of day, numbers that name their key
when they are wrong, throughput curves and daily profiles."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tide.base.errors import ConfigError, InvalidArgument
from tide.base.timeconv import parse_duration_s

DAY_S = 86400.0


def duration(key: str, value: Any) -> float:
    """Seconds from a number (seconds) or a string like 90s, 15m, 12h, 30d."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: expected seconds or a duration like 15m")
    if isinstance(value, int | float):
        s = float(value)
    else:
        try:
            s = parse_duration_s(str(value))
        except InvalidArgument as exc:
            raise ConfigError(f"{key}={value!r}: {exc}") from None
    if not (s >= 0 and math.isfinite(s)):
        raise ConfigError(f"{key}={value!r}: must be >= 0")
    return s


def clock(key: str, value: Any) -> float:
    """Seconds after midnight from ``"HH:MM"`` or an hour number."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        hours = float(value)
    else:
        h, sep, m = str(value).partition(":")
        try:
            hours = int(h) + (int(m) / 60 if sep else 0)
        except ValueError:
            raise ConfigError(f"{key}={value!r}: expected HH:MM or an hour") from None
    if not 0 <= hours < 24:
        raise ConfigError(f"{key}={value!r}: must be within 00:00..23:59")
    return hours * 3600


def number(key: str, value: Any, lo: float = 0.0, hi: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key}={value!r}: expected a number")
    v = float(value)
    if not (lo <= v <= hi) or math.isnan(v):
        raise ConfigError(f"{key}={value!r}: must be within {lo:g}..{hi:g}")
    return v


def integer(key: str, value: Any, lo: int = 0, hi: int = 1 << 31) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}={value!r}: expected an integer")
    if not lo <= value <= hi:
        raise ConfigError(f"{key}={value!r}: must be within {lo}..{hi}")
    return value


@dataclass(frozen=True)
class Curve:
    """Training throughput (samples/s) by replica count.

    Either measured ``points`` (linear between them, proportional below the
    first, flat past the last), or the model ``per_replica × w / (1 + serial ×
    (w-1) + comm × (w-1)²)``: Amdahl's serial fraction, plus a communication
    term that grows with the world size and makes large sizes slower."""

    per_replica: float = 100.0
    serial: float = 0.0
    comm: float = 0.0
    points: tuple[tuple[int, float], ...] = ()

    def at(self, w: int) -> float:
        if w <= 0:
            return 0.0
        if not self.points:
            return self.per_replica * w / (1 + self.serial * (w - 1) + self.comm * (w - 1) ** 2)
        pts = self.points
        if w <= pts[0][0]:
            return pts[0][1] * w / pts[0][0]
        for (a, ta), (b, tb) in itertools.pairwise(pts):
            if w <= b:
                return ta + (tb - ta) * (w - a) / (b - a)
        return pts[-1][1]

    @property
    def best(self) -> int:
        """The size with the highest throughput up to 1024 replicas."""
        return max(range(1, 1025), key=lambda w: (self.at(w), -w))


def parse_curve(key: str, raw: Any) -> Curve:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{key}={raw!r}: expected a mapping (points, or per_replica/serial/comm)")
    unknown = set(raw) - {"points", "per_replica", "serial", "comm"}
    if unknown:
        raise ConfigError(f"{key}: unknown key(s) {sorted(unknown)}")
    if "points" in raw:
        pts = raw["points"]
        if not isinstance(pts, list) or not pts:
            raise ConfigError(f"{key}.points={pts!r}: expected [[replicas, samples_per_s], ...]")
        out: list[tuple[int, float]] = []
        for i, p in enumerate(pts):
            if not (isinstance(p, list | tuple) and len(p) == 2):
                raise ConfigError(f"{key}.points[{i}]={p!r}: expected [replicas, samples_per_s]")
            out.append((integer(f"{key}.points[{i}]", p[0], 1), number(f"{key}.points[{i}]", p[1])))
        out.sort()
        if len({w for w, _ in out}) != len(out):
            raise ConfigError(f"{key}.points: a replica count appears twice")
        return Curve(points=tuple(out))
    return Curve(
        per_replica=number(f"{key}.per_replica", raw.get("per_replica", 100.0), 1e-9),
        serial=number(f"{key}.serial", raw.get("serial", 0.0), 0.0, 1.0),
        comm=number(f"{key}.comm", raw.get("comm", 0.0), 0.0, 10.0),
    )


@dataclass(frozen=True)
class Daily:
    """A value by time of day, linear between ``(hour, value)`` points, wrapping at midnight."""

    points: tuple[tuple[float, float], ...]

    def at(self, t_s: float) -> float:
        h = (t_s % DAY_S) / 3600.0
        pts = self.points
        if len(pts) == 1:
            return pts[0][1]
        prev_h, prev_v = pts[-1][0] - 24.0, pts[-1][1]
        for ph, pv in pts:
            if h < ph:
                return prev_v + (pv - prev_v) * (h - prev_h) / (ph - prev_h)
            prev_h, prev_v = ph, pv
        nh, nv = pts[0][0] + 24.0, pts[0][1]
        return prev_v + (nv - prev_v) * (h - prev_h) / (nh - prev_h)


def parse_daily(key: str, raw: Any) -> Daily:
    if isinstance(raw, int | float) and not isinstance(raw, bool):
        return Daily(((0.0, number(key, raw)),))
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{key}={raw!r}: expected a number or [[hour, value], ...]")
    pts = []
    for i, p in enumerate(raw):
        if not (isinstance(p, list | tuple) and len(p) == 2):
            raise ConfigError(f"{key}[{i}]={p!r}: expected [hour, value]")
        pts.append((number(f"{key}[{i}]", p[0], 0.0, 23.999), number(f"{key}[{i}]", p[1])))
    pts.sort()
    return Daily(tuple(pts))
