"""A minimal coordinator over a real gRPC socket, steered by the test (no barrier logic).

It records registrations, heartbeats and acks, and lets the test push directives to a member's
stream. Tests poll it with tests.support.poll.eventually.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from tide.v1 import coordinator_pb2 as pb
from tide.v1 import coordinator_pb2_grpc as pb_grpc


@dataclass
class FakeMember:
    member_id: str
    register: pb.RegisterRequest
    # None ends the member's stream, as the real coordinator does for a member that left.
    queue: asyncio.Queue[pb.Directive | None] = field(default_factory=asyncio.Queue)
    heartbeats: list[pb.HeartbeatRequest] = field(default_factory=list)
    acks: list[pb.AckRequest] = field(default_factory=list)
    registrations: int = 1
    streams: int = 0

    @property
    def last(self) -> pb.HeartbeatRequest | None:
        return self.heartbeats[-1] if self.heartbeats else None

    @property
    def free_port(self) -> int:
        return self.last.free_port if self.last else self.register.free_port


class FakeCoordinator(pb_grpc.CoordinatorServicer):
    def __init__(self, heartbeat_interval_s: float = 0.2, heartbeat_timeout_s: float = 3.0) -> None:
        self.members: dict[str, FakeMember] = {}
        self.generation = 0
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._ids = itertools.count(1)
        # Members whose next heartbeat is answered NOT_FOUND (a coordinator that lost them).
        self.forgotten: set[str] = set()
        # Members that reported IDLE in the current generation (finished): like the real
        # coordinator, their stream ends and later heartbeats get FAILED_PRECONDITION.
        self.finished: set[str] = set()
        # Fence as the proto says: a heartbeat of a member that was in a generation, naming
        # an older one than the job's, is refused with FAILED_PRECONDITION.
        self.reject_stale = False
        self.refused: list[pb.HeartbeatRequest] = []
        # Cleared: heartbeats wait unanswered, as on a coordinator paused (SIGSTOP).
        self.answering = asyncio.Event()
        self.answering.set()

    async def Register(self, request: pb.RegisterRequest, context: object) -> pb.RegisterResponse:
        member_id = f"m-{request.launcher_id[:8]}"
        if member_id in self.members:
            self.members[member_id].registrations += 1
            self.members[member_id].register = request
        else:
            self.members[member_id] = FakeMember(member_id, request)
        return pb.RegisterResponse(
            member_id=member_id,
            generation=self.generation,
            state=pb.MEMBER_STATE_STANDBY,
            heartbeat_interval_s=self.heartbeat_interval_s,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
        )

    async def Directives(
        self, request: pb.DirectivesRequest, context: object
    ) -> AsyncIterator[pb.Directive]:
        member = self.members[request.member_id]
        member.streams += 1
        while (d := await member.queue.get()) is not None:
            yield d

    async def Ack(self, request: pb.AckRequest, context: object) -> pb.AckResponse:
        self.members[request.member_id].acks.append(request)
        return pb.AckResponse()

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> pb.HeartbeatResponse:
        await self.answering.wait()
        if request.member_id in self.forgotten:
            self.forgotten.discard(request.member_id)
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no member {request.member_id}")
        if request.member_id in self.finished:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "member finished")
        if self.reject_stale and 0 < request.generation < self.generation:
            self.refused.append(request)
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"generation {request.generation} is stale (job in {self.generation})",
            )
        member = self.members[request.member_id]
        member.heartbeats.append(request)
        if request.phase == pb.WORKER_PHASE_IDLE and request.generation == self.generation > 0:
            self.finished.add(request.member_id)
            member.queue.put_nowait(None)
        return pb.HeartbeatResponse(generation=self.generation)

    # The scaler's side is not modelled: the launcher never calls it.
    async def Resize(self, request: Any, context: Any) -> AsyncIterator[pb.ResizeProgress]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "fake")
        yield pb.ResizeProgress()

    async def AbortResize(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "fake")

    async def GetJobStatus(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "fake")

    async def WatchJob(self, request: Any, context: Any) -> AsyncIterator[pb.JobStatus]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "fake")
        yield pb.JobStatus()

    # -- test side ------------------------------------------------------------------------

    def send(self, member_id: str, **fields: Any) -> pb.Directive:
        d = pb.Directive(directive_id=f"d{next(self._ids)}", generation=self.generation, **fields)
        self.members[member_id].queue.put_nowait(d)
        return d

    def rendezvous(
        self,
        member_ids: list[str],
        host: str = "127.0.0.1",
        restore_step: int = 0,
        new_generation: bool = True,
        kind: pb.Directive.Kind.ValueType = pb.Directive.KIND_RENDEZVOUS,
        prepared: bool = False,
        start_delay_s: float = 0.0,
    ) -> list[pb.Directive]:
        """RENDEZVOUS to ``member_ids`` for the next generation (or, with
        ``new_generation=False``, for one the test already moved the job to). With ``kind``
        PREPARE: the next generation's rendezvous, sent in the current one."""
        preparing = kind == pb.Directive.KIND_PREPARE
        if new_generation and not preparing:
            self.generation += 1
        generation = self.generation + 1 if preparing else self.generation
        endpoints = [f"{host}:{self.members[m].free_port}" for m in member_ids]
        out = []
        for rank, m in enumerate(member_ids):
            rdv = pb.Rendezvous(
                generation=generation,
                world_size=len(member_ids),
                rank=rank,
                master_endpoint=endpoints[0],
                trainer_endpoints=endpoints,
                restore_step=restore_step,
                prepared=prepared,
                start_delay_s=start_delay_s,
            )
            out.append(self.send(m, kind=kind, rendezvous=rdv))
        return out

    def ack_of(self, directive: pb.Directive) -> pb.AckRequest | None:
        for member in self.members.values():
            for ack in member.acks:
                if ack.directive_id == directive.directive_id:
                    return ack
        return None


async def start_fake(coordinator: FakeCoordinator) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    pb_grpc.add_CoordinatorServicer_to_server(coordinator, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port
