"""Losses, deadlines and fencing of the coordinator over a real socket, driven by fake
launchers and a fake clock."""

from __future__ import annotations

import grpc
import pytest

from tests.coordinator.fakes import TIMEOUT_S, ResizeWatch
from tests.coordinator.support import JOB, Env, form, no_pending
from tests.support.poll import eventually
from tide.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.component

K = pb.Directive.Kind
P = pb.ResizePhase


async def test_barrier_deadline_aborts_and_members_resume_without_restart(env: Env) -> None:
    ls = await form(env, 2)
    await env.heartbeat_all()
    newcomer = await env.launcher(2)
    ls[1].answer_checkpoint = False
    w = ResizeWatch(env.stub, JOB, 2, 3, deadline_s=10.0)
    await eventually(lambda: K.KIND_CHECKPOINT in ls[1].kinds(), what="checkpoint sent")
    await eventually(lambda: _acked(env, 2) == {ls[0].member_id}, what="rank 0 ack")

    env.clock.advance(10.5)
    env.coordinator.tick()
    final = await w.final()

    assert final.phase == P.RESIZE_PHASE_ABORTED
    assert ls[1].member_id in final.message
    await eventually(lambda: all(K.KIND_RESUME in fl.kinds() for fl in ls), what="RESUME")
    assert [fl.worker_starts for fl in ls] == [1, 1]
    assert newcomer.kinds() == []
    st = await env.status()
    assert (st.generation, st.world_size, st.last_checkpoint_step) == (1, 2, 0)


def _acked(env: Env, decision_id: int) -> set[str]:
    return set(env.coordinator.jobs[JOB].resizes[decision_id].acked)


async def test_newcomer_lost_during_barrier_aborts_and_others_resume(env: Env) -> None:
    ls = await form(env, 2)
    await env.heartbeat_all()
    newcomer = await env.launcher(2)
    ls[1].answer_checkpoint = False  # keeps the barrier open
    w = ResizeWatch(env.stub, JOB, 2, 3, deadline_s=120.0)
    await eventually(lambda: K.KIND_CHECKPOINT in ls[1].kinds(), what="checkpoint sent")

    await newcomer.disconnect()
    newcomer.exited = True  # no more heartbeats: killed
    for _ in range(4):
        await env.heartbeat_all(advance_s=8.0)
        env.coordinator.tick()
    final = await w.final()

    assert final.phase == P.RESIZE_PHASE_ABORTED
    assert newcomer.member_id in final.message
    await eventually(lambda: all(K.KIND_RESUME in fl.kinds() for fl in ls), what="RESUME")
    assert [fl.worker_starts for fl in ls] == [1, 1]
    assert [fl.generation for fl in ls] == [1, 1]
    st = await env.status()
    assert (st.generation, st.world_size) == (1, 2)


async def test_active_member_lost_during_barrier_aborts_then_survivors_re_form(env: Env) -> None:
    ls = await form(env, 3)
    await env.heartbeat_all()
    ls[2].answer_checkpoint = False
    w = ResizeWatch(env.stub, JOB, 2, 2, deadline_s=120.0)
    await eventually(lambda: K.KIND_CHECKPOINT in ls[1].kinds(), what="checkpoint sent")
    await ls[1].disconnect()
    ls[1].exited = True
    for _ in range(4):
        await env.heartbeat_all(advance_s=8.0)
        env.coordinator.tick()
    final = await w.final()

    assert final.phase == P.RESIZE_PHASE_ABORTED
    await eventually(lambda: ls[0].generation == 2 == ls[2].generation, what="recovery")
    assert (ls[0].rank, ls[2].rank) == (0, 1)
    assert K.KIND_RESUME not in ls[0].kinds()  # g is broken: restart, not resume


async def test_unplanned_loss_re_forms_from_last_checkpoint_and_counts_lost_steps(
    env: Env,
) -> None:
    ls = await form(env, 2)
    await env.heartbeat_all()
    ls.append(await env.launcher(2))
    w = ResizeWatch(env.stub, JOB, 2, 3)
    await eventually(lambda: all(fl.generation == 2 for fl in ls), what="generation 2")
    await eventually(lambda: no_pending(env))
    await env.heartbeat_all()
    ck = (await w.final()).checkpoint_step

    # ls[1] dies; the others train on, heartbeating, until it times out (30 s). Rank 0's
    # worker writes a periodic checkpoint on the way and its launcher reports it.
    await ls[1].disconnect()
    ls[1].exited = True
    for i in range(3):
        await env.heartbeat_all(steps=2, advance_s=8.0)
        if i == 1:
            ls[0].last_checkpoint = ls[0].step
        env.coordinator.tick()
    periodic = ls[0].last_checkpoint
    assert periodic > ck
    reached = max(ls[0].step, ls[2].step)
    await env.heartbeat_all(steps=0, advance_s=8.0)
    env.coordinator.tick()

    await eventually(lambda: ls[0].generation == 3 == ls[2].generation, what="generation 3")
    assert (ls[0].rank, ls[2].rank) == (0, 1)
    assert ls[0].restore_step == ls[2].restore_step == periodic  # named exactly
    await eventually(lambda: no_pending(env), what="rendezvous acks")
    st = await env.status()
    assert (st.generation, st.world_size, st.last_checkpoint_step) == (3, 2, periodic)
    assert st.lost_steps_total == reached - periodic > 0
    assert ls[1].member_id not in {m.member_id for m in st.members}


async def test_failed_worker_names_the_reported_checkpoint_and_late_progress_counts(
    env: Env,
) -> None:
    ls = await form(env, 2)
    for _ in range(3):
        await env.heartbeat_all(steps=4)  # step 13
    ls[0].last_checkpoint = 10
    await env.heartbeat_all(steps=1)  # step 14; rank 0 reports the checkpoint of step 10
    ls[1].step += 2  # rank 1's worker reached 16 and died; its launcher says so at once
    ls[1].phase = pb.WORKER_PHASE_FAILED
    await ls[1].heartbeat(steps=0)
    await eventually(lambda: ls[0].generation == 2 == ls[1].generation, what="recovery")
    assert ls[0].restore_step == 10
    # Counted once the new workers said what they restored (their RENDEZVOUS acks).
    await eventually(lambda: no_pending(env), what="rendezvous acks")
    st = await env.status()
    assert st.lost_steps_total == 16 - 10

    # Rank 0's launcher, replacing its worker, reports where the old one stopped: step 17
    # (it finished a step the dead peer had not reported). The count follows.
    rank0 = env.coordinator.jobs[JOB].members[ls[0].member_id]
    await env.stub.Heartbeat(
        pb.HeartbeatRequest(
            member_id=rank0.member_id, generation=1, phase=pb.WORKER_PHASE_RUNNING, step=17
        ),
        timeout=TIMEOUT_S,
    )
    st = await env.status()
    assert st.lost_steps_total == 17 - 10
    assert env.coordinator.jobs[JOB].generations[2].lost_steps == 7
    # An older or equal report changes nothing.
    await env.stub.Heartbeat(
        pb.HeartbeatRequest(
            member_id=rank0.member_id, generation=1, phase=pb.WORKER_PHASE_RUNNING, step=15
        ),
        timeout=TIMEOUT_S,
    )
    assert (await env.status()).lost_steps_total == 7


async def test_failed_worker_rejoins_with_a_new_worker(env: Env) -> None:
    ls = await form(env, 2)
    await env.heartbeat_all(steps=4)
    ls[1].phase = pb.WORKER_PHASE_FAILED
    await ls[1].heartbeat()
    await eventually(lambda: ls[0].generation == 2 == ls[1].generation, what="generation 2")
    assert [fl.worker_starts for fl in ls] == [2, 2]
    assert ls[1].restore_step == 0  # no coordinated checkpoint yet
    # Counted once the new workers said what they restored (their RENDEZVOUS acks).
    await eventually(lambda: no_pending(env), what="rendezvous acks")
    st = await env.status()
    assert st.lost_steps_total == 5  # steps 1..5 ran, no checkpoint to restore from


async def test_fencing_rejects_stale_acks_and_reports_generation_on_heartbeat(env: Env) -> None:
    ls = await form(env, 2)
    await env.heartbeat_all()
    ls[0].handle_directives = False
    w = ResizeWatch(env.stub, JOB, 2, 1, deadline_s=60.0)
    await eventually(lambda: K.KIND_CHECKPOINT in ls[0].kinds(), what="checkpoint sent")
    ck = next(d for d in ls[0].received if d.kind == K.KIND_CHECKPOINT)

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ls[0].stub.Ack(
            pb.AckRequest(
                member_id=ls[0].member_id, directive_id=ck.directive_id, generation=7, ok=True
            ),
            timeout=TIMEOUT_S,
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    resp = await env.stub.AbortResize(
        pb.AbortResizeRequest(decision_id=2, job_id=JOB, reason="test"), timeout=TIMEOUT_S
    )
    assert resp.phase == P.RESIZE_PHASE_ABORTED
    assert (await w.final()).phase == P.RESIZE_PHASE_ABORTED

    ls[1].phase = pb.WORKER_PHASE_FAILED  # recovery moves the job to generation 2
    await ls[1].heartbeat()
    hb = await ls[0].heartbeat()  # ls[0] still believes it is in generation 1
    assert hb.generation == 2
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ls[0].stub.Ack(
            pb.AckRequest(
                member_id=ls[0].member_id, directive_id=ck.directive_id, generation=1, ok=True
            ),
            timeout=TIMEOUT_S,
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "generation 2" in (err.value.details() or "")


async def test_a_heartbeat_of_a_generation_left_twice_is_stale(env: Env) -> None:
    """A launcher may report its previous generation (RENDEZVOUS in flight, or its last
    word); one it left before that is rejected, and does not count as liveness."""
    ls = await form(env, 2)
    await env.heartbeat_all()
    for g in (2, 3):  # two recoveries, each heard by both launchers
        ls[1].phase = pb.WORKER_PHASE_FAILED
        await ls[1].heartbeat()
        await eventually(lambda g=g: ls[0].generation == g == ls[1].generation, what=f"gen {g}")
        await env.heartbeat_all()
    ls[0].generation = 2  # the previous one: accepted
    assert (await ls[0].heartbeat()).generation == 3
    ls[0].generation = 1
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ls[0].heartbeat()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "generation 1" in (err.value.details() or "")
    seen = env.coordinator.jobs[JOB].members[ls[0].member_id].last_heartbeat_at
    env.clock.advance(1.0)
    with pytest.raises(grpc.aio.AioRpcError):
        await ls[0].heartbeat()
    assert env.coordinator.jobs[JOB].members[ls[0].member_id].last_heartbeat_at == seen
