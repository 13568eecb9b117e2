"""One PNG of a job: GPU utilization, replicas, and where decisions happened.

Drawn by `tide demo` (the per-second samples it watched) and by `tide chart`
(per-minute rollups from the scaler or the store; tide/services/cli turns those into a
:class:`Series`). It lives here, below the CLI, so local mode need not import
upwards. Matplotlib runs on the Agg backend: no display is needed, in CI or over SSH.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path


@dataclass(frozen=True)
class Marker:
    """A decision on the time axis."""

    at: datetime
    label: str
    final_state: str


@dataclass(frozen=True)
class Series:
    utilization: Sequence[tuple[datetime, float]]
    #: Mean ± spread of each point, when known (per-minute min and max).
    utilization_band: Sequence[tuple[datetime, float, float]]
    replicas: Sequence[tuple[datetime, int]]
    markers: Sequence[Marker]


_STATE_COLOR = {"COMPLETED": "tab:green", "ABORTED": "tab:orange", "FAILED": "tab:red"}


def draw(
    series: Series,
    out: Path,
    *,
    title: str,
    scale_up_pct: float | None = None,
    scale_down_pct: float | None = None,
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    fig, (ax_u, ax_r) = plt.subplots(
        2, 1, figsize=(10, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    try:
        if series.utilization:
            ts, us = zip(*series.utilization, strict=True)
            ax_u.plot(ts, us, color="tab:blue", label="GPU utilization (mean)")
        if series.utilization_band:
            bt, lo, hi = zip(*series.utilization_band, strict=True)
            ax_u.fill_between(bt, lo, hi, color="tab:blue", alpha=0.15, label="min..max")
        if scale_up_pct is not None:
            ax_u.axhline(scale_up_pct, color="tab:red", ls="--", lw=0.8, label="scale up above")
        if scale_down_pct is not None:
            ax_u.axhline(
                scale_down_pct, color="tab:purple", ls="--", lw=0.8, label="scale down below"
            )
        ax_u.set_ylim(0, 105)
        ax_u.set_ylabel("utilization %")
        ax_u.set_title(title)

        if series.replicas:
            rt, rv = zip(*series.replicas, strict=True)
            ax_r.step(rt, rv, where="post", color="black", label="replicas")
            ax_r.set_ylim(0, max(rv) + 1)
        ax_r.set_ylabel("replicas")
        ax_r.yaxis.get_major_locator().set_params(integer=True)

        for m in series.markers:
            color = _STATE_COLOR.get(m.final_state, "tab:gray")
            for ax in (ax_u, ax_r):
                ax.axvline(m.at, color=color, lw=1, alpha=0.8)
            ax_u.annotate(
                f"{m.label} ({m.final_state.lower()})",
                xy=(m.at, 102),
                fontsize=7,
                rotation=90,
                va="top",
                ha="right",
                color=color,
            )
        ax_r.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))  # type: ignore[no-untyped-call]
        ax_r.set_xlabel("time (UTC)")
        ax_u.legend(loc="lower left", fontsize=7)
        fig.tight_layout()
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)
    return out
