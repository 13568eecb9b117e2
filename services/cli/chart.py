"""`tide chart`'s data: a job's history (rollups and decisions) as the chart's series.

The drawing is services/local/chart.py's, shared with `tide demo`."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from tide.v1 import common_pb2, scaler_pb2

from services.cli.render import reason_name, state_name
from services.local.chart import Marker, Series
from tidebase.timeconv import field_datetime


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
