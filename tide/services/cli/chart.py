"""`tide chart`: a job's history (rollups and decisions) drawn to a PNG.

The drawing is tide/services/local/chart.py's, shared with `tide demo`; this module
turns what the scaler (or the store) answers into its series."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from tide.base.timeconv import field_datetime
from tide.services.cli.app import Exit, fail, now_utc, time_option
from tide.services.cli.connection import Connection, connection_options
from tide.services.cli.render import reason_name, state_name
from tide.services.cli.timeparse import iso
from tide.services.local.chart import Marker, Series
from tide.v1 import common_pb2, scaler_pb2


def series_from_history(
    points: Sequence[scaler_pb2.UtilizationPoint], decisions: Sequence[scaler_pb2.Decision]
) -> Series:
    util: list[tuple[datetime, float]] = []
    band: list[tuple[datetime, float, float]] = []
    reps: list[tuple[datetime, int]] = []
    for p in points:
        t = field_datetime(p, "minute")
        if t is None:
            continue
        util.append((t, p.mean_pct))
        band.append((t, p.min_pct, p.max_pct))
        reps.append((t, p.replicas))
    markers = []
    for d in sorted(decisions, key=lambda d: (d.created_at.seconds, d.id)):
        t = field_datetime(d, "created_at")
        if t is None:
            continue
        markers.append(
            Marker(
                t,
                f"#{d.id} {d.from_replicas}→{d.to_replicas} {reason_name(d.reason).lower()}",
                state_name(d.state),
            )
        )
        # The rollups say replicas at the end of each minute; the decisions say
        # exactly when they changed, which matters on a short chart.
        if d.state == common_pb2.DECISION_STATE_COMPLETED:
            end = field_datetime(d, "updated_at") or t
            reps.append((end, d.to_replicas))
    reps.sort(key=lambda r: r[0])
    return Series(util, band, reps, markers)


@connection_options(db=True)
def chart_cmd(
    conn: Connection,
    job: Annotated[str, typer.Argument(help="NAMESPACE/NAME")],
    out: Annotated[Path, typer.Option("--out", help="PNG file to write")],
    since: Annotated[str, typer.Option(help="24h, 7d, or an ISO time")] = "24h",
    until: Annotated[str | None, typer.Option(help="end of the range; default now")] = None,
) -> None:
    """Draw utilization, replicas and decision markers of a job to a PNG."""
    if importlib.util.find_spec("matplotlib") is None:
        fail(Exit.USAGE, "tide chart needs matplotlib: pip install 'tide[demo]'")
    from tide.services.local.chart import draw

    lo = time_option("--since", since)
    hi = time_option("--until", until) or now_utc()
    assert lo is not None  # since always has a value
    if lo >= hi:
        fail(Exit.USAGE, f"--since ({since}) must be before --until ({until})")
    if out.suffix.lower() != ".png":
        fail(Exit.USAGE, f"--out: expected a .png file, got {str(out)!r}")

    async def go(src: Any) -> tuple[Any, list[Any], list[Any]]:
        j = await src.get_job(job)
        return j, await src.utilization(job, lo, hi), await src.list_decisions(job, lo, hi, ())

    j, points, decisions = conn.read(go)
    try:
        draw(
            series_from_history(points, decisions),
            out,
            title=f"{job}  {iso(lo)} .. {iso(hi)}",
            scale_up_pct=j.policy.scale_up_utilization_pct or None,
            scale_down_pct=j.policy.scale_down_utilization_pct or None,
        )
    except OSError as exc:
        fail(Exit.USAGE, f"--out: cannot write {str(out)!r}: {exc.strerror}")
    typer.echo(f"wrote {out} ({len(points)} minutes, {len(decisions)} decisions)")
