"""PNG charts of a simulation: GPUs over time, each job's replicas, and the totals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tide.services.sim.report import Comparison

DAY_H = 24.0
#: At most this many days are drawn on the time charts (a month of steps is unreadable).
MAX_DAYS = 4.0
COLORS = {"static": "#7f7f7f", "hpa": "#d62728", "tide": "#1f77b4", "tide-fcfs": "#17becf"}


def draw(c: Comparison, out_dir: Path) -> list[Path]:
    """Write gpus.png, replicas.png and summary.png into ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    name = c.scenario["name"] + (f" ({c.scenario['variant']})" if c.scenario["variant"] else "")
    horizon_h = min(c.scenario["duration_s"] / 3600.0, MAX_DAYS * DAY_H)
    paths = []

    fig, ax = plt.subplots(figsize=(11, 4.5))
    for o in c.outcomes:
        sim = c.sims[o.policy]
        pts = [(t / 3600.0, g) for t, g, _ in sim.timeline if t / 3600.0 <= horizon_h]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.step(xs, ys, where="post", label=o.policy, color=COLORS.get(o.policy))
    bg = c.sims[c.outcomes[0].policy].timeline if c.outcomes else []
    bg_pts = [(t / 3600.0, b) for t, _, b in bg if t / 3600.0 <= horizon_h]
    if bg_pts and any(b for _, b in bg_pts):
        xs, ys = zip(*bg_pts, strict=True)
        ax.step(xs, ys, where="post", label="other tenants", color="#bbbbbb", linestyle=":")
    ax.set(xlabel="hours", ylabel="GPUs held by the jobs", title=f"{name}: GPUs over time")
    ax.legend(loc="upper right")
    paths.append(_save(fig, out_dir / "gpus.png", plt))

    runs = c.sims[c.outcomes[0].policy].runs if c.outcomes else []
    shown = [r.name for r in runs if r.spec.arrive_s / 3600.0 <= horizon_h][:3]
    fig, axes = plt.subplots(
        len(shown) or 1, 1, figsize=(11, 2.6 * max(1, len(shown))), squeeze=False
    )
    for ax, job in zip(axes[:, 0], shown, strict=False):
        for o in c.outcomes:
            r = c.sims[o.policy].by_name[job]
            pts = [(t / 3600.0, w) for t, w in r.worlds if t / 3600.0 <= horizon_h]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.step(xs, ys, where="post", label=o.policy, color=COLORS.get(o.policy))
        ax.set(ylabel="replicas", title=f"{job}: replicas training")
        ax.legend(loc="upper right")
    axes[-1, 0].set_xlabel("hours")
    paths.append(_save(fig, out_dir / "replicas.png", plt))

    fig, axes = plt.subplots(1, 4, figsize=(13, 3.6))
    metrics: list[tuple[str, Any]] = [
        ("mean job completion (h)", lambda o: o.mean_jct_h),
        ("cost", lambda o: o.cost),
        ("lost steps", lambda o: o.lost_steps),
        ("resizes (flaps hatched)", lambda o: o.resizes),
    ]
    labels = [o.policy for o in c.outcomes]
    for ax, (title, get) in zip(axes, metrics, strict=True):
        values = [get(o) for o in c.outcomes]
        ax.bar(labels, values, color=[COLORS.get(p, "#999999") for p in labels])
        if title.startswith("resizes"):
            ax.bar(labels, [o.flaps for o in c.outcomes], color="none", hatch="//", edgecolor="k")
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelrotation=30)
    fig.suptitle(name)
    paths.append(_save(fig, out_dir / "summary.png", plt))
    return paths


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw_replay(h: Any, runs: list[tuple[str, Any]], out: Path, points: list[Any]) -> Path:
    """`tide whatif --chart`: utilization on top, replicas recorded and replayed below, over
    the stretch of the range the job has data or decisions in."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tide.services.sim.replay import real_replicas

    times = [s.t_s for s in h.seconds] + [
        d.created_s for d in h.decisions if d.created_s >= h.start_s
    ]
    lo = max(h.start_s, min(times, default=h.start_s))
    hi = min(h.end_s, max([s.t_s + s.length_s for s in h.seconds], default=h.end_s))
    span = max(hi - lo, 1.0)
    lo, hi = max(h.start_s, lo - 0.05 * span), min(h.end_s, hi + 0.05 * span)
    unit, div = ("minutes", 60.0) if hi - lo <= 3 * 3600 else ("hours", 3600.0)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    util = [((s.t_s - lo) / div, s.mean_pct) for s in h.seconds if s.samples > 0]
    if util:
        top.plot([x for x, _ in util], [y for _, y in util], color="#555555", linewidth=0.8)
    top.set(ylabel="GPU utilization %", ylim=(0, 105), title=f"{h.job_id}: what if")
    lines = [("recorded", real_replicas(h), "#333333", "-")]
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c"]
    for (name, r), color in zip(runs, palette, strict=False):
        lines.append((name, r.replicas, color, "--"))
    for name, steps, color, style in lines:
        hx = [(t - lo) / div for t, _ in steps] + [(hi - lo) / div]
        ny = [n for _, n in steps] + [steps[-1][1]]
        bottom.step(hx, ny, where="post", label=name, color=color, linestyle=style)
    bottom.set(xlim=(0, (hi - lo) / div), ylabel="replicas")
    bottom.set_xlabel(f"{unit} from {_utc(lo)} UTC")
    bottom.legend(loc="upper right")
    return _save(fig, out, plt)


def _utc(t: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(t, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")
