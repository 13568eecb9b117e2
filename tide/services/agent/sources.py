"""Where GPU readings come from: one interface, three sources.

``sample()`` may block (NVML talks to the driver), so the agent always calls it
from its sampling thread, never on the event loop. NVML lives in ``nvml.py``.
"""

from __future__ import annotations

import bisect
import csv
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tide.base.errors import ConfigError
from tide.services.common.clock import Clock

from .errors import SourceError
from .model import GpuReading, HealthFlag

logger = logging.getLogger(__name__)

GIB = 1024**3


class Source(Protocol):
    def open(self) -> int:
        """Prepare; returns how many GPUs the node has. Raises SourceError."""
        ...

    def sample(self) -> list[GpuReading]:
        """One reading per GPU, every GPU every time (a failing one is flagged)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Profile:
    """Utilization (percent) as a function of seconds since start."""

    kind: str
    low: float
    high: float
    period_s: float

    def at(self, t: float) -> float:
        if self.kind == "steady":
            return self.low
        if self.kind == "ramp":
            frac = min(1.0, max(0.0, t / self.period_s))
            return self.low + (self.high - self.low) * frac
        # square: low for one period, high for the next
        return self.high if int(t // self.period_s) % 2 else self.low

    @staticmethod
    def parse(text: str) -> Profile:
        parts = text.split(":")
        try:
            nums = [float(p) for p in parts[1:]]
        except ValueError:
            raise ConfigError(f"synthetic_profile: numbers expected, got {text!r}") from None
        if parts[0] == "steady" and len(nums) == 1:
            profile = Profile("steady", nums[0], nums[0], 1.0)
        elif parts[0] in ("ramp", "square") and len(nums) == 3:
            profile = Profile(parts[0], nums[0], nums[1], nums[2])
        else:
            raise ConfigError(
                "synthetic_profile: expected steady:PCT, ramp:FROM:TO:SECONDS or"
                f" square:LO:HI:SECONDS, got {text!r}"
            )
        if not (0 <= profile.low <= 100 and 0 <= profile.high <= 100) or profile.period_s <= 0:
            raise ConfigError(
                f"synthetic_profile: percentages 0..100 and SECONDS > 0, got {text!r}"
            )
        return profile


def _plausible(index: int, uuid: str, util: float) -> GpuReading:
    """Memory, power and temperature that move with utilization, like an H100's."""
    total = 80 * GIB
    return GpuReading(
        index=index,
        uuid=uuid,
        utilization_pct=util,
        memory_used_bytes=int(total * (0.1 + 0.8 * util / 100)),
        memory_total_bytes=total,
        power_w=70.0 + 6.3 * util,
        temperature_c=32.0 + 0.45 * util,
    )


class SyntheticSource:
    """Scripted load: every GPU follows the profile, GPU i offset by i × 0.5 %."""

    def __init__(self, profile: Profile, gpus: int, clock: Clock, node_name: str = "node") -> None:
        self._profile = profile
        self._gpus = gpus
        self._clock = clock
        self._node = node_name
        self._start = 0.0

    def open(self) -> int:
        self._start = self._clock.monotonic()
        return self._gpus

    def sample(self) -> list[GpuReading]:
        t = self._clock.monotonic() - self._start
        util = self._profile.at(t)
        return [
            _plausible(i, f"GPU-synthetic-{self._node}-{i}", min(100.0, util + 0.5 * i))
            for i in range(self._gpus)
        ]

    def close(self) -> None:
        pass


_FIELDS: dict[str, type] = {
    "index": int,
    "uuid": str,
    "utilization_pct": float,
    "memory_used_bytes": int,
    "memory_total_bytes": int,
    "power_w": float,
    "temperature_c": float,
    "health_flags": int,
}


def _reading_from_row(row: dict[str, Any], where: str) -> tuple[float, GpuReading]:
    try:
        t = float(row["t"])
        values: dict[str, Any] = {}
        for name, tp in _FIELDS.items():
            raw = row.get(name)
            if raw is None or raw == "":
                continue
            values[name] = tp(float(raw)) if tp is int else tp(raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise SourceError(f"replay trace {where}: bad row {row!r} ({exc})") from None
    if "index" not in values:
        raise SourceError(f"replay trace {where}: row without index: {row!r}")
    flags = HealthFlag(values.pop("health_flags", 0) & 0xF)
    values.setdefault("uuid", f"GPU-replay-{values['index']}")
    return t, GpuReading(health=flags, **values)


class ReplaySource:
    """Plays a recorded trace back in real time (by ``clock``).

    One row per GPU per instant; ``t`` is seconds (from the start of the trace,
    or epoch seconds: only differences matter). JSONL rows may also carry a
    ``gpus`` list instead of the per-GPU fields. CSV has a header row with the
    same names: t,index,uuid,utilization_pct,memory_used_bytes,
    memory_total_bytes,power_w,temperature_c,health_flags.
    """

    def __init__(self, path: str | Path, clock: Clock, loop: bool = True) -> None:
        self._path = Path(path)
        self._clock = clock
        self._loop = loop
        self._times: list[float] = []
        self._frames: list[list[GpuReading]] = []
        self._start = 0.0
        self._gpus = 0

    def _rows(self) -> list[tuple[float, GpuReading]]:
        try:
            text = self._path.read_text()
        except OSError as exc:
            raise SourceError(f"replay trace {self._path}: cannot read ({exc.strerror})") from None
        rows: list[tuple[float, GpuReading]] = []
        if self._path.suffix.lower() == ".csv":
            for n, row in enumerate(csv.DictReader(text.splitlines()), start=2):
                rows.append(_reading_from_row(row, f"{self._path}:{n}"))
            return rows
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{self._path}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SourceError(f"replay trace {where}: not JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise SourceError(f"replay trace {where}: expected an object")
            if "gpus" in obj:
                for gpu in obj["gpus"]:
                    rows.append(_reading_from_row({"t": obj.get("t"), **gpu}, where))
            else:
                rows.append(_reading_from_row(obj, where))
        return rows

    def open(self) -> int:
        rows = self._rows()
        if not rows:
            raise SourceError(f"replay trace {self._path}: no rows")
        by_t: dict[float, dict[int, GpuReading]] = {}
        for t, reading in rows:
            by_t.setdefault(t, {})[reading.index] = reading
        t0 = min(by_t)
        self._times = [t - t0 for t in sorted(by_t)]
        self._frames = [sorted(by_t[t].values(), key=lambda r: r.index) for t in sorted(by_t)]
        self._gpus = max(len(f) for f in self._frames)
        self._start = self._clock.monotonic()
        logger.info(
            "replaying %s: %d instants over %.1f s, %d GPUs",
            self._path,
            len(self._times),
            self._times[-1],
            self._gpus,
        )
        return self._gpus

    def sample(self) -> list[GpuReading]:
        t = self._clock.monotonic() - self._start
        # A trace of length L loops with period L + its last step (or 1 s).
        step = self._times[-1] - self._times[-2] if len(self._times) > 1 else 1.0
        period = self._times[-1] + step
        if self._loop and t >= period:
            t = math.fmod(t, period)
        i = max(0, bisect.bisect_right(self._times, t) - 1)
        return list(self._frames[i])

    def close(self) -> None:
        pass
