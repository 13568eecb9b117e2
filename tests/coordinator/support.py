"""The coordinator test harness: an in-process coordinator on a real socket (port 0),
with a fake clock, and fake launchers joined to it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from tests.coordinator.fakes import TIMEOUT_S, FakeLauncher, ResizeWatch
from tests.support.poll import eventually
from tide.services.common.config import CommonSettings
from tide.services.common.server import RunningServer, ServiceSpec, start_server
from tide.services.coordinator.engine import Coordinator
from tide.services.coordinator.servicer import SERVICE_NAME, CoordinatorServicer
from tide.services.coordinator.settings import Tuning
from tide.services.coordinator.store import CoordinatorStore
from tide.services.testing.clock import FakeClock
from tide.v1 import coordinator_pb2 as pb
from tide.v1 import coordinator_pb2_grpc as pb_grpc

P = pb.ResizePhase

JOB = "ns/job"
TUNING = Tuning(
    heartbeat_timeout_s=30.0,
    # Apart from the heartbeat timeout, so a test can tell which one a deadline came from.
    phase_timeout_s=40.0,
    heartbeat_interval_s=5.0,
    checkpoint_min_lead_steps=2,
    checkpoint_lead_s=3.0,
    tick_interval_s=0.5,
)


@dataclass
class Env:
    clock: FakeClock
    store: CoordinatorStore
    coordinator: Coordinator
    server: RunningServer
    channel: grpc.aio.Channel
    stub: pb_grpc.CoordinatorStub
    launchers: list[FakeLauncher] = field(default_factory=list)
    tuning: Tuning = TUNING

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    async def launcher(self, pod_index: int, **kw: object) -> FakeLauncher:
        fl = FakeLauncher(self.target, self.clock, JOB, pod_index, **kw)  # type: ignore[arg-type]
        self.launchers.append(fl)
        await fl.join()
        return fl

    async def restart(self) -> None:
        """A new Coordinator over the same store and a new server, as after a crash."""
        await self.server.stop(0)
        # What the old engine still had queued ends before the new one loads, as when
        # its process dies.
        await asyncio.to_thread(self.coordinator.close, wait=True)
        self.coordinator = Coordinator(self.store, self.clock, self.tuning)
        self.coordinator.load()
        self.server = await _serve(self.coordinator)
        for fl in self.launchers:
            await fl.channel.close()
            fl.target = self.target
            fl.channel = grpc.aio.insecure_channel(self.target)
            fl.stub = pb_grpc.CoordinatorStub(fl.channel)
        await self.channel.close()
        self.channel = grpc.aio.insecure_channel(self.target)
        self.stub = pb_grpc.CoordinatorStub(self.channel)

    async def status(self) -> pb.JobStatus:
        # The generated stub is typed for the sync API; on an aio channel it is awaitable.
        st: pb.JobStatus = await self.stub.GetJobStatus(  # type: ignore[misc]
            pb.GetJobStatusRequest(job_id=JOB), timeout=TIMEOUT_S
        )
        return st

    async def heartbeat_all(self, steps: int = 1, advance_s: float = 1.0) -> None:
        self.clock.advance(advance_s)
        for fl in self.launchers:
            if not fl.exited and fl.member_id:
                await fl.heartbeat(steps)


async def _serve(coordinator: Coordinator) -> RunningServer:
    return await start_server(
        CommonSettings(listen="127.0.0.1:0"),
        [
            ServiceSpec(
                pb_grpc.add_CoordinatorServicer_to_server,
                CoordinatorServicer(coordinator),
                SERVICE_NAME,
            )
        ],
    )


async def make_env(store: CoordinatorStore, tuning: Tuning = TUNING) -> Env:
    clock = FakeClock()
    coordinator = Coordinator(store, clock, tuning)
    coordinator.load()
    server = await _serve(coordinator)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.CoordinatorStub(channel)
    return Env(clock, store, coordinator, server, channel, stub, tuning=tuning)


async def close_env(env: Env) -> None:
    for fl in env.launchers:
        await fl.close()
    await env.channel.close()
    await env.server.stop(0)


def no_pending(env: Env) -> bool:
    rt = env.coordinator.jobs[JOB]
    return all(not rt.pending_directives(m) for m in rt.members)


async def form(env: Env, n: int, decision_id: int = 1) -> list[FakeLauncher]:
    """n launchers register and the first generation forms with all of them."""
    ls = [await env.launcher(i) for i in range(n)]
    w = ResizeWatch(env.stub, JOB, decision_id, n)
    await eventually(lambda: all(fl.generation == 1 for fl in ls), what="generation 1")
    await eventually(lambda: no_pending(env), what="rendezvous acks")
    await env.heartbeat_all()
    final = await w.final()
    assert final.phase == P.RESIZE_PHASE_COMPLETED, final
    return ls
