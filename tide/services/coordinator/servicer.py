"""The Coordinator gRPC service: decode the request, call one engine function, encode
the answer (tide/services/coordinator/convert.py holds the conversions). The engine runs on
its own thread (Coordinator.call): the event loop only waits for it.

Errors are TideErrors raised by the engine; :func:`tide.services.common.rpc.rpc_errors`
turns them into statuses. Streams are the engine's (engine/streams.py): they wait on
the job's change notifier and never poll.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from tide.services.common import tracing
from tide.services.common.guard import Kind, Role, Rule, Subject
from tide.services.common.rpc import rpc_errors
from tide.services.coordinator import convert
from tide.services.coordinator.engine import Coordinator, streams
from tide.v1 import coordinator_pb2 as pb
from tide.v1 import coordinator_pb2_grpc as pb_grpc

SERVICE_NAME = "tide.v1.Coordinator"


def rules(coordinator: Coordinator) -> dict[str, Rule]:
    """Who may call what (tide.services.common.guard): a launcher only as its own pod of its
    own job (a member id is checked against the pod that registered it); the
    scaler-facing calls need the scaler's identity or a user with the role."""

    def member(request: Any) -> Subject:
        # An unknown member is nobody's: the call gets NOT_FOUND and re-registers.
        job, pod = coordinator.member_pod(request.member_id)
        return Subject(job=job, pod=pod)

    launcher = frozenset({Kind.LAUNCHER})
    scaler = frozenset({Kind.SCALER})
    m = f"/{SERVICE_NAME}/"
    return {
        m + "Register": Rule(launcher, subject=lambda r: Subject(job=r.job_id, pod=r.pod_name)),
        m + "Directives": Rule(launcher, subject=member),
        m + "Ack": Rule(launcher, subject=member),
        m + "Heartbeat": Rule(launcher, subject=member),
        m + "Resize": Rule(scaler, role=Role.ADMIN),
        m + "AbortResize": Rule(scaler, role=Role.ADMIN),
        m + "GetJobStatus": Rule(scaler, role=Role.VIEWER),
        m + "WatchJob": Rule(scaler, role=Role.VIEWER),
    }


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, coordinator: Coordinator) -> None:
        self._c = coordinator

    @rpc_errors
    async def Register(self, request: pb.RegisterRequest, context: Any) -> pb.RegisterResponse:
        inp = convert.register_from_proto(request)
        return convert.register_to_proto(await self._c.call(self._c.register, inp))

    @rpc_errors
    async def Directives(
        self, request: pb.DirectivesRequest, context: Any
    ) -> AsyncIterator[pb.Directive]:
        async for d in streams.directives(self._c, request.member_id):
            yield convert.directive_to_proto(d)

    @rpc_errors
    async def Ack(self, request: pb.AckRequest, context: Any) -> pb.AckResponse:
        await self._c.call(self._c.ack, convert.ack_from_proto(request))
        return pb.AckResponse()

    @rpc_errors
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> pb.HeartbeatResponse:
        inp = convert.heartbeat_from_proto(request)
        generation = await self._c.call(self._c.heartbeat, inp)
        return pb.HeartbeatResponse(generation=generation)

    @rpc_errors
    async def Resize(
        self, request: pb.ResizeRequest, context: Any
    ) -> AsyncIterator[pb.ResizeProgress]:
        inp = dataclasses.replace(
            convert.resize_from_proto(request),
            trace_parent=tracing.extract(context.invocation_metadata()),
        )
        async for view in streams.resize(self._c, inp):
            yield convert.progress_to_proto(view)

    @rpc_errors
    async def AbortResize(
        self, request: pb.AbortResizeRequest, context: Any
    ) -> pb.AbortResizeResponse:
        phase = await self._c.call(
            self._c.abort_resize, request.decision_id, request.job_id, request.reason
        )
        return pb.AbortResizeResponse(phase=int(phase))  # type: ignore[arg-type]

    @rpc_errors
    async def GetJobStatus(self, request: pb.GetJobStatusRequest, context: Any) -> pb.JobStatus:
        view = await self._c.call(lambda: self._c.job(request.job_id).status())
        return convert.status_to_proto(view)

    @rpc_errors
    async def WatchJob(
        self, request: pb.GetJobStatusRequest, context: Any
    ) -> AsyncIterator[pb.JobStatus]:
        async for view in streams.watch_job(self._c, request.job_id):
            yield convert.status_to_proto(view)
