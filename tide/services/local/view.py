"""What `tide demo` shows while it runs: a live rich view on a terminal, plain lines otherwise.

Both are pure functions of a :class:`Snapshot`, which the demo builds twice a
second from the scaler's and the coordinator's APIs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from rich.console import Group
from rich.table import Table
from rich.text import Text


@dataclass(frozen=True)
class DecisionView:
    id: int
    from_replicas: int
    to_replicas: int
    reason: str
    state: str
    # Every state seen so far with its offset from the start of the demo, seconds.
    trail: tuple[tuple[str, float], ...]
    pause_s: float
    lost_steps: int
    error: str = ""


@dataclass(frozen=True)
class Snapshot:
    elapsed_s: float
    phase: str
    # What the demo asks the synthetic GPUs to report, percent.
    load_pct: float
    job_id: str
    replicas: int
    window_mean_pct: float | None
    coverage: float | None
    generation: int
    world_size: int
    step: int
    samples_per_s: float
    resize_phase: str
    last_evaluation: str
    decisions: tuple[DecisionView, ...] = field(default_factory=tuple)


def _pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.0f}%"


_SHORT_REASONS = {
    "SUSTAINED_HIGH_UTILIZATION": "high util",
    "SUSTAINED_LOW_UTILIZATION": "low util",
    "NODE_TERMINATION": "node leaving",
}


def render(s: Snapshot) -> Group:
    """The live view: the job, what the scaler thinks, and each decision's states.

    Laid out to stay readable in an 80-column terminal."""
    job = Table(show_edge=False, header_style="bold", title=f"tide demo  {s.elapsed_s:5.1f} s")
    for col in ("JOB", "PHASE", "LOAD", "UTIL", "PODS", "GEN", "WORLD", "STEP", "SAMPLES/S"):
        job.add_column(col, no_wrap=True)
    job.add_row(
        s.job_id,
        s.phase,
        _pct(s.load_pct),
        _pct(s.window_mean_pct),
        str(s.replicas),
        str(s.generation),
        str(s.world_size),
        str(s.step),
        f"{s.samples_per_s:.0f}",
    )
    status = Text(overflow="fold")
    if s.resize_phase:
        status.append("resize: ", style="bold")
        status.append(s.resize_phase + "\n")
    status.append("scaler: ", style="bold")
    status.append(s.last_evaluation or "-")
    parts: list[Table | Text] = [job, status]
    if s.decisions:
        dec = Table(show_edge=False, header_style="bold")
        dec.add_column("ID", no_wrap=True)
        dec.add_column("RESIZE", no_wrap=True)
        dec.add_column("WHY", no_wrap=True)
        dec.add_column("STATES (s since start)", overflow="fold")
        dec.add_column("PAUSE", no_wrap=True)
        dec.add_column("LOST", no_wrap=True)
        for d in s.decisions:
            dec.add_row(
                str(d.id),
                f"{d.from_replicas}→{d.to_replicas}",
                _SHORT_REASONS.get(d.reason, d.reason.lower()),
                trail_text(d.trail),
                f"{d.pause_s:.2f} s" if d.pause_s else "-",
                str(d.lost_steps),
            )
        parts.append(dec)
    else:
        parts.append(Text("no decisions yet", style="dim"))
    return Group(*parts)


def trail_text(trail: Sequence[tuple[str, float]]) -> str:
    return " → ".join(f"{state} {at:.1f}" for state, at in trail)


class PlainLines:
    """Progress for a pipe: a line when something changes, a status line every ``every_s``."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.every_s = every_s
        self._last_status = -math.inf
        self._phase = ""
        self._states: dict[int, str] = {}
        self._generation = -1

    def lines(self, s: Snapshot) -> list[str]:
        out: list[str] = []
        stamp = f"[{s.elapsed_s:6.1f}s]"
        if s.phase != self._phase:
            self._phase = s.phase
            out.append(f"{stamp} phase {s.phase}: synthetic GPU load {_pct(s.load_pct)}")
        for d in s.decisions:
            if self._states.get(d.id) != d.state:
                self._states[d.id] = d.state
                extra = ""
                if d.state == "COMPLETED":
                    extra = f", pause {d.pause_s:.2f} s, lost steps {d.lost_steps}"
                elif d.error:
                    extra = f": {d.error}"
                out.append(
                    f"{stamp} decision {d.id} {d.from_replicas}→{d.to_replicas}"
                    f" ({d.reason}): {d.state}{extra}"
                )
        if s.generation != self._generation:
            self._generation = s.generation
            out.append(f"{stamp} generation {s.generation}: world size {s.world_size}")
        if s.elapsed_s - self._last_status >= self.every_s:
            self._last_status = s.elapsed_s
            out.append(
                f"{stamp} replicas {s.replicas}, step {s.step}, {s.samples_per_s:.0f} samples/s,"
                f" GPU util {_pct(s.window_mean_pct)}"
                + (f", resize {s.resize_phase}" if s.resize_phase else "")
            )
        return out
