"""What the demo reads from the control plane: one Snapshot per poll, and the decisions' details.

Its own room because it follows the scaler's and the coordinator's read APIs (GetJob,
ListDecisions, GetJobStatus, GetDecision) and the view's Snapshot, not the scenario:
it keeps each decision's trail of states and the timeline the chart draws.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import grpc

from tide.base.timeconv import ts_from_datetime
from tide.services.local.demo.report import reason_name, state_name
from tide.services.local.demo.scenario import Phase
from tide.services.local.demo.settings import RPC_TIMEOUT_S
from tide.services.local.view import DecisionView, Snapshot
from tide.v1 import coordinator_pb2, scaler_pb2

logger = logging.getLogger(__name__)


class Poller:
    """Polls one job; keeps the last answers, each decision's trail and the timeline."""

    def __init__(self, job_id: str, started_at: datetime, elapsed: Callable[[], float]) -> None:
        self.job_id = job_id
        self.started_at = started_at
        self.elapsed = elapsed
        self.trails: dict[int, list[tuple[str, float]]] = {}
        # (time, window mean, replicas) per poll, for the chart.
        self.timeline: list[tuple[datetime, float | None, int]] = []
        # The last answers, kept when a poll fails so the view does not drop to zero.
        self._job: Any = None
        self._status: Any = None
        self._decisions: list[Any] = []

    async def poll(self, scaler: Any, coord: Any, phase: Phase, level_pct: float) -> Snapshot:
        """The job as the scaler and the coordinator see it now, in ``phase`` at ``level_pct``."""
        try:
            job = await scaler.GetJob(
                scaler_pb2.GetJobRequest(job_id=self.job_id), timeout=RPC_TIMEOUT_S
            )
            resp = await scaler.ListDecisions(
                scaler_pb2.ListDecisionsRequest(
                    job_id=self.job_id, since=ts_from_datetime(self.started_at), page_size=100
                ),
                timeout=RPC_TIMEOUT_S,
            )
            self._job = job
            self._decisions = sorted(resp.decisions, key=lambda d: d.id)
        except grpc.aio.AioRpcError as exc:
            logger.warning("demo %s: scaler poll failed: %s", self.job_id, exc.details())
        try:
            self._status = await coord.GetJobStatus(
                coordinator_pb2.GetJobStatusRequest(job_id=self.job_id), timeout=RPC_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            # The coordinator learns of the job when its first launcher registers: until
            # then NOT_FOUND is the expected answer, not a warning before the first line.
            if exc.code() is not grpc.StatusCode.NOT_FOUND:
                logger.warning("demo %s: coordinator poll failed: %s", self.job_id, exc.details())
        job, status, decisions = self._job, self._status, self._decisions
        now = self.elapsed()
        views = []
        for d in decisions:
            trail = self.trails.setdefault(d.id, [])
            state = state_name(d.state)
            if not trail or trail[-1][0] != state:
                trail.append((state, now))
            views.append(
                DecisionView(
                    d.id,
                    d.from_replicas,
                    d.to_replicas,
                    reason_name(d.reason),
                    state,
                    tuple(trail),
                    d.pause_s,
                    d.lost_steps,
                    d.error,
                )
            )
        mean = (
            job.window.mean_pct
            if job is not None and job.HasField("window") and job.window.HasField("mean_pct")
            else None
        )
        mean = mean if mean is not None and math.isfinite(mean) else None
        ev = job.last_evaluation if job is not None else None
        resize = ""
        if status is not None and status.HasField("active_resize"):
            ar = status.active_resize
            if ar.phase and ar.phase < coordinator_pb2.RESIZE_PHASE_COMPLETED:
                resize = str(coordinator_pb2.ResizePhase.Name(ar.phase)).removeprefix(
                    "RESIZE_PHASE_"
                )
        replicas = job.current_replicas if job is not None else 0
        self.timeline.append((datetime.now(tz=UTC), mean, replicas))
        return Snapshot(
            elapsed_s=now,
            phase=phase.value,
            load_pct=level_pct,
            job_id=self.job_id,
            replicas=replicas,
            window_mean_pct=mean,
            coverage=job.window.coverage if job is not None and job.HasField("window") else None,
            generation=status.generation if status is not None else 0,
            world_size=status.world_size if status is not None else 0,
            step=status.step if status is not None else 0,
            samples_per_s=status.samples_per_s if status is not None else 0.0,
            resize_phase=resize,
            last_evaluation=(
                f"{reason_name(ev.reason)}: {ev.message}" if ev is not None and ev.reason else ""
            ),
            decisions=tuple(views),
        )

    async def details(self, scaler: Any) -> list[Any]:
        out = []
        for did in sorted(self.trails):
            out.append(
                await scaler.GetDecision(
                    scaler_pb2.GetDecisionRequest(id=did, context_minutes=5),
                    timeout=RPC_TIMEOUT_S,
                )
            )
        return out
