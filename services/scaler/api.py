"""The Scaler gRPC API: a thin servicer over :class:`ScalerCore` and the store.

Conversions between records and tide.v1 messages are services.scaler.convert's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, timedelta
from typing import Any

import grpc
from tide.v1 import common_pb2, scaler_pb2, scaler_pb2_grpc

from services.common.rpc import rpc_errors
from services.scaler.convert import (
    decision_to_proto,
    inputs_to_proto,
    point_to_proto,
    policy_from_proto,
    policy_to_proto,
    window_to_proto,
)
from services.scaler.lifecycle import state_from_proto, state_to_proto
from services.scaler.repo import JobRecord
from services.scaler.service import ScalerCore
from services.store.db import utc_from_epoch
from tidebase.errors import InvalidArgument
from tidebase.timeconv import ts_from_datetime, ts_from_seconds

Ctx = grpc.aio.ServicerContext[Any, Any]

#: Admin calls: the common server checks the bearer token on these.
ADMIN_METHODS = frozenset(
    {
        "/tide.v1.Scaler/UpsertJob",
        "/tide.v1.Scaler/RequestResize",
        "/tide.v1.Scaler/SetAutoscaling",
    }
)

#: ListUtilization: the range when `since` is unset, and the longest one call may span
#: (one week of minutes, 10,080 points; proto/tide/v1/scaler.proto).
DEFAULT_UTILIZATION_RANGE = timedelta(hours=24)
MAX_UTILIZATION_RANGE = timedelta(days=7)


class ScalerServicer(scaler_pb2_grpc.ScalerServicer):
    def __init__(self, core: ScalerCore) -> None:
        self.core = core

    def _job(self, job: JobRecord) -> scaler_pb2.Job:
        core = self.core
        p = core.policies.get(job.job_id) or core.policy_of(job)
        now = core.clock.now()
        msg = scaler_pb2.Job(
            job_id=job.job_id,
            policy=policy_to_proto(p),
            current_replicas=job.current_replicas,
            generation=job.generation,
            autoscaling_paused=job.autoscaling_paused,
            pause_reason=job.pause_reason,
            window=window_to_proto(core.window_of(job.job_id, now), now),
            active_decision_id=core.active.get(job.job_id, 0),
            gpus_per_replica=job.gpus_per_replica,
            created_at=ts_from_datetime(job.created_at),
            last_resize_at=ts_from_datetime(job.last_resize_ended_at),
        )
        status = core.coordinator.latest_status(job.job_id)
        if status is not None:
            msg.step = status.step
            msg.samples_per_s = status.samples_per_s
            msg.generation = max(msg.generation, status.generation)
        ev = core.evaluations.get(job.job_id)
        if ev is not None:
            msg.last_evaluation.CopyFrom(
                scaler_pb2.Evaluation(
                    reason=common_pb2.DecisionReason.ValueType(ev.decision.reason.value),
                    message=ev.decision.message,
                    at=ts_from_seconds(ev.at_s),
                )
            )
        return msg

    @rpc_errors
    async def ListJobs(
        self, request: scaler_pb2.ListJobsRequest, context: Ctx
    ) -> scaler_pb2.ListJobsResponse:
        jobs = [self._job(j) for _, j in sorted(self.core.jobs.items())]
        return scaler_pb2.ListJobsResponse(jobs=jobs)

    @rpc_errors
    async def GetJob(self, request: scaler_pb2.GetJobRequest, context: Ctx) -> scaler_pb2.Job:
        return self._job(self.core._job(request.job_id))

    @rpc_errors
    async def UpsertJob(self, request: scaler_pb2.UpsertJobRequest, context: Ctx) -> scaler_pb2.Job:
        overrides = policy_from_proto(request.policy)
        job = await self.core.upsert_job(
            request.job_id,
            overrides,
            initial_replicas=request.initial_replicas,
            gpus_per_replica=request.gpus_per_replica,
        )
        return self._job(job)

    @rpc_errors
    async def ListDecisions(
        self, request: scaler_pb2.ListDecisionsRequest, context: Ctx
    ) -> scaler_pb2.ListDecisionsResponse:
        try:
            states = tuple(state_from_proto(s) for s in request.states)
        except KeyError:
            raise InvalidArgument(f"unknown decision state in {list(request.states)}") from None
        page = await self.core.store.list_decisions(
            job_id=request.job_id,
            since=request.since.ToDatetime(tzinfo=UTC) if request.HasField("since") else None,
            until=request.until.ToDatetime(tzinfo=UTC) if request.HasField("until") else None,
            states=states,
            page_size=request.page_size or 100,
            page_token=request.page_token,
        )
        return scaler_pb2.ListDecisionsResponse(
            decisions=[decision_to_proto(d) for d in page.decisions],
            next_page_token=page.next_page_token,
        )

    @rpc_errors
    async def GetDecision(
        self, request: scaler_pb2.GetDecisionRequest, context: Ctx
    ) -> scaler_pb2.DecisionDetail:
        if request.context_minutes > 1440:
            raise InvalidArgument(f"context_minutes={request.context_minutes}: must be 0..1440")
        minutes = request.context_minutes or 10
        detail = await self.core.store.get_decision(request.id)
        d = detail.decision
        end = d.ended_at or d.updated_at
        rollups = await self.core.store.rollups_between(
            d.job_id,
            d.created_at - timedelta(minutes=minutes),
            end + timedelta(minutes=minutes),
        )
        return scaler_pb2.DecisionDetail(
            decision=decision_to_proto(d),
            inputs=inputs_to_proto(d.inputs),
            events=[
                scaler_pb2.DecisionEvent(
                    decision_id=e.decision_id,
                    job_id=d.job_id,
                    state=state_to_proto(e.state),
                    at=ts_from_datetime(e.at),
                    detail=e.detail,
                )
                for e in detail.events
            ],
            utilization=[point_to_proto(r) for r in rollups],
        )

    @rpc_errors
    async def ListUtilization(
        self, request: scaler_pb2.ListUtilizationRequest, context: Ctx
    ) -> scaler_pb2.ListUtilizationResponse:
        self.core._job(request.job_id)  # NotFound for a job the scaler does not know
        until = (
            request.until.ToDatetime(tzinfo=UTC)
            if request.HasField("until")
            else utc_from_epoch(self.core.clock.now())
        )
        since = (
            request.since.ToDatetime(tzinfo=UTC)
            if request.HasField("since")
            else until - DEFAULT_UTILIZATION_RANGE
        )
        if not since < until:
            raise InvalidArgument(
                f"since={since.isoformat()} must be before until={until.isoformat()}"
            )
        if until - since > MAX_UTILIZATION_RANGE:
            # At most one week of minutes per answer (the API's bound); a longer range
            # is asked for in parts rather than cut short without a word.
            raise InvalidArgument(
                f"since..until spans {until - since}; at most {MAX_UTILIZATION_RANGE} per call"
            )
        rows = await self.core.store.rollups_between(request.job_id, since, until)
        return scaler_pb2.ListUtilizationResponse(points=[point_to_proto(r) for r in rows])

    @rpc_errors
    async def RequestResize(
        self, request: scaler_pb2.RequestResizeRequest, context: Ctx
    ) -> scaler_pb2.Decision:
        d = await self.core.request_resize(
            request.job_id, request.replicas, request.reason, request.requested_by
        )
        return decision_to_proto(d)

    @rpc_errors
    async def SetAutoscaling(
        self, request: scaler_pb2.SetAutoscalingRequest, context: Ctx
    ) -> scaler_pb2.Job:
        job = await self.core.set_autoscaling(request.job_id, request.paused, request.reason)
        return self._job(job)

    @rpc_errors
    async def WatchDecisions(
        self, request: scaler_pb2.WatchDecisionsRequest, context: Ctx
    ) -> AsyncIterator[scaler_pb2.DecisionEvent]:
        q = self.core.subscribe(request.job_id)
        # Headers go out once subscribed: a client that awaits them knows no
        # later change can be missed.
        await context.send_initial_metadata(())
        try:
            while True:
                item = await q.get()
                if item is None:
                    return
                d = item.decision
                yield scaler_pb2.DecisionEvent(
                    decision_id=d.id,
                    job_id=d.job_id,
                    state=state_to_proto(d.state),
                    at=ts_from_datetime(d.updated_at),
                    detail=item.detail,
                    decision=decision_to_proto(d),
                )
        finally:
            self.core.unsubscribe(q)


__all__ = ["ADMIN_METHODS", "ScalerServicer"]
