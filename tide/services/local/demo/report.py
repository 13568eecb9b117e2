"""What a demo run leaves a person: its outcome, the summary lines and the PNG chart.

Its own room because the report changes with what a person reads after a run (and
what tests/local/test_demo.py greps), not with how the run drives the load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from tide.base.timeconv import datetime_of
from tide.services.local.chart import Marker, Series, draw
from tide.services.local.demo.scenario import Phase
from tide.services.local.samples import SampleAudit
from tide.v1 import common_pb2, scaler_pb2

logger = logging.getLogger(__name__)


def state_name(v: int) -> str:
    return str(common_pb2.DecisionState.Name(v)).removeprefix("DECISION_STATE_")  # type: ignore[arg-type]


def reason_name(v: int) -> str:
    return str(common_pb2.DecisionReason.Name(v)).removeprefix("DECISION_REASON_")  # type: ignore[arg-type]


@dataclass
class Outcome:
    job_id: str
    phase: Phase
    elapsed_s: float
    decisions: list[scaler_pb2.DecisionDetail] = field(default_factory=list)
    audit: SampleAudit | None = None
    chart: Path | None = None
    error: str = ""

    @property
    def lost_steps(self) -> int:
        decided = sum(d.decision.lost_steps for d in self.decisions)
        redone = len(self.audit.repeated_steps) if self.audit else 0
        return decided + redone

    @property
    def ok(self) -> bool:
        return (
            self.phase is Phase.DONE
            and self.audit is not None
            and self.audit.exactly_once
            and self.lost_steps == 0
        )


def draw_chart(
    outcome: Outcome, timeline: list[tuple[datetime, float | None, int]], path: Path
) -> Path | None:
    """Utilization, replicas and the decisions over the run; None without a timeline or on a write error."""
    if not timeline:
        return None
    markers = []
    for d in outcome.decisions:
        created = datetime_of(d.decision.created_at)
        markers.append(
            Marker(
                created,
                f"#{d.decision.id} {d.decision.from_replicas}→{d.decision.to_replicas}",
                state_name(d.decision.state),
            )
        )
    series = Series(
        utilization=[(t, u) for t, u, _ in timeline if u is not None],
        utilization_band=[],
        replicas=[(t, r) for t, _, r in timeline if r],
        markers=markers,
    )
    try:
        return draw(
            series,
            path,
            title=f"tide demo {outcome.job_id}: GPU utilization, replicas, decisions",
            scale_up_pct=80.0,
            scale_down_pct=40.0,
        )
    except OSError as exc:
        logger.warning("demo %s: cannot write the chart: %s", outcome.job_id, exc)
        return None


def summary_lines(outcome: Outcome, state_dir: Path) -> list[str]:
    lines = [
        f"demo {outcome.job_id}: {'OK' if outcome.ok else 'FAILED'} in {outcome.elapsed_s:.0f} s"
        + (f" ({outcome.error})" if outcome.error else "")
    ]
    for detail in outcome.decisions:
        d = detail.decision
        t0 = datetime_of(d.created_at)
        trail = " → ".join(
            f"{state_name(e.state)} +{(datetime_of(e.at) - t0).total_seconds():.1f}s"
            for e in detail.events
        )
        lines.append(
            f"  decision {d.id}: {d.from_replicas} → {d.to_replicas} ({reason_name(d.reason)})"
            f" {state_name(d.state)}; pause {d.pause_s:.2f} s; lost steps {d.lost_steps}"
        )
        lines.append(f"    {trail}")
        if d.error:
            lines.append(f"    error: {d.error}")
    if not outcome.decisions:
        lines.append("  no decisions were made")
    lines.append(f"  lost steps: {outcome.lost_steps}")
    if outcome.audit is not None:
        lines.append(f"  {outcome.audit.summary()}")
        if outcome.audit.unfinished_steps:
            lines.append(
                f"    (steps {', '.join(map(str, outcome.audit.unfinished_steps))} were in"
                " flight when the demo stopped the job; not counted)"
            )
    else:
        lines.append("  no sample log to audit")
    if outcome.chart is not None:
        lines.append(f"  chart: {outcome.chart}")
    db = f"sqlite:///{(state_dir / 'tide.db').resolve()}"
    lines.append(f"  history: tide history {outcome.job_id} --db {db}")
    if outcome.decisions:
        lines.append(f"  explain: tide explain {outcome.decisions[0].decision.id} --db {db}")
    lines.append(f"  logs: {state_dir / 'logs'}")
    return lines
