"""The Coordinator gRPC service: protobuf in, one call into the core, protobuf out.

Errors are TideErrors raised by the core; :func:`services.common.rpc.rpc_errors`
turns them into statuses. Streams wait on the job's change notifier and never
poll.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp
from tide.v1 import coordinator_pb2 as pb
from tide.v1 import coordinator_pb2_grpc as pb_grpc

from services.common.rpc import rpc_errors
from services.coordinator.domain import Breakdown, Directive, WorkerPhase
from services.coordinator.engine import (
    AckInput,
    Coordinator,
    HeartbeatInput,
    JobView,
    RegisterInput,
    ResizeInput,
    ResizeView,
)
from tidebase.errors import InvalidArgument

SERVICE_NAME = "tide.v1.Coordinator"
#: Scaler-facing calls that change a job; they need the admin token when one is set.
ADMIN_METHODS = frozenset(
    {f"/{SERVICE_NAME}/Resize", f"/{SERVICE_NAME}/AbortResize"},
)
#: WatchJob sends progress (steps, throughput) at most this often, seconds.
WATCH_PROGRESS_INTERVAL_S = 1.0


def _ts(seconds: float | None) -> Timestamp | None:
    if not seconds:
        return None
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def _seconds(msg: Any, name: str) -> float | None:
    if not msg.HasField(name):
        return None
    ts: Timestamp = getattr(msg, name)
    return ts.ToNanoseconds() / 1e9


def _breakdown_pb(b: Breakdown) -> pb.PauseBreakdown:
    return pb.PauseBreakdown(
        barrier_s=b.barrier_s,
        checkpoint_write_s=b.checkpoint_write_s,
        worker_restart_s=b.worker_restart_s,
        group_init_s=b.group_init_s,
        restore_s=b.restore_s,
    )


def directive_pb(d: Directive) -> pb.Directive:
    out = pb.Directive(
        directive_id=d.directive_id,
        kind=int(d.kind),  # type: ignore[arg-type]
        generation=d.generation,
        checkpoint_step=d.checkpoint_step,
        reason=d.reason,
    )
    if d.rendezvous is not None:
        rv = d.rendezvous
        out.rendezvous.CopyFrom(
            pb.Rendezvous(
                generation=rv.generation,
                world_size=rv.world_size,
                rank=rv.rank,
                master_endpoint=rv.master_endpoint,
                trainer_endpoints=list(rv.trainer_endpoints),
                restore_step=rv.restore_step,
            )
        )
    deadline = _ts(d.deadline_at)
    if deadline is not None:
        out.deadline.CopyFrom(deadline)
    return out


def progress_pb(v: ResizeView) -> pb.ResizeProgress:
    return pb.ResizeProgress(
        decision_id=v.decision_id,
        phase=int(v.phase),  # type: ignore[arg-type]
        generation=v.generation,
        world_size=v.world_size,
        checkpoint_step=v.checkpoint_step,
        pause_s=v.pause_s,
        pause=_breakdown_pb(v.breakdown),
        lost_steps=v.lost_steps,
        message=v.message,
    )


def status_pb(v: JobView) -> pb.JobStatus:
    out = pb.JobStatus(
        job_id=v.job_id,
        generation=v.generation,
        world_size=v.world_size,
        step=v.step,
        epoch=v.epoch,
        samples_consumed=v.samples_consumed,
        samples_per_s=v.samples_per_s,
        last_checkpoint_step=v.last_checkpoint_step,
        lost_steps_total=v.lost_steps_total,
        finished=v.finished,
    )
    for m in v.members:
        member = out.members.add(
            member_id=m.member_id,
            pod_name=m.pod_name,
            pod_index=m.pod_index,
            pod_uid=m.pod_uid,
            host=m.host,
            state=int(m.state),
            rank=m.rank,
            phase=int(m.phase),
            step=m.step,
            samples_per_s=m.samples_per_s,
        )
        seen = _ts(m.last_heartbeat_at)
        if seen is not None:
            member.last_heartbeat.CopyFrom(seen)
    if v.active_resize is not None:
        out.active_resize.CopyFrom(progress_pb(v.active_resize))
    return out


def _phase(value: int) -> WorkerPhase:
    try:
        return WorkerPhase(value)
    except ValueError:
        raise InvalidArgument(f"phase: unknown worker phase {value}") from None


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, coordinator: Coordinator) -> None:
        self._c = coordinator

    @rpc_errors
    async def Register(self, request: pb.RegisterRequest, context: Any) -> pb.RegisterResponse:
        res = self._c.register(
            RegisterInput(
                job_id=request.job_id,
                pod_name=request.pod_name,
                pod_index=request.pod_index,
                host=request.host,
                launcher_id=request.launcher_id,
                last_generation=request.last_generation,
                pod_uid=request.pod_uid,
                free_port=request.free_port,
            )
        )
        return pb.RegisterResponse(
            member_id=res.member_id,
            generation=res.generation,
            state=int(res.state),  # type: ignore[arg-type]
            heartbeat_interval_s=res.heartbeat_interval_s,
            heartbeat_timeout_s=res.heartbeat_timeout_s,
        )

    @rpc_errors
    async def Directives(
        self, request: pb.DirectivesRequest, context: Any
    ) -> AsyncIterator[pb.Directive]:
        rt = self._c.job_of_member(request.member_id)
        token = rt.open_stream(request.member_id)
        sent: set[str] = set()
        while True:
            seen = rt.notifier.version
            for d in rt.pending_directives(request.member_id):
                if d.directive_id not in sent:
                    sent.add(d.directive_id)
                    yield directive_pb(d)
            if not rt.stream_current(request.member_id, token):
                return
            await rt.notifier.wait(seen)

    @rpc_errors
    async def Ack(self, request: pb.AckRequest, context: Any) -> pb.AckResponse:
        self._c.ack(
            AckInput(
                member_id=request.member_id,
                directive_id=request.directive_id,
                generation=request.generation,
                ok=request.ok,
                checkpoint_step=request.checkpoint_step,
                checkpoint_digest=request.checkpoint_digest,
                message=request.message,
                held_at=_seconds(request, "held_at"),
                checkpoint_write_s=request.checkpoint_write_s,
            )
        )
        return pb.AckResponse()

    @rpc_errors
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> pb.HeartbeatResponse:
        s = request.startup
        generation = self._c.heartbeat(
            HeartbeatInput(
                member_id=request.member_id,
                generation=request.generation,
                phase=_phase(request.phase),
                step=request.step,
                samples_consumed=request.samples_consumed,
                epoch=request.epoch,
                samples_per_s=request.samples_per_s,
                first_step_at=_seconds(request, "first_step_at"),
                startup=Breakdown(
                    barrier_s=s.barrier_s,
                    checkpoint_write_s=s.checkpoint_write_s,
                    worker_restart_s=s.worker_restart_s,
                    group_init_s=s.group_init_s,
                    restore_s=s.restore_s,
                ),
                free_port=request.free_port,
                last_checkpoint_step=request.last_checkpoint_step,
                last_checkpoint_digest=request.last_checkpoint_digest,
            )
        )
        return pb.HeartbeatResponse(generation=generation)

    @rpc_errors
    async def Resize(
        self, request: pb.ResizeRequest, context: Any
    ) -> AsyncIterator[pb.ResizeProgress]:
        rt = self._c.start_resize(
            ResizeInput(
                decision_id=request.decision_id,
                job_id=request.job_id,
                target_world_size=request.target_world_size,
                deadline_s=request.deadline_s,
                leaving_pods=tuple(request.leaving_pods),
                min_world_size=request.min_world_size,
            )
        )
        last: ResizeView | None = None
        while True:
            seen = rt.notifier.version
            if rt.broken:
                rt = self._c.job(request.job_id)
            view = rt.resize_view(request.decision_id)
            if view != last:
                last = view
                yield progress_pb(view)
            if view.phase.final:
                return
            await rt.notifier.wait(seen)

    @rpc_errors
    async def AbortResize(
        self, request: pb.AbortResizeRequest, context: Any
    ) -> pb.AbortResizeResponse:
        phase = self._c.abort_resize(request.decision_id, request.job_id, request.reason)
        return pb.AbortResizeResponse(phase=int(phase))  # type: ignore[arg-type]

    @rpc_errors
    async def GetJobStatus(self, request: pb.GetJobStatusRequest, context: Any) -> pb.JobStatus:
        return status_pb(self._c.job(request.job_id).status())

    @rpc_errors
    async def WatchJob(
        self, request: pb.GetJobStatusRequest, context: Any
    ) -> AsyncIterator[pb.JobStatus]:
        rt = self._c.job(request.job_id)
        last: pb.JobStatus | None = None
        while True:
            seen = rt.notifier.version
            if rt.broken:
                rt = self._c.job(request.job_id)
            status = status_pb(rt.status())
            if status != last:
                last = status
                yield status
            # Changes wake the stream at once; heartbeat progress, which does not
            # notify, is picked up on the periodic wake-up.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rt.notifier.wait(seen), WATCH_PROGRESS_INTERVAL_S)
