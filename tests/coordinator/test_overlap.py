"""Overlap mode (docs/resize-protocol.md, "Overlap mode") over a real socket, with fake
launchers and a fake clock: g+1's group is prepared before the barrier, and a prepare
that fails falls back to the plain barrier or aborts with g untouched."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import pytest

from tests.coordinator.fakes import ResizeWatch
from tests.coordinator.support import JOB, TUNING, Env, close_env, form, make_env, no_pending
from tests.support.poll import eventually
from tide.services.coordinator.store import MemoryStore
from tide.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.component

K = pb.Directive.Kind
P = pb.ResizePhase
OVERLAP = dataclasses.replace(TUNING, resize_mode="overlap")


@pytest.fixture
async def overlap() -> AsyncIterator[Env]:
    e = await make_env(MemoryStore(), OVERLAP)
    yield e
    await close_env(e)


async def test_grow_prepares_g_plus_1_before_the_barrier(overlap: Env) -> None:
    env = overlap
    ls = await form(env, 2)
    assert all(fl.rendezvous_prepared == [False] for fl in ls)  # a first generation
    await env.heartbeat_all(steps=3)
    newcomer = await env.launcher(2)
    w = ResizeWatch(env.stub, JOB, 2, 3)
    everyone = [*ls, newcomer]
    await eventually(lambda: all(fl.generation == 2 for fl in everyone), what="generation 2")
    await eventually(lambda: no_pending(env), what="acks")
    await env.heartbeat_all(advance_s=2.0)
    final = await w.final()

    assert final.phase == P.RESIZE_PHASE_COMPLETED
    phases = w.phases()
    assert phases.index(P.RESIZE_PHASE_PREPARING) < phases.index(P.RESIZE_PHASE_CHECKPOINTING)
    for fl in everyone:
        prepare = next(d for d in fl.received if d.kind == K.KIND_PREPARE)
        rdv = next(d for d in fl.received if d.kind == K.KIND_RENDEZVOUS and d.generation == 2)
        # The RENDEZVOUS repeats what the PREPARE said, with the barrier's step.
        assert prepare.generation == 1
        assert (prepare.rendezvous.generation, prepare.rendezvous.rank) == (2, fl.rank)
        assert rdv.rendezvous.master_endpoint == prepare.rendezvous.master_endpoint
        assert list(rdv.rendezvous.trainer_endpoints) == list(prepare.rendezvous.trainer_endpoints)
        assert rdv.rendezvous.restore_step == 13
        assert fl.rendezvous_prepared[-1] is True
    # Stayers got their CHECKPOINT only after every PREPARE was acked, and it carried their
    # RENDEZVOUS of g+1 (restore step S): the barrier commits at each one's hold.
    for fl in ls:
        kinds = fl.kinds()
        assert kinds.index(K.KIND_PREPARE) < kinds.index(K.KIND_CHECKPOINT)
        ckpt = next(d for d in fl.received if d.kind == K.KIND_CHECKPOINT)
        rdv = next(d for d in fl.received if d.kind == K.KIND_RENDEZVOUS and d.generation == 2)
        assert ckpt.HasField("rendezvous") and ckpt.rendezvous.restore_step == 13
        assert (ckpt.rendezvous.generation, ckpt.rendezvous.rank) == (2, fl.rank)
        assert ckpt.rendezvous.master_endpoint == rdv.rendezvous.master_endpoint
    assert final.lost_steps == 0


async def test_a_newcomer_that_cannot_prepare_falls_back_to_the_plain_barrier(
    overlap: Env,
) -> None:
    env = overlap
    ls = await form(env, 2)
    await env.heartbeat_all(steps=3)
    newcomer = await env.launcher(2)
    newcomer.prepare_ok = None  # its group never forms
    w = ResizeWatch(env.stub, JOB, 2, 3, deadline_s=5.0)
    await eventually(lambda: w.last.phase == P.RESIZE_PHASE_PREPARING, what="preparing")
    assert not [d for d in ls[0].received if d.kind == K.KIND_CHECKPOINT]
    env.clock.advance(6.0)  # past the prepare deadline
    env.coordinator.tick()
    everyone = [*ls, newcomer]
    await eventually(lambda: all(fl.generation == 2 for fl in everyone), what="generation 2")
    await eventually(lambda: no_pending(env), what="acks")
    await env.heartbeat_all(advance_s=1.0)
    final = await w.final()

    assert final.phase == P.RESIZE_PHASE_COMPLETED
    assert any("falling back to the plain barrier" in p.message for p in w.updates)
    assert all(fl.rendezvous_prepared[-1] is False for fl in everyone)
    # The fallback's barrier is the plain one: no CHECKPOINT commits to a prepared g+1.
    ckpts = [d for fl in ls for d in fl.received if d.kind == K.KIND_CHECKPOINT]
    assert ckpts and not any(d.HasField("rendezvous") for d in ckpts)
    assert final.lost_steps == 0


async def test_a_nack_with_fallback_abort_leaves_g_training() -> None:
    env = await make_env(MemoryStore(), dataclasses.replace(OVERLAP, prepare_fallback="abort"))
    try:
        ls = await form(env, 2)
        await env.heartbeat_all(steps=3)
        newcomer = await env.launcher(2)
        newcomer.prepare_ok = False
        w = ResizeWatch(env.stub, JOB, 2, 3)
        final = await w.final()
        assert final.phase == P.RESIZE_PHASE_ABORTED
        assert "could not prepare: no memory" in final.message
        # g was never stopped: no CHECKPOINT, no RESUME, same generation.
        for fl in ls:
            assert K.KIND_CHECKPOINT not in fl.kinds() and K.KIND_RESUME not in fl.kinds()
            assert fl.generation == 1
        assert (await env.status()).generation == 1
    finally:
        await close_env(env)


async def test_a_shrink_prepares_the_stayers_only_and_drains_the_leaver(overlap: Env) -> None:
    env = overlap
    ls = await form(env, 3)
    await env.heartbeat_all(steps=3)
    w = ResizeWatch(env.stub, JOB, 2, 2)
    await eventually(lambda: ls[2].exited, what="pod 2 drained")
    await eventually(lambda: ls[0].generation == 2 and ls[1].generation == 2, what="gen 2")
    await eventually(lambda: no_pending(env), what="acks")
    await env.heartbeat_all()
    final = await w.final()

    assert final.phase == P.RESIZE_PHASE_COMPLETED
    assert final.world_size == 2 and final.lost_steps == 0
    # The leaver trains to the barrier like everyone, but gets no PREPARE: it is no part of g+1.
    assert K.KIND_PREPARE not in ls[2].kinds()
    assert ls[2].kinds().index(K.KIND_CHECKPOINT) < ls[2].kinds().index(K.KIND_DRAIN)
    assert [fl.rendezvous_prepared[-1] for fl in ls[:2]] == [True, True]


def _acked(env: Env, member_id: str) -> bool:
    r = env.coordinator.jobs[JOB].resizes[2]
    return member_id in r.acked or r.phase.name != "CHECKPOINTING"


@pytest.mark.parametrize("rank0_acks_first", [True, False])
async def test_a_committing_checkpoint_that_came_late_moves_the_barrier_to_where_g_held(
    overlap: Env, rank0_acks_first: bool
) -> None:
    """In a generation's first seconds no step rate is known: the barrier is set 2 steps
    ahead and g may pass it before the CHECKPOINT arrives. Every rank then holds together at
    a later step, where each launcher switches to its prepared worker: the barrier moves
    there and g+1 restores it (it used to abort, which a switch at S only could not undo)."""
    env = overlap
    ls = await form(env, 2)
    await env.heartbeat_all()
    newcomer = await env.launcher(2)
    for fl in ls:
        fl.held_past = 5
        fl.answer_checkpoint = False
    w = ResizeWatch(env.stub, JOB, 2, 3)
    await eventually(lambda: all(K.KIND_CHECKPOINT in fl.kinds() for fl in ls), what="sent")
    ckpt = next(d for d in ls[0].received if d.kind == K.KIND_CHECKPOINT)
    assert ckpt.HasField("rendezvous"), "the barrier commits"
    for fl in ls if rank0_acks_first else ls[::-1]:
        fl.answer_checkpoint = True
        await fl.disconnect()
        await fl.connect()
        await eventually(lambda f=fl: _acked(env, f.member_id), what="acked")  # type: ignore[misc]
    everyone = [*ls, newcomer]
    await eventually(lambda: all(fl.generation == 2 for fl in everyone), what="generation 2")
    await eventually(lambda: no_pending(env), what="acks")
    await env.heartbeat_all(advance_s=2.0)
    final = await w.final()

    assert final.phase == P.RESIZE_PHASE_COMPLETED, final.message
    held = ckpt.checkpoint_step + 5
    assert final.checkpoint_step == held and final.lost_steps == 0
    assert {fl.restore_step for fl in everyone} == {held}
    assert all(fl.rendezvous_prepared[-1] is True for fl in everyone)


async def test_a_committing_barrier_whose_ranks_held_apart_fails_and_re_forms(
    overlap: Env,
) -> None:
    """Rank 0 held past S, rank 1 at S: the ranks' agreement on the stop step broke, and
    each launcher may have switched at its own hold. The resize fails loudly and the job
    re-forms from its newest good checkpoint (not a RESUME of g)."""
    env = overlap
    ls = await form(env, 2)
    await env.heartbeat_all()
    await env.launcher(2)
    ls[0].held_past = 2
    w = ResizeWatch(env.stub, JOB, 2, 3)
    final = await w.final()

    assert final.phase == P.RESIZE_PHASE_FAILED, final.message
    assert "held at different steps" in final.message
    assert all(K.KIND_RESUME not in fl.kinds() for fl in ls)
