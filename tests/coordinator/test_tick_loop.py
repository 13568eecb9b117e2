"""The coordinator's tick loop on the fake clock: timeouts and deadlines run on its
ticks, and a stall of the loop (a blocked or starved process) is credited, not held
against the members."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from tests.coordinator.fakes import ResizeWatch
from tests.coordinator.support import JOB, TUNING, Env, form
from tests.support.poll import eventually
from tide.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.component

K = pb.Directive.Kind
P = pb.ResizePhase


class TickLoop:
    """The coordinator's own tick loop on the fake clock, with each tick's stall recorded."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.stalls: list[float] = []
        inner = env.coordinator.tick

        def tick(stalled_s: float = 0.0, cpu_wait_s: float = 0.0) -> None:
            self.stalls.append(stalled_s)
            inner(stalled_s, cpu_wait_s)

        env.coordinator.tick = tick  # type: ignore[method-assign]
        self.task = asyncio.create_task(env.coordinator.run())

    async def advance(self, seconds: float) -> None:
        """Move the clock by ``seconds`` at once and wait for the tick that wakes. The loop
        must sleep on the clock first: the previous tick may still run on the engine's
        thread (a loaded machine), and an advance before its next sleep would wake nothing."""
        await eventually(lambda: self.env.clock.sleeping() > 0, what="the loop to sleep")
        n = len(self.stalls)
        self.env.clock.advance(seconds)
        await eventually(lambda: len(self.stalls) > n, what="a tick")

    async def run_for(self, seconds: float, heartbeat_every_s: float = 5.0) -> None:
        """``seconds`` of a coordinator that keeps up: a tick every interval, heartbeats
        from every launcher not marked exited every ``heartbeat_every_s``."""
        step = TUNING.tick_interval_s
        since_beat = 0.0
        for _ in range(round(seconds / step)):
            await self.advance(step)
            since_beat += step
            if since_beat >= heartbeat_every_s:
                since_beat = 0.0
                for fl in self.env.launchers:
                    if not fl.exited and fl.member_id:
                        await fl.heartbeat()

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def test_tick_loop_runs_on_the_clock(env: Env) -> None:
    ls = await form(env, 2)
    ls[1].exited = True  # silent from now on
    loop = TickLoop(env)
    try:
        await loop.run_for(TUNING.heartbeat_timeout_s - 2)
        assert ls[0].generation == 1
        await loop.run_for(4)
        await eventually(lambda: ls[0].generation == 2, what="recovery by the tick loop")
        assert set(loop.stalls) == {0.0}
    finally:
        await loop.stop()


async def test_a_stall_longer_than_the_heartbeat_timeout_loses_nobody(env: Env) -> None:
    ls = await form(env, 2)
    loop = TickLoop(env)
    try:
        await loop.run_for(2)
        # The loop does not run for 45 s (heartbeat timeout 30 s): nobody could be heard.
        await loop.advance(45.0)
        assert loop.stalls[-1] == pytest.approx(45.0 - TUNING.tick_interval_s)
        st = await env.status()
        assert (st.generation, st.world_size) == (1, 2)
        assert [m.state for m in st.members] == [pb.MEMBER_STATE_ACTIVE] * 2
        # Running again, a member that stays silent is still found out, after the full
        # heartbeat timeout of running time.
        ls[1].exited = True
        await loop.run_for(TUNING.heartbeat_timeout_s - 6)
        assert ls[0].generation == 1
        await loop.run_for(8)
        await eventually(lambda: ls[0].generation == 2, what="recovery after the stall")
    finally:
        await loop.stop()


async def test_a_stall_moves_directive_and_phase_deadlines(env: Env) -> None:
    ls = await form(env, 2)
    await env.heartbeat_all()
    ls[1].answer_checkpoint = False
    w = ResizeWatch(env.stub, JOB, 2, 1, deadline_s=10.0)
    await eventually(lambda: K.KIND_CHECKPOINT in ls[1].kinds(), what="barrier")
    loop = TickLoop(env)
    try:
        await loop.advance(20.0)  # past both the ack deadline and the phase deadline
        rt = env.coordinator.jobs[JOB]
        assert rt.resizes[2].phase.name == "CHECKPOINTING"
        assert ls[1].member_id in {m.member_id for m in rt.current_members()}
        await loop.run_for(11)
        final = await w.final()
        assert final.phase == P.RESIZE_PHASE_ABORTED
        assert "barrier deadline" in final.message
    finally:
        await loop.stop()


@pytest.mark.parametrize(("cpu_wait_s", "level"), [(0.0, logging.WARNING), (4.9, logging.INFO)])
async def test_a_stall_spent_waiting_for_a_cpu_is_told_at_info(
    env: Env, caplog: pytest.LogCaptureFixture, cpu_wait_s: float, level: int
) -> None:
    """A loaded machine is not a fault of the coordinator: a healthy run logs no WARNING."""
    await form(env, 2)
    with caplog.at_level(logging.INFO, logger="tide.services.coordinator"):
        env.coordinator.tick(5.0, cpu_wait_s)
    stalls = [r for r in caplog.records if "stalled" in r.getMessage()]
    assert [r.levelno for r in stalls] == [level]
