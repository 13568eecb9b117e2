"""The scaler's gRPC edge: the Scaler API over :class:`ScalerCore` and the store,
and the Telemetry API over :class:`Ingest`. Thin: validate, decode, call
one domain function, encode; conversions between records and tide.v1 messages
are tide.services.scaler.convert's. The Telemetry API is tide.services.scaler.telemetry's
(re-exported here).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import grpc

from tide.base.errors import InvalidArgument
from tide.base.timeconv import field_datetime, ts_from_datetime, ts_from_seconds
from tide.services.common.guard import Kind, Role, Rule, Subject, caller, requested_by
from tide.services.common.rpc import rpc_errors
from tide.services.scaler.convert import (
    decision_row_to_proto,
    decision_to_proto,
    detail_to_proto,
    point_to_proto,
    policy_from_proto,
    policy_to_proto,
    window_to_proto,
)
from tide.services.scaler.engine.core import ScalerCore
from tide.services.scaler.lifecycle import state_from_proto, state_to_proto
from tide.services.scaler.peers import notice_from_proto, partial_from_proto
from tide.services.scaler.store import JobRecord
from tide.services.scaler.telemetry import TelemetryServicer
from tide.services.store.db import utc_from_epoch
from tide.v1 import (
    common_pb2,
    peers_pb2,
    peers_pb2_grpc,
    scaler_pb2,
    scaler_pb2_grpc,
)

logger = logging.getLogger(__name__)

Ctx = grpc.aio.ServicerContext[Any, Any]

_SCALER = "/tide.v1.Scaler/"
#: Who may call what (tide.services.common.guard): agents stream telemetry for their own
#: node only; the Scaler API has viewer, operator and admin roles.
RULES = {
    "/tide.v1.Telemetry/Stream": Rule(
        frozenset({Kind.AGENT}), subject=lambda r: Subject(node=r.node_name)
    ),
    # Reads also for the scaler's own identity: `kubectl exec deploy/<release>-scaler --
    # tide history ...` runs the CLI with the pod's token (docs/install.md).
    **{
        _SCALER + m: Rule(frozenset({Kind.SCALER}), role=Role.VIEWER)
        for m in (
            "ListJobs",
            "GetJob",
            "ListDecisions",
            "GetDecision",
            "ListUtilization",
            "WatchDecisions",
        )
    },
    **{_SCALER + m: Rule(role=Role.OPERATOR) for m in ("RequestResize", "SetAutoscaling")},
    _SCALER + "UpsertJob": Rule(role=Role.ADMIN),
    # Sharded replicas ship partial aggregates to each other: scaler identities only.
    "/tide.v1.ScalerPeers/ShipPartials": Rule(frozenset({Kind.SCALER})),
}

#: ListUtilization: the range when `since` is unset, and the longest one call may span
#: (one week of minutes, 10,080 points; tide/v1/scaler.proto).
DEFAULT_UTILIZATION_RANGE = timedelta(hours=24)
MAX_UTILIZATION_RANGE = timedelta(days=7)
#: ...and with the per-second detail (1,440 points of 60 seconds: about 1 MB).
MAX_SECONDS_RANGE = timedelta(days=1)


class ScalerServicer(scaler_pb2_grpc.ScalerServicer):
    def __init__(self, core: ScalerCore) -> None:
        self.core = core

    def _job(self, job: JobRecord) -> scaler_pb2.Job:
        core = self.core
        p = core.policies.get(job.job_id) or core.book.policy_of(job)
        now = core.clock.now()
        msg = scaler_pb2.Job(
            job_id=job.job_id,
            policy=policy_to_proto(p),
            current_replicas=job.current_replicas,
            generation=job.generation,
            autoscaling_paused=job.autoscaling_paused,
            pause_reason=job.pause_reason,
            window=window_to_proto(core.pipeline.window_of(job.job_id, now), now),
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
            msg.failure = status.failure
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
        return self._job(self.core.book.get(request.job_id))

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
        # Each row to its message once, in the store's thread (no record between).
        decisions, token = await self.core.store.decision_page(
            decision_row_to_proto,
            job_id=request.job_id,
            since=field_datetime(request, "since"),
            until=field_datetime(request, "until"),
            states=states,
            page_size=request.page_size or 100,
            page_token=request.page_token,
        )
        return scaler_pb2.ListDecisionsResponse(decisions=decisions, next_page_token=token)

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
        return detail_to_proto(detail, rollups)

    @rpc_errors
    async def ListUtilization(
        self, request: scaler_pb2.ListUtilizationRequest, context: Ctx
    ) -> scaler_pb2.ListUtilizationResponse:
        self.core.book.get(request.job_id)  # NotFound for a job the scaler does not know
        until = field_datetime(request, "until") or utc_from_epoch(self.core.clock.now())
        since = field_datetime(request, "since") or until - DEFAULT_UTILIZATION_RANGE
        if not since < until:
            raise InvalidArgument(
                f"since={since.isoformat()} must be before until={until.isoformat()}"
            )
        limit = MAX_SECONDS_RANGE if request.seconds else MAX_UTILIZATION_RANGE
        if until - since > limit:
            # At most one week of minutes (a day with seconds) per answer, the API's bound;
            # a longer range is asked for in parts rather than cut short without a word.
            raise InvalidArgument(
                f"since..until spans {until - since}; at most {limit} per call"
                + (" with seconds" if request.seconds else "")
            )
        store = self.core.store
        rows = await store.rollups_between(request.job_id, since, until)
        seconds = (
            await store.seconds_between(request.job_id, since, until) if request.seconds else {}
        )
        return scaler_pb2.ListUtilizationResponse(
            points=[point_to_proto(r, seconds.get(r.minute)) for r in rows]
        )

    @rpc_errors
    async def RequestResize(
        self, request: scaler_pb2.RequestResizeRequest, context: Ctx
    ) -> scaler_pb2.Decision:
        d = await self.core.request_resize(
            request.job_id,
            request.replicas,
            request.reason,
            requested_by(caller(), request.requested_by),
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
        q = self.core.feed.subscribe(request.job_id)
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
            self.core.feed.unsubscribe(q)


__all__ = ["RULES", "ScalerPeersServicer", "ScalerServicer", "TelemetryServicer"]


class ScalerPeersServicer(peers_pb2_grpc.ScalerPeersServicer):
    """What other replicas of a sharded deployment ship to this one (docs/scaler.md)."""

    def __init__(self, core: ScalerCore) -> None:
        self.core = core

    @rpc_errors
    async def ShipPartials(
        self, request: peers_pb2.ShipPartialsRequest, context: Ctx
    ) -> peers_pb2.ShipPartialsResponse:
        parts = [partial_from_proto(m) for m in request.jobs]
        # Notices first: a preemption is the urgent part of a shipment.
        applied, notices_refused = self.core.receive_notices(
            [notice_from_proto(m) for m in (*request.notices, *request.withdrawn)]
        )
        refused = await self.core.receive_partials(request.sender, parts)
        self.core.metrics.partials_received.inc(len(parts) - refused)
        return peers_pb2.ShipPartialsResponse(
            merged=len(parts) - refused,
            refused=refused,
            notices_applied=applied,
            notices_refused=notices_refused,
        )
