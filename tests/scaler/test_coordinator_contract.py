"""One contract for tide.services.scaler.coordination.CoordinatorClient, run over the
in-memory coordinator (tide.services.testing.coordinator) and over GrpcCoordinatorClient
talking over a real socket to the real coordinator, in-process, whose launchers
are tests.coordinator.fakes.FakeLauncher. What the scaler relies on is asserted
once here, so the double cannot drift from the real protocol."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Protocol

import grpc
import pytest

from tests.coordinator.support import JOB, Env, close_env, form, make_env
from tests.support.poll import eventually
from tide.base.client import open_channel
from tide.base.errors import NotFound
from tide.services.coordinator.store import MemoryStore
from tide.services.scaler.coordination import (
    CoordinatorClient,
    GrpcCoordinatorClient,
    JobStatusView,
    Phase,
    Progress,
    ResizeSpec,
)
from tide.services.scaler.members import Member
from tide.services.testing.coordinator import InMemoryCoordinator

pytestmark = pytest.mark.component

LONG_S = 1000.0  # a deadline no test reaches


class World(Protocol):
    """A coordinator and the pods it coordinates, as the contract drives them."""

    client: CoordinatorClient

    async def running(self, n: int) -> None:
        """JOB runs n members in generation 1."""

    async def add_pods(self, first_index: int, n: int) -> None:
        """n more pods of JOB exist (the actuator asked for them) and registered."""


class MemoryWorld:
    def __init__(self) -> None:
        self.pods = 0
        self.memory = InMemoryCoordinator(lambda j: self.pods if j == JOB else None)
        self.client: CoordinatorClient = self.memory

    async def running(self, n: int) -> None:
        self.pods = n
        self.memory.set_job(JOB, n)

    async def add_pods(self, first_index: int, n: int) -> None:
        self.pods += n


class RealWorld:
    """The real coordinator; a driver task heartbeats every launcher on a fake clock,
    as running trainers would, so every phase can end."""

    def __init__(self, env: Env, client: GrpcCoordinatorClient) -> None:
        self.env = env
        self.client: CoordinatorClient = client
        self._driver: asyncio.Task[None] | None = None

    async def running(self, n: int, decision_id: int = 1) -> None:
        await form(self.env, n, decision_id)
        self._driver = asyncio.create_task(self._drive())

    async def add_pods(self, first_index: int, n: int) -> None:
        for i in range(first_index, first_index + n):
            await self.env.launcher(i)

    async def _drive(self) -> None:
        while True:
            self.env.clock.advance(0.5)
            for fl in list(self.env.launchers):
                if fl.exited or not fl.member_id:
                    continue
                # A leaver between its DRAIN ack and its exit may be refused:
                # the driver must outlive that, as a launcher does.
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await fl.heartbeat()
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver


@pytest.fixture(params=["memory", "real"])
async def world(request: pytest.FixtureRequest) -> AsyncIterator[World]:
    if request.param == "memory":
        yield MemoryWorld()
        return
    env = await make_env(MemoryStore())
    async with open_channel(env.target) as channel:
        real = RealWorld(env, GrpcCoordinatorClient(channel))
        try:
            yield real
        finally:
            await real.close()
            await close_env(env)


async def run(client: CoordinatorClient, spec: ResizeSpec) -> list[Progress]:
    return [p async for p in client.resize(spec)]


def active(members: tuple[Member, ...] | list[Member]) -> int:
    return sum(1 for m in members if m.active)


async def test_grow_waits_for_the_newcomers_then_forms_the_next_generation(
    world: World,
) -> None:
    await world.running(2)
    await world.add_pods(2, 1)
    progress = await run(world.client, ResizeSpec(2, JOB, 3, deadline_s=LONG_S))
    final = progress[-1]
    assert final.phase is Phase.COMPLETED and (final.generation, final.world_size) == (2, 3)
    phases = [p.phase for p in progress[:-1]]
    assert all(not p.final for p in phases) and Phase.DRAINING not in phases
    assert phases.index(Phase.CHECKPOINTING) < phases.index(Phase.RENDEZVOUS)
    st = await world.client.job_status(JOB)
    assert (st.generation, st.world_size, active(st.members)) == (2, 3, 3)


async def test_shrink_checkpoints_then_rendezvous_with_no_draining_phase(world: World) -> None:
    await world.running(3)
    progress = await run(world.client, ResizeSpec(2, JOB, 2, deadline_s=LONG_S))
    assert progress[-1].phase is Phase.COMPLETED
    assert (progress[-1].generation, progress[-1].world_size) == (2, 2)
    phases = [p.phase for p in progress[:-1]]
    assert Phase.DRAINING not in phases and Phase.WAITING_FOR_MEMBERS not in phases
    assert phases.index(Phase.CHECKPOINTING) < phases.index(Phase.RENDEZVOUS)
    # COMPLETED waits for the leaver to be gone: the scaler lowers the replicas next.
    st = await world.client.job_status(JOB)
    assert (st.generation, st.world_size, active(st.members), len(st.members)) == (2, 2, 2, 2)


async def test_resize_is_idempotent_on_the_decision_id(world: World) -> None:
    await world.running(3)
    spec = ResizeSpec(2, JOB, 2, deadline_s=LONG_S)
    first = (await run(world.client, spec))[-1]
    again = await run(world.client, spec)
    # A finished decision answers its final progress again; nothing runs twice.
    assert [p.phase for p in again] == [Phase.COMPLETED]
    assert (again[-1].generation, again[-1].world_size) == (first.generation, 2)
    assert (await world.client.job_status(JOB)).generation == 2


async def test_abort_before_rendezvous_resumes_the_old_generation(world: World) -> None:
    await world.running(2)
    # A grow to 3 with no newcomer: it waits for members until aborted.
    spec = ResizeSpec(2, JOB, 3, deadline_s=LONG_S)
    seen: list[Phase] = []

    async def follow() -> None:
        async for p in world.client.resize(spec):
            seen.append(p.phase)

    task = asyncio.create_task(follow())
    await eventually(lambda: seen, timeout_s=10, what="the resize under way")
    assert seen[0] is Phase.WAITING_FOR_MEMBERS
    assert await world.client.abort_resize(2, JOB, "contract test") is Phase.ABORTED
    await asyncio.wait_for(task, 10)
    assert seen[-1] is Phase.ABORTED
    st: JobStatusView = await world.client.job_status(JOB)
    assert (st.generation, st.world_size) == (1, 2)
    # Aborting it again answers its final phase.
    assert await world.client.abort_resize(2, JOB, "again") is Phase.ABORTED


async def test_watch_members_streams_the_job_now_and_after_a_change(world: World) -> None:
    await world.running(2)
    updates: list[list[Member]] = []

    async def watch() -> None:
        async for members in world.client.watch_members(JOB):
            updates.append(members)

    task = asyncio.create_task(watch())
    try:
        await eventually(lambda: updates and active(updates[-1]) == 2, timeout_s=10)
        await run(world.client, ResizeSpec(2, JOB, 1, deadline_s=LONG_S))
        await eventually(lambda: active(updates[-1]) == 1 == len(updates[-1]), timeout_s=10)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_an_unknown_job_is_not_found(world: World) -> None:
    with pytest.raises(NotFound):
        await world.client.job_status("ns/nobody")
