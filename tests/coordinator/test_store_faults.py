"""Issue 30, item 1: a resize survives its store.

Each phase of a resize (PREPARING in the overlap mode) × {a commit that fails once, the store down for longer than the
retry budget} × {memory, SQLite, PostgreSQL}: the store fails (tide/services/testing/
flaky_store.py, as SqlStore fails once its retries are spent) at the commit that moves
the resize on, and the resize carries on from its stored state once the store answers:
it COMPLETES, and no reason names a restart that never happened.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import grpc
import pytest

from tests.coordinator.fakes import FakeLauncher, ResizeWatch
from tests.coordinator.support import JOB, TUNING, Env, close_env, make_env
from tests.support.poll import eventually
from tide.services.coordinator.sql_store import SqlStore
from tide.services.coordinator.store import CoordinatorStore, JobSnapshot, MemoryStore, Unit
from tide.services.store import db
from tide.services.testing.clock import FakeClock
from tide.services.testing.flaky_store import FlakyStore
from tide.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.integration

K = pb.Directive.Kind
P = pb.ResizePhase
OVERLAP = dataclasses.replace(TUNING, resize_mode="overlap")


@pytest.fixture(
    params=[
        pytest.param("memory"),
        pytest.param("sqlite"),
        pytest.param("pg", marks=pytest.mark.postgres),
    ]
)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FlakyStore]:
    if request.param == "memory":
        yield FlakyStore(MemoryStore())
        return
    url = (
        f"sqlite:///{tmp_path / 'coord.db'}"
        if request.param == "sqlite"
        else request.getfixturevalue("pg_schema_url")
    )
    db.upgrade(url)
    engine = db.make_engine(url)
    inner: CoordinatorStore = SqlStore(db.make_session_factory(engine), FakeClock().now)
    yield FlakyStore(inner)
    engine.dispose()


@pytest.fixture
async def fenv(store: FlakyStore, phase: str) -> AsyncIterator[Env]:
    # PREPARING is the overlap mode's phase: g+1's group forms before the barrier.
    e = await make_env(store, OVERLAP if phase == "PREPARING" else TUNING)
    yield e
    await close_env(e)


async def _tolerant(call: Awaitable[object]) -> None:
    # While the store fails, calls are answered UNAVAILABLE: the launcher tries again.
    with contextlib.suppress(grpc.aio.AioRpcError):
        await call


async def _form(env: Env, n: int) -> list[FakeLauncher]:
    ls = [await env.launcher(i) for i in range(n)]
    w = ResizeWatch(env.stub, JOB, 1, n)
    await eventually(lambda: all(fl.generation == 1 for fl in ls), what="generation 1")
    await env.heartbeat_all()
    assert (await w.final()).phase == P.RESIZE_PHASE_COMPLETED
    return ls


async def _until_final(env: Env, store: FlakyStore) -> pb.ResizeProgress:
    """Drive the members as launchers do after an outage (heartbeat, reconnect, re-ack)
    until resize 2 is final."""

    def final() -> bool:
        rt = env.coordinator.jobs.get(JOB)
        return rt is not None and not rt.broken and rt.resizes[2].phase.final

    for _ in range(30):
        for fl in env.launchers:
            if not fl.member_id:
                await _tolerant(fl.join())
            elif fl.stream_ended():
                await _tolerant(fl.register())
                await _tolerant(fl.connect())
        env.clock.advance(1.0)
        for fl in env.launchers:
            await _tolerant(fl.heartbeat())
        # On the engine's thread, like the service's own ticks: never beside an operation.
        await env.coordinator.call(env.coordinator.tick)
        with contextlib.suppress(AssertionError):
            await eventually(final, timeout_s=0.3, what="final")
        if final():
            break
    return await ResizeWatch(env.stub, JOB, 2, 3).final()


async def _fault(env: Env, store: FlakyStore, kind: str) -> None:
    """Fail the next commit once, or take the store down across ticks past the phase's
    deadline, then bring it back."""
    if kind == "once":
        store.fail_saves = 1
        return
    store.down = True
    for fl in env.launchers:
        await _tolerant(fl.heartbeat())
    env.clock.advance(90.0)  # past the resize's 60 s phase deadline
    await env.coordinator.call(env.coordinator.tick)  # cannot reload: logged, nothing decided
    assert store.failed > 0
    store.down = False


def _assert_truthful(final: pb.ResizeProgress) -> None:
    assert final.phase == P.RESIZE_PHASE_COMPLETED, final.message
    assert "restart" not in final.message


async def waiting_for_members(env: Env, store: FlakyStore, kind: str) -> pb.ResizeProgress:
    await _form(env, 2)
    ResizeWatch(env.stub, JOB, 2, 3, deadline_s=60.0)
    await eventually(lambda: 2 in env.coordinator.jobs[JOB].resizes, what="resize 2")
    await _fault(env, store, kind)
    # The awaited newcomer registers: the commit that lets the resize go on.
    newcomer = FakeLauncher(env.target, env.clock, JOB, 2)
    env.launchers.append(newcomer)
    await _tolerant(newcomer.join())
    return await _until_final(env, store)


async def checkpointing(env: Env, store: FlakyStore, kind: str) -> pb.ResizeProgress:
    ls = await _form(env, 2)
    await env.heartbeat_all()
    await env.launcher(2)
    ls[1].answer_checkpoint = False
    ResizeWatch(env.stub, JOB, 2, 3, deadline_s=60.0)
    await eventually(lambda: K.KIND_CHECKPOINT in ls[1].kinds(), what="checkpoint sent")
    await _fault(env, store, kind)
    # The held member's ack is the commit that completes the barrier.
    ls[1].answer_checkpoint = True
    await ls[1].disconnect()
    return await _until_final(env, store)


async def preparing(env: Env, store: FlakyStore, kind: str) -> pb.ResizeProgress:
    await _form(env, 2)
    await env.heartbeat_all(steps=3)
    newcomer = await env.launcher(2)
    newcomer.prepare_ok = None  # holds its PREPARE's ack: the resize waits in PREPARING
    ResizeWatch(env.stub, JOB, 2, 3, deadline_s=60.0)
    await eventually(lambda: K.KIND_PREPARE in newcomer.kinds(), what="prepare sent")
    assert env.coordinator.jobs[JOB].resizes[2].phase.name == "PREPARING"
    await _fault(env, store, kind)
    # The newcomer's ack (its group formed) is the commit that lets the barrier begin;
    # past the deadline ("down"), the plain barrier is the fallback. Either completes.
    newcomer.prepare_ok = True
    await newcomer.disconnect()
    return await _until_final(env, store)


async def rendezvous(env: Env, store: FlakyStore, kind: str) -> pb.ResizeProgress:
    await _form(env, 2)
    await env.heartbeat_all()
    for fl in env.launchers:
        fl.answer_rendezvous = False
    await env.launcher(2)
    ResizeWatch(env.stub, JOB, 2, 3, deadline_s=60.0)
    await eventually(lambda: env.coordinator.jobs[JOB].job.generation == 2, what="g2 sent")
    await _fault(env, store, kind)
    for fl in env.launchers:
        fl.answer_rendezvous = True
        await fl.disconnect()
    return await _until_final(env, store)


#: Each phase's scenario: resize 2 (2 -> 3 members) with the store failed in that phase.
SCENARIOS: dict[str, Callable[[Env, FlakyStore, str], Awaitable[pb.ResizeProgress]]] = {
    "WAITING_FOR_MEMBERS": waiting_for_members,
    "PREPARING": preparing,
    "CHECKPOINTING": checkpointing,
    "RENDEZVOUS": rendezvous,
}
FAULTS = ("once", "down")


@pytest.mark.parametrize("kind", FAULTS)
@pytest.mark.parametrize("phase", list(SCENARIOS))
async def test_a_resize_survives_the_store(
    fenv: Env, store: FlakyStore, phase: str, kind: str
) -> None:
    final = await SCENARIOS[phase](fenv, store, kind)
    assert store.failed > 0, "the fault never met a commit"
    _assert_truthful(final)
    assert [fl.generation for fl in fenv.launchers] == [2, 2, 2]
    assert (await fenv.status()).lost_steps_total == 0


async def test_a_job_that_finishes_while_its_store_is_down_is_recorded_finished(
    store: FlakyStore,
) -> None:
    """Both workers finish while the store is down, with a resize waiting for a newcomer.
    Member 0's end is heard (in memory) and its commit fails; its launcher then gives up
    and exits. Member 1's end is refused outright (the job cannot be reloaded) and its
    launcher reports it again once the store is back. Afterwards the job is finished, no
    member was lost, and the resize ended because the job finished, not for a silence."""
    env = await make_env(store, TUNING)
    try:
        ls = await _form(env, 2)
        await env.heartbeat_all(steps=9)  # step 10
        ls[0].last_checkpoint = 10
        # Waits for a newcomer; its stream may break in the outage, as the scaler's does.
        ResizeWatch(env.stub, JOB, 2, 3, deadline_s=60.0)
        await eventually(lambda: 2 in env.coordinator.jobs[JOB].resizes, what="resize 2")
        store.down = True
        for fl in ls:
            fl.phase = pb.WORKER_PHASE_IDLE
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await fl.heartbeat(steps=0)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        ls[0].exited = True
        env.clock.advance(TUNING.heartbeat_timeout_s + 5)
        await env.coordinator.call(env.coordinator.tick)  # cannot reload: nothing decided
        store.down = False
        await env.coordinator.call(env.coordinator.tick)  # reloads; member 0's end recorded
        await ls[1].heartbeat(steps=0)
        final = await ResizeWatch(env.stub, JOB, 2, 3).final()
        assert final.phase == P.RESIZE_PHASE_ABORTED, final.message
        assert "finished at step 10" in final.message
        for _ in range(3):  # far past the heartbeat timeout: nothing is lost
            env.clock.advance(TUNING.heartbeat_timeout_s)
            await env.coordinator.call(env.coordinator.tick)
        st = await env.status()
        assert st.finished and st.lost_steps_total == 0
        assert [(m.state, m.phase, m.step) for m in st.members] == [
            (pb.MEMBER_STATE_GONE, pb.WORKER_PHASE_IDLE, 10),
            (pb.MEMBER_STATE_GONE, pb.WORKER_PHASE_IDLE, 10),
        ]
        assert env.coordinator.metrics.registry.get_sample_value(
            "tide_coordinator_members_lost_total", {"job_id": JOB}
        ) in (None, 0.0)
    finally:
        await close_env(env)


class _SlowCommits:
    """A store whose commits take ``slow_s`` of the (fake) clock: the retries of a commit
    that waited out an outage and then went through."""

    def __init__(self, inner: CoordinatorStore) -> None:
        self.inner = inner
        self.clock: FakeClock | None = None
        self.slow_s = 0.0

    def save(self, unit: Unit) -> None:
        if self.slow_s and self.clock is not None:
            self.clock.advance(self.slow_s)
        self.inner.save(unit)

    def load_all(self) -> list[JobSnapshot]:
        return self.inner.load_all()


async def test_a_commit_that_waited_out_an_outage_is_nobodys_silence() -> None:
    """Heartbeats queue behind a commit that retries through an outage (and those whose
    deadline passes are never heard): the members are not lost for it."""
    store = _SlowCommits(MemoryStore())
    env = await make_env(store, TUNING)
    store.clock = env.clock
    try:
        ls = await _form(env, 2)
        await env.heartbeat_all(steps=4)
        ls[0].last_checkpoint = 5  # its report is a commit
        store.slow_s = TUNING.heartbeat_timeout_s + 5
        await ls[0].heartbeat(steps=0)
        store.slow_s = 0.0
        await env.coordinator.call(env.coordinator.tick)
        st = await env.status()
        assert [m.state for m in st.members] == [pb.MEMBER_STATE_ACTIVE] * 2
        assert (st.generation, st.lost_steps_total) == (1, 0)
        # Silence after it still counts.
        env.clock.advance(TUNING.heartbeat_timeout_s + 1)
        await env.coordinator.call(env.coordinator.tick)
        assert env.coordinator.jobs[JOB].active_resize() is None
        assert not env.coordinator.jobs[JOB].current_members()
    finally:
        await close_env(env)
