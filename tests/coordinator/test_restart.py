"""A coordinator restarted over its store: the restart rules, on every store.

The in-memory store, SQLite and PostgreSQL run the same scenarios, so the SQL
store is checked for the semantics the core relies on (atomic units, reload,
versions), not only for round trips.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from tests.coordinator.fakes import ResizeWatch, ts
from tests.coordinator.support import JOB, TUNING, Env, close_env, make_env
from tests.support.poll import eventually
from tide.base.errors import Conflict
from tide.services.coordinator.domain import JobRecord
from tide.services.coordinator.settings import CoordinatorSettings
from tide.services.coordinator.sql_store import SqlStore
from tide.services.coordinator.store import CoordinatorStore, MemoryStore, Unit
from tide.services.store import db
from tide.services.testing.clock import FakeClock
from tide.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.integration

K = pb.Directive.Kind
P = pb.ResizePhase


@pytest.fixture(
    params=[
        pytest.param("memory"),
        pytest.param("sqlite"),
        pytest.param("pg", marks=pytest.mark.postgres),
    ]
)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CoordinatorStore]:
    if request.param == "memory":
        yield MemoryStore()
        return
    url = (
        f"sqlite:///{tmp_path / 'coord.db'}"
        if request.param == "sqlite"
        else request.getfixturevalue("pg_schema_url")
    )
    db.upgrade(url)
    engine = db.make_engine(url)
    # The store's timestamps come from the env's FakeClock start; only stored, never compared.
    yield SqlStore(db.make_session_factory(engine), FakeClock().now)
    engine.dispose()


@pytest.fixture
async def senv(store: CoordinatorStore) -> AsyncIterator[Env]:
    e = await make_env(store)
    yield e
    await close_env(e)


async def _form(env: Env, n: int) -> None:
    ls = [await env.launcher(i) for i in range(n)]
    w = ResizeWatch(env.stub, JOB, 1, n)
    await eventually(lambda: all(fl.generation == 1 for fl in ls), what="generation 1")
    await eventually(lambda: not _pending(env), what="acks")
    await env.heartbeat_all()
    assert (await w.final()).phase == P.RESIZE_PHASE_COMPLETED


def _pending(env: Env) -> list[str]:
    rt = env.coordinator.jobs[JOB]
    return [d.directive_id for m in rt.members for d in rt.pending_directives(m)]


async def _reconnect_all(env: Env) -> None:
    for fl in env.launchers:
        if not fl.exited:
            await fl.disconnect()
            await fl.register()
            await fl.connect()


async def test_restart_during_barrier_aborts_and_holders_resume(senv: Env) -> None:
    env = senv
    await _form(env, 2)
    await env.heartbeat_all()
    ls = list(env.launchers)
    newcomer = await env.launcher(2)
    ls[1].answer_checkpoint = False
    ResizeWatch(env.stub, JOB, 2, 3, deadline_s=60.0)
    await eventually(lambda: K.KIND_CHECKPOINT in ls[1].kinds(), what="checkpoint sent")
    await eventually(lambda: env.coordinator.jobs[JOB].resizes[2].acked, what="rank 0 held")

    await env.restart()
    await _reconnect_all(env)
    await eventually(lambda: all(K.KIND_RESUME in fl.kinds() for fl in ls), what="RESUME")

    again = ResizeWatch(env.stub, JOB, 2, 3)
    final = await again.final()
    assert final.phase == P.RESIZE_PHASE_ABORTED
    assert "restarted" in final.message
    assert [fl.worker_starts for fl in ls] == [1, 1]
    assert newcomer.state == pb.MEMBER_STATE_STANDBY
    st = await env.status()
    assert (st.generation, st.world_size) == (1, 2)
    # The job goes on: a new decision grows it once everyone heartbeats again.
    ls[1].answer_checkpoint = True
    await env.heartbeat_all()
    w = ResizeWatch(env.stub, JOB, 3, 3)
    await eventually(lambda: all(fl.generation == 2 for fl in env.launchers), what="grown")
    await eventually(lambda: not _pending(env))
    await env.heartbeat_all()
    assert (await w.final()).phase == P.RESIZE_PHASE_COMPLETED


async def test_restart_after_rendezvous_carries_the_resize_to_completion(senv: Env) -> None:
    env = senv
    await _form(env, 2)
    await env.heartbeat_all()
    newcomer = await env.launcher(2)
    for fl in env.launchers:
        fl.answer_rendezvous = False
    ResizeWatch(env.stub, JOB, 2, 3, deadline_s=60.0)
    await eventually(
        lambda: (
            all(K.KIND_RENDEZVOUS in fl.kinds()[1:] for fl in env.launchers[:2])
            and K.KIND_RENDEZVOUS in newcomer.kinds()
        ),
        what="rendezvous sent",
    )
    sent = {fl.member_id: fl.received[-1].directive_id for fl in env.launchers}

    await env.restart()
    for fl in env.launchers:
        fl.answer_rendezvous = True
    await _reconnect_all(env)
    assert [fl.state for fl in env.launchers] == [pb.MEMBER_STATE_ACTIVE] * 3
    await eventually(lambda: all(fl.generation == 2 for fl in env.launchers), what="g2")
    # The same directive came again: launchers that had seen it would dedup it.
    assert {fl.member_id: fl.received[-1].directive_id for fl in env.launchers} == sent
    await eventually(lambda: not _pending(env))
    await env.heartbeat_all()
    final = await ResizeWatch(env.stub, JOB, 2, 3).final()
    assert final.phase == P.RESIZE_PHASE_COMPLETED
    assert (final.generation, final.world_size) == (2, 3)
    st = await env.status()
    assert st.last_checkpoint_step == final.checkpoint_step > 0


async def test_restart_in_a_committing_barrier_confirms_the_prepared_group(
    store: CoordinatorStore,
) -> None:
    """Overlap mode, the coordinator killed once the CHECKPOINTs went out: they carried g+1's
    RENDEZVOUS, so the members switch to g+1's prepared workers at their hold, which train on
    while it is away (here to the budget's end). The restarted coordinator carries the
    barrier on; its RENDEZVOUS confirms that same group (the PREPAREs' endpoints, prepared),
    never a fresh one beside it, and a g+1 that finished before it was heard of completes
    the resize (tests/e2e/test_elastic.py::test_coordinator_killed_mid_resize_...)."""
    env = await make_env(store, dataclasses.replace(TUNING, resize_mode="overlap"))
    try:
        await _form(env, 2)
        await env.heartbeat_all()
        ls = list(env.launchers)
        await env.launcher(2)
        for fl in ls:
            fl.answer_checkpoint = False
        ResizeWatch(env.stub, JOB, 2, 3, deadline_s=60.0)
        await eventually(lambda: all(K.KIND_CHECKPOINT in fl.kinds() for fl in ls), what="sent")
        assert all(d.HasField("rendezvous") for fl in ls for d in fl.received[-1:])
        prepared = {
            fl.member_id: next(d for d in fl.received if d.kind == K.KIND_PREPARE).rendezvous
            for fl in env.launchers
        }

        await env.restart()
        for fl in ls:
            fl.answer_checkpoint = True
        await _reconnect_all(env)
        await eventually(lambda: all(fl.generation == 2 for fl in env.launchers), what="g2")
        await eventually(lambda: not _pending(env), what="acks")
        for fl in env.launchers:
            rdv = fl.received[-1].rendezvous
            assert rdv.prepared and rdv.rank == prepared[fl.member_id].rank
            assert rdv.master_endpoint == prepared[fl.member_id].master_endpoint
            assert rdv.trainer_endpoints == prepared[fl.member_id].trainer_endpoints
        # Each member's first word in g+1 is its end: the budget's last step, done.
        env.clock.advance(1.0)
        for fl in env.launchers:
            fl.phase, fl.step, fl.first_step_at = pb.WORKER_PHASE_IDLE, 200, env.clock.now()
            await fl.heartbeat(steps=0)
        final = await ResizeWatch(env.stub, JOB, 2, 3).final()
        assert final.phase == P.RESIZE_PHASE_COMPLETED, final.message
        assert (final.generation, final.lost_steps) == (2, 0)
        st = await env.status()
        assert st.finished and (st.generation, st.step) == (2, 200)
    finally:
        await close_env(env)


async def test_restart_while_leavers_drain_and_stayers_form_carries_the_shrink_on(
    senv: Env,
) -> None:
    env = senv
    await _form(env, 2)
    await env.heartbeat_all()
    stayer, leaver = env.launchers
    stayer.answer_rendezvous = False
    leaver.handle_directives = False
    ResizeWatch(env.stub, JOB, 2, 1, deadline_s=60.0)
    await eventually(lambda: K.KIND_CHECKPOINT in leaver.kinds(), what="barrier")
    ck = next(d for d in leaver.received if d.kind == K.KIND_CHECKPOINT)
    leaver.phase = pb.WORKER_PHASE_HOLDING
    await leaver.ack(ck, ok=True, held_at=ts(env.clock.now()))
    # DRAIN and the stayer's RENDEZVOUS are out together; neither is acked.
    await eventually(
        lambda: K.KIND_DRAIN in leaver.kinds() and K.KIND_RENDEZVOUS in stayer.kinds()[1:],
        what="drain and rendezvous sent",
    )
    sent = {fl.member_id: fl.received[-1].directive_id for fl in env.launchers}

    await env.restart()
    stayer.answer_rendezvous = True
    leaver.handle_directives = True
    await _reconnect_all(env)
    assert [fl.state for fl in env.launchers] == [
        pb.MEMBER_STATE_ACTIVE,
        pb.MEMBER_STATE_DRAINING,
    ]
    await eventually(lambda: leaver.exited and stayer.generation == 2, what="re-sent, acked")
    assert {fl.member_id: fl.received[-1].directive_id for fl in env.launchers} == sent
    await env.heartbeat_all()
    final = await ResizeWatch(env.stub, JOB, 2, 1).final()
    assert final.phase == P.RESIZE_PHASE_COMPLETED, final
    st = await env.status()
    assert (st.generation, st.world_size, st.lost_steps_total) == (2, 1, 0)
    assert [m.pod_name for m in st.members] == ["job-trainer-0"]


async def test_directive_ids_stay_unique_across_restarts(senv: Env) -> None:
    env = senv
    await _form(env, 1)
    before = {d.directive_id for d in env.launchers[0].received}
    await env.restart()
    await _reconnect_all(env)
    await env.heartbeat_all()
    env.launchers[0].phase = pb.WORKER_PHASE_FAILED
    await env.launchers[0].heartbeat()
    await eventually(lambda: env.launchers[0].generation == 2, what="recovery")
    after = {d.directive_id for d in env.launchers[0].received} - before
    assert after and not after & before


def test_second_writer_with_stale_version_conflicts(store: CoordinatorStore) -> None:
    job = JobRecord(job_id=JOB)
    store.save(Unit(job=job))
    stale = JobRecord(job_id=JOB, generation=5, version=job.version - 1)
    with pytest.raises(Conflict):
        store.save(Unit(job=stale))
    job.generation = 2
    store.save(Unit(job=job))
    [snap] = store.load_all()
    assert snap.job.generation == 2 and snap.job.version == job.version


async def test_downtime_longer_than_the_deadlines_does_not_lose_members(senv: Env) -> None:
    env = senv
    await _form(env, 2)
    await env.heartbeat_all()
    for fl in env.launchers:
        fl.answer_rendezvous = False
    env.launchers.append(await env.launcher(2))
    ResizeWatch(env.stub, JOB, 2, 3, deadline_s=20.0)
    await eventually(lambda: env.coordinator.jobs[JOB].job.generation == 2, what="g2 sent")

    env.clock.advance(120.0)  # the coordinator was down for two minutes
    await env.restart()
    env.coordinator.tick()
    for fl in env.launchers:
        fl.answer_rendezvous = True
    await _reconnect_all(env)
    await eventually(lambda: all(fl.generation == 2 for fl in env.launchers), what="g2")
    await eventually(lambda: not _pending(env))
    await env.heartbeat_all()
    final = await ResizeWatch(env.stub, JOB, 2, 3).final()
    assert final.phase == P.RESIZE_PHASE_COMPLETED, final.message


async def test_finished_job_and_reported_checkpoint_survive_a_restart(senv: Env) -> None:
    env = senv
    await _form(env, 2)
    await env.heartbeat_all()
    env.launchers[0].last_checkpoint = 2  # the final checkpoint, reported by rank 0
    for fl in env.launchers:
        fl.phase = pb.WORKER_PHASE_IDLE
        await fl.heartbeat(steps=0)
        fl.exited = True
    await env.restart()
    env.clock.advance(120.0)
    env.coordinator.tick()
    st = await env.status()
    assert (st.generation, st.world_size, st.lost_steps_total) == (1, 0, 0)
    assert st.last_checkpoint_step == st.step == 2
    assert [(m.state, m.phase, m.rank) for m in st.members] == [
        (pb.MEMBER_STATE_GONE, pb.WORKER_PHASE_IDLE, 0),
        (pb.MEMBER_STATE_GONE, pb.WORKER_PHASE_IDLE, 1),
    ]


def test_the_default_store_is_created_under_dot_tide(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    url = CoordinatorSettings().db
    db.upgrade(url)
    engine = db.make_engine(url)
    try:
        store = SqlStore(db.make_session_factory(engine), FakeClock().now)
        store.save(Unit(job=JobRecord(job_id=JOB)))
        assert [s.job.job_id for s in store.load_all()] == [JOB]
    finally:
        engine.dispose()
    assert (tmp_path / ".tide" / "tide.db").is_file()


async def test_a_failed_job_and_exact_lost_steps_survive_a_restart(
    store: CoordinatorStore,
) -> None:
    env = await make_env(store, dataclasses.replace(TUNING, restart_budget=1))
    try:
        await _form(env, 2)
        ls = env.launchers
        await env.heartbeat_all(steps=3)  # step 4
        for fl in ls:
            fl.restores = 3  # a checkpoint of step 3 nobody had reported
        ls[1].phase = pb.WORKER_PHASE_FAILED
        await ls[1].heartbeat(steps=0)
        await eventually(lambda: all(fl.generation == 2 for fl in ls) and not _pending(env))
        await env.heartbeat_all(advance_s=2.0)
        ls[1].phase = pb.WORKER_PHASE_FAILED
        ls[1].worker_exit = pb.WorkerExit(exit_code=-11, cause="was killed by SIGSEGV")
        await ls[1].heartbeat(steps=0)
        before = await env.status()
        assert before.failed and before.lost_steps_total == 4 - 3

        await env.restart()
        st = await env.status()
        assert (st.failed, st.failure, st.lost_steps_total) == (True, before.failure, 1)
        gen = env.coordinator.jobs[JOB].generations[2]
        assert (gen.reached_step, gen.restored_step, gen.lost_steps) == (4, 3, 1)
        watch = ResizeWatch(env.stub, JOB, 7, 2)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await watch.final()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        await close_env(env)
