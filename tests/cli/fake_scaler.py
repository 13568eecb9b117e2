"""An in-memory Scaler servicer with the API's semantics, served for real over gRPC.

It stands in for `python -m tide.services.scaler` in CLI and demo tests: jobs,
decisions with their events and rollups, paging, filters, admin calls behind
the common runtime's bearer-token check. It runs on its own event loop in a
thread, so synchronous tests (the CLI calls asyncio.run itself) can use it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from tide.base import errors
from tide.services.common.config import CommonSettings
from tide.services.common.rpc import rpc_errors
from tide.services.common.server import RunningServer, ServiceSpec, start_server
from tide.v1 import common_pb2, scaler_pb2, scaler_pb2_grpc

ADMIN = frozenset(
    {
        "/tide.v1.Scaler/UpsertJob",
        "/tide.v1.Scaler/RequestResize",
        "/tide.v1.Scaler/SetAutoscaling",
    }
)


def ts(dt: datetime) -> Timestamp:
    t = Timestamp()
    t.FromDatetime(dt)
    return t


@dataclass
class StoredDecision:
    decision: scaler_pb2.Decision
    inputs: scaler_pb2.DecisionInputs = field(default_factory=scaler_pb2.DecisionInputs)
    events: list[scaler_pb2.DecisionEvent] = field(default_factory=list)


class FakeScaler(scaler_pb2_grpc.ScalerServicer):
    def __init__(self) -> None:
        self.jobs: dict[str, scaler_pb2.Job] = {}
        self.decisions: dict[int, StoredDecision] = {}
        self.rollups: dict[str, list[scaler_pb2.UtilizationPoint]] = {}
        self.list_calls = 0
        #: The page_size of each ListDecisions call.
        self.page_sizes: list[int] = []
        self.utilization_calls: list[tuple[datetime, datetime]] = []
        self._next_id = 1

    # --- set-up helpers (called from the test thread before requests) ---

    def add_job(self, job_id: str, replicas: int = 2, lo: int = 2, hi: int = 8) -> None:
        job = scaler_pb2.Job(job_id=job_id, current_replicas=replicas, gpus_per_replica=1)
        job.policy.CopyFrom(
            scaler_pb2.Policy(
                scale_up_utilization_pct=80,
                scale_down_utilization_pct=40,
                sustain_s=300,
                bucket_s=30,
                cooldown_s=300,
                phase_timeout_s=60,
                min_replicas=lo,
                max_replicas=hi,
                min_coverage=0.8,
                max_step=4,
                scale_down_stabilization_s=60,
                target_utilization_pct=60,
            )
        )
        self.jobs[job_id] = job

    def add_decision(
        self,
        job_id: str,
        frm: int,
        to: int,
        at: datetime,
        *,
        reason: int = common_pb2.DECISION_REASON_SUSTAINED_HIGH_UTILIZATION,
        state: int = common_pb2.DECISION_STATE_COMPLETED,
        pause_s: float = 1.5,
        message: str = "",
    ) -> int:
        did = self._next_id
        self._next_id += 1
        d = scaler_pb2.Decision(
            id=did,
            job_id=job_id,
            from_replicas=frm,
            to_replicas=to,
            reason=reason,  # type: ignore[arg-type]
            trigger=common_pb2.DECISION_TRIGGER_POLICY,
            state=state,  # type: ignore[arg-type]
            message=message or f"every bucket above 80% for 300 s; {frm} → {to}",
            pause_s=pause_s if state == common_pb2.DECISION_STATE_COMPLETED else 0.0,
            generation=did + 1,
        )
        d.created_at.CopyFrom(ts(at))
        d.updated_at.CopyFrom(ts(at + timedelta(seconds=12)))
        stored = StoredDecision(d)
        stored.inputs.current_replicas = frm
        stored.inputs.raw_target_replicas = to
        stored.inputs.free_gpus = 4
        stored.inputs.policy.CopyFrom(self.jobs[job_id].policy)
        w = stored.inputs.window
        w.bucket_s = 30
        for mean in (91.0, 93.5, None, 95.0):
            if mean is None:
                w.buckets.add(empty=True)
            else:
                w.buckets.add(mean_pct=mean)
        w.coverage = 1.0
        w.gpus_expected = w.gpus_fresh = frm
        w.mean_pct = 93.2
        w.computed_at.CopyFrom(ts(at))
        for i, st in enumerate(
            (
                common_pb2.DECISION_STATE_PENDING,
                common_pb2.DECISION_STATE_PREPARING,
                common_pb2.DECISION_STATE_ACTUATING,
                state,
            )
        ):
            ev = scaler_pb2.DecisionEvent(
                decision_id=did,
                job_id=job_id,
                state=st,  # type: ignore[arg-type]
                detail=f"step {i}",
            )
            ev.at.CopyFrom(ts(at + timedelta(seconds=4 * i)))
            stored.events.append(ev)
        self.decisions[did] = stored
        return did

    def add_rollup(self, job_id: str, minute: datetime, mean: float, replicas: int) -> None:
        p = scaler_pb2.UtilizationPoint(
            mean_pct=mean, min_pct=mean - 5, max_pct=mean + 5, samples=120, replicas=replicas
        )
        p.minute.CopyFrom(ts(minute))
        self.rollups.setdefault(job_id, []).append(p)

    # --- the API ---

    def _job(self, job_id: str) -> scaler_pb2.Job:
        if job_id not in self.jobs:
            raise errors.NotFound(f"no job {job_id!r}")
        return self.jobs[job_id]

    @rpc_errors
    async def ListJobs(self, request: Any, context: Any) -> scaler_pb2.ListJobsResponse:
        return scaler_pb2.ListJobsResponse(jobs=[self.jobs[k] for k in sorted(self.jobs)])

    @rpc_errors
    async def GetJob(self, request: Any, context: Any) -> scaler_pb2.Job:
        return self._job(request.job_id)

    @rpc_errors
    async def ListDecisions(
        self, request: scaler_pb2.ListDecisionsRequest, context: Any
    ) -> scaler_pb2.ListDecisionsResponse:
        self.list_calls += 1
        self.page_sizes.append(request.page_size)
        if request.page_size > 1000:
            raise errors.InvalidArgument(f"page_size {request.page_size} > 1000")
        size = request.page_size or 100
        offset = int(request.page_token or 0)
        rows = [
            s.decision
            for s in self.decisions.values()
            if (not request.job_id or s.decision.job_id == request.job_id)
            and (
                not request.HasField("since")
                or s.decision.created_at.ToDatetime() >= request.since.ToDatetime()
            )
            and (
                not request.HasField("until")
                or s.decision.created_at.ToDatetime() < request.until.ToDatetime()
            )
            and (not request.states or s.decision.state in request.states)
        ]
        rows.sort(key=lambda d: (d.created_at.ToDatetime(), d.id), reverse=True)
        page = rows[offset : offset + size]
        more = offset + size < len(rows)
        return scaler_pb2.ListDecisionsResponse(
            decisions=page, next_page_token=str(offset + size) if more else ""
        )

    @rpc_errors
    async def GetDecision(
        self, request: scaler_pb2.GetDecisionRequest, context: Any
    ) -> scaler_pb2.DecisionDetail:
        stored = self.decisions.get(request.id)
        if stored is None:
            raise errors.NotFound(f"no decision {request.id}")
        span = timedelta(minutes=request.context_minutes or 10)
        at = stored.decision.created_at.ToDatetime()
        points = [
            p
            for p in self.rollups.get(stored.decision.job_id, [])
            if at - span <= p.minute.ToDatetime() < at + span
        ]
        return scaler_pb2.DecisionDetail(
            decision=stored.decision,
            inputs=stored.inputs,
            events=stored.events,
            utilization=points,
        )

    @rpc_errors
    async def ListUtilization(
        self, request: scaler_pb2.ListUtilizationRequest, context: Any
    ) -> scaler_pb2.ListUtilizationResponse:
        self._job(request.job_id)
        since, until = request.since.ToDatetime(), request.until.ToDatetime()
        self.utilization_calls.append((since, until))
        if not since < until or until - since > timedelta(days=7):
            raise errors.InvalidArgument(f"bad range {since}..{until}")
        points = [
            p
            for p in self.rollups.get(request.job_id, [])
            if since <= p.minute.ToDatetime() < until
        ]
        return scaler_pb2.ListUtilizationResponse(
            points=sorted(points, key=lambda p: p.minute.ToDatetime())
        )

    @rpc_errors
    async def RequestResize(
        self, request: scaler_pb2.RequestResizeRequest, context: Any
    ) -> scaler_pb2.Decision:
        job = self._job(request.job_id)
        if not request.reason:
            raise errors.InvalidArgument("reason is required")
        lo, hi = job.policy.min_replicas, job.policy.max_replicas
        if not lo <= request.replicas <= hi:
            raise errors.InvalidArgument(
                f"replicas {request.replicas} outside {lo}..{hi} of {request.job_id}"
            )
        if job.active_decision_id:
            raise errors.FailedPrecondition(
                f"decision {job.active_decision_id} of {request.job_id} is still running"
            )
        did = self.add_decision(
            request.job_id,
            job.current_replicas,
            request.replicas,
            datetime.now(tz=UTC),
            reason=common_pb2.DECISION_REASON_MANUAL,
            state=common_pb2.DECISION_STATE_PENDING,
            message=request.reason,
        )
        d = self.decisions[did].decision
        d.trigger = common_pb2.DECISION_TRIGGER_MANUAL
        d.requested_by = request.requested_by
        job.active_decision_id = did
        return d

    @rpc_errors
    async def SetAutoscaling(
        self, request: scaler_pb2.SetAutoscalingRequest, context: Any
    ) -> scaler_pb2.Job:
        job = self._job(request.job_id)
        if request.paused and not request.reason:
            raise errors.InvalidArgument("reason is required when pausing")
        job.autoscaling_paused = request.paused
        job.pause_reason = request.reason if request.paused else ""
        return job


@dataclass
class Served:
    scaler: FakeScaler
    port: int
    loop: asyncio.AbstractEventLoop

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class _Thread:
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro: Any, timeout_s: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        assert self.thread is not None
        self.thread.join(10)
        self.loop.close()


def serve_in_thread(scaler: FakeScaler, admin_token: str = "") -> Iterator[Served]:
    """Generator for a fixture: the fake served on 127.0.0.1:0 until the test ends."""
    t = _Thread()
    running: RunningServer = t.call(
        start_server(
            CommonSettings(listen="127.0.0.1:0", admin_token=admin_token),
            [ServiceSpec(scaler_pb2_grpc.add_ScalerServicer_to_server, scaler, "tide.v1.Scaler")],
            admin_methods=ADMIN,
        )
    )
    try:
        yield Served(scaler, running.port, t.loop)
    finally:
        t.call(running.stop(0))
        t.close()
