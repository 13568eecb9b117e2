"""The coordinator over a real socket, driven by fake launchers and a fake clock."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from tests.coordinator.fakes import TIMEOUT_S, FakeLauncher, ResizeWatch, ts
from tests.coordinator.support import JOB, TUNING, Env, close_env, form, make_env, no_pending
from tests.support.poll import eventually
from tide.base.errors import Unavailable
from tide.services.coordinator.store import MemoryStore, Unit
from tide.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.component

K = pb.Directive.Kind
P = pb.ResizePhase


async def test_first_generation_forms_when_target_members_registered(env: Env) -> None:
    ls = await form(env, 2)
    assert [fl.rank for fl in ls] == [0, 1]
    assert ls[1].master == "127.0.0.1:20000"
    assert ls[0].restore_step == 0
    st = await env.status()
    assert (st.generation, st.world_size) == (1, 2)
    assert [m.state for m in st.members] == [pb.MEMBER_STATE_ACTIVE] * 2


async def test_grow_2_to_3_checkpoints_ahead_and_measures_the_pause(env: Env) -> None:
    ls = await form(env, 2)
    await env.heartbeat_all(steps=3)  # step 4 at 3 steps/s
    newcomer = await env.launcher(2)
    assert newcomer.state == pb.MEMBER_STATE_STANDBY

    w = ResizeWatch(env.stub, JOB, 2, 3)
    everyone = [*ls, newcomer]
    await eventually(lambda: all(fl.generation == 2 for fl in everyone), what="generation 2")
    await eventually(lambda: no_pending(env), what="acks")
    # S = highest step 4 + max(2 steps, ceil(3 steps/s * 3 s)) = 13
    checkpoints = [d for d in ls[0].received if d.kind == K.KIND_CHECKPOINT]
    assert [d.checkpoint_step for d in checkpoints] == [13]
    assert not [d for d in newcomer.received if d.kind == K.KIND_CHECKPOINT]
    await env.heartbeat_all(advance_s=2.0)
    final = await w.final()

    assert final.phase == P.RESIZE_PHASE_COMPLETED
    assert (final.generation, final.world_size, final.checkpoint_step) == (2, 3, 13)
    # Held at T (the acks), first step of g+1 at T + 2 s.
    assert final.pause_s == pytest.approx(2.0, abs=1e-3)
    assert final.pause.checkpoint_write_s == pytest.approx(0.25)
    assert final.pause.group_init_s == pytest.approx(0.4)
    assert final.lost_steps == 0
    assert P.RESIZE_PHASE_CHECKPOINTING in w.phases()
    assert w.phases().index(P.RESIZE_PHASE_CHECKPOINTING) < w.phases().index(
        P.RESIZE_PHASE_RENDEZVOUS
    )
    assert [fl.rank for fl in everyone] == [0, 1, 2]
    assert {fl.restore_step for fl in everyone} == {13}
    st = await env.status()
    assert (st.generation, st.world_size, st.last_checkpoint_step) == (2, 3, 13)


def _acked(env: Env, member_id: str) -> bool:
    r = env.coordinator.jobs[JOB].resizes[2]
    return member_id in r.acked or r.phase.name != "CHECKPOINTING"


@pytest.mark.parametrize("rank0_acks_first", [True, False])
async def test_a_checkpoint_that_came_late_moves_the_barrier_to_where_g_held(
    env: Env, rank0_acks_first: bool
) -> None:
    """In a generation's first seconds no step rate is known: the barrier is set 2 steps
    ahead and g may pass it before the CHECKPOINT arrives. Every rank then holds together
    at a later step and rank 0 writes that one: the barrier moves there (it used to abort)."""
    ls = await form(env, 2)
    await env.heartbeat_all()
    newcomer = await env.launcher(2)
    order = ls if rank0_acks_first else ls[::-1]
    for fl in ls:
        fl.held_past = 5
        fl.answer_checkpoint = False
    w = ResizeWatch(env.stub, JOB, 2, 3)
    await eventually(lambda: all(K.KIND_CHECKPOINT in fl.kinds() for fl in ls), what="sent")
    step = next(d.checkpoint_step for d in ls[0].received if d.kind == K.KIND_CHECKPOINT)
    for fl in order:
        fl.answer_checkpoint = True
        await fl.disconnect()
        await fl.connect()
        await eventually(lambda f=fl: _acked(env, f.member_id), what="acked")  # type: ignore[misc]
    everyone = [*ls, newcomer]
    await eventually(lambda: all(fl.generation == 2 for fl in everyone), what="generation 2")
    await env.heartbeat_all(advance_s=2.0)
    final = await w.final()
    assert final.phase == P.RESIZE_PHASE_COMPLETED, final.message
    assert final.checkpoint_step == step + 5 and final.lost_steps == 0
    assert {fl.restore_step for fl in everyone} == {step + 5}


async def test_a_leave_request_is_shown_and_a_named_uid_drains_that_member(env: Env) -> None:
    """Preemption (docs/preemption.md): the launcher's SIGTERM reaches the scaler as the
    member's leave_requested; the scaler's Resize names its pod by uid: only it drains."""
    ls = await form(env, 3)
    ls[1].leave_requested = True
    ls[1].leave_deadline_s = 1_900_000_000.5
    await env.heartbeat_all()
    st = await env.status()
    assert [m.leave_requested for m in st.members] == [False, True, False]
    # The grace's end reaches the scaler, which plans the leave within it.
    assert [m.HasField("leave_deadline") for m in st.members] == [False, True, False]
    assert st.members[1].leave_deadline.ToNanoseconds() == 1_900_000_000_500_000_000
    assert [m.pod_uid for m in st.members] == ["uid-0", "uid-1", "uid-2"]
    w = ResizeWatch(env.stub, JOB, 2, 2, leaving=("uid-1",))
    await eventually(lambda: ls[1].exited, what="pod 1 drained")
    await eventually(lambda: ls[0].generation == 2 and ls[2].generation == 2, what="gen 2")
    await env.heartbeat_all()
    final = await w.final()
    assert final.phase == P.RESIZE_PHASE_COMPLETED and final.lost_steps == 0
    assert not ls[0].exited and not ls[2].exited


async def test_shrink_3_to_1_drains_the_highest_indexes(env: Env) -> None:
    ls = await form(env, 3)
    await env.heartbeat_all()
    w = ResizeWatch(env.stub, JOB, 2, 1)
    await eventually(lambda: ls[1].exited and ls[2].exited, what="drained")
    await eventually(lambda: ls[0].generation == 2, what="generation 2")
    await env.heartbeat_all()
    final = await w.final()

    assert final.phase == P.RESIZE_PHASE_COMPLETED
    # The leavers drain while the stayer forms g+1: no separate DRAINING phase.
    assert P.RESIZE_PHASE_DRAINING not in w.phases()
    assert w.phases().index(P.RESIZE_PHASE_CHECKPOINTING) < w.phases().index(
        P.RESIZE_PHASE_RENDEZVOUS
    )
    assert (final.generation, final.world_size) == (2, 1)
    assert ls[0].rank == 0 and ls[0].restore_step == final.checkpoint_step
    assert ls[2].kinds() == [K.KIND_RENDEZVOUS, K.KIND_CHECKPOINT, K.KIND_DRAIN]
    st = await env.status()
    assert [m.pod_name for m in st.members] == ["job-trainer-0"]


async def _shrink_2_to_1_with_a_silent_leaver(env: Env) -> tuple[list[FakeLauncher], ResizeWatch]:
    """A 2 -> 1 shrink whose leaver receives DRAIN but does not act on it, so the test
    decides when (or whether) its ack comes."""
    ls = await form(env, 2)
    await env.heartbeat_all()
    ls[1].handle_directives = False
    w = ResizeWatch(env.stub, JOB, 2, 1, deadline_s=10.0)
    await eventually(lambda: K.KIND_CHECKPOINT in ls[1].kinds(), what="barrier")
    ck = next(d for d in ls[1].received if d.kind == K.KIND_CHECKPOINT)
    ls[1].phase = pb.WORKER_PHASE_HOLDING
    await ls[1].ack(ck, ok=True, held_at=ts(env.clock.now()))
    assert ls[1].ack_errors == []
    return ls, w


async def test_leaver_acks_drain_after_the_stayers_already_run(env: Env) -> None:
    ls, w = await _shrink_2_to_1_with_a_silent_leaver(env)
    # The stayer's RENDEZVOUS does not wait for the leaver's DRAIN ack.
    await eventually(lambda: K.KIND_DRAIN in ls[1].kinds(), what="drain sent")
    await eventually(lambda: ls[0].generation == 2, what="stayer in generation 2")
    rt = env.coordinator.jobs[JOB]
    assert rt.pending_directives(ls[1].member_id)[0].kind.name == "DRAIN"
    await env.heartbeat_all()  # the stayer's first step in g+1; the leaver still holds in g
    await eventually(lambda: w.last.phase == P.RESIZE_PHASE_RENDEZVOUS, what="rendezvous")
    # Not COMPLETED while a leaver is still there: the scaler would kill its pod.
    assert not rt.resizes[2].phase.final
    assert P.RESIZE_PHASE_DRAINING not in w.phases()

    drain = next(d for d in ls[1].received if d.kind == K.KIND_DRAIN)
    assert drain.generation == 1
    await ls[1].ack(drain, ok=True)  # the job is in generation 2 by now
    assert ls[1].ack_errors == []
    final = await w.final()
    assert final.phase == P.RESIZE_PHASE_COMPLETED
    assert (final.generation, final.world_size, final.lost_steps) == (2, 1, 0)
    st = await env.status()
    # No re-formation and no loss: the leaver simply left.
    assert (st.generation, st.world_size, st.lost_steps_total) == (2, 1, 0)
    assert [m.pod_name for m in st.members] == ["job-trainer-0"]
    reg = env.coordinator.metrics.registry
    assert (
        reg.get_sample_value("tide_coordinator_members_lost_total", {"job_id": JOB}) or 0.0
    ) == 0.0
    assert ls[0].kinds().count(K.KIND_RENDEZVOUS) == 2  # g1 and g2 only


async def test_leaver_that_never_acks_drain_leaves_at_its_deadline_without_re_forming(
    env: Env,
) -> None:
    ls, w = await _shrink_2_to_1_with_a_silent_leaver(env)
    await eventually(lambda: ls[0].generation == 2, what="stayer in generation 2")
    await env.heartbeat_all()  # the stayer runs in g+1; the leaver heartbeats, holding in g
    env.coordinator.tick()
    rt = env.coordinator.jobs[JOB]
    assert rt.resizes[2].phase.name == "RENDEZVOUS"
    await env.heartbeat_all(advance_s=10.0)  # past the drain deadline (10 s)
    env.coordinator.tick()
    final = await w.final()
    assert final.phase == P.RESIZE_PHASE_COMPLETED, final
    st = await env.status()
    assert (st.generation, st.world_size, st.lost_steps_total) == (2, 1, 0)
    assert [m.pod_name for m in st.members] == ["job-trainer-0"]
    assert ls[0].kinds().count(K.KIND_RENDEZVOUS) == 2
    reg = env.coordinator.metrics.registry
    assert (
        reg.get_sample_value("tide_coordinator_members_lost_total", {"job_id": JOB}) or 0.0
    ) == 0.0
    # Its late heartbeat is told it has left; a late ack is accepted and changes nothing.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ls[1].heartbeat()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    drain = next(d for d in ls[1].received if d.kind == K.KIND_DRAIN)
    await ls[1].ack(drain, ok=True)
    assert ls[1].ack_errors == []
    assert (await env.status()).generation == 2


async def test_shrink_with_named_leaver_keeps_relative_rank_order(env: Env) -> None:
    ls = await form(env, 3)
    await env.heartbeat_all()
    w = ResizeWatch(env.stub, JOB, 2, 2, leaving=("job-trainer-0",))
    await eventually(lambda: ls[0].exited and ls[1].generation == 2 == ls[2].generation)
    await env.heartbeat_all()
    assert (await w.final()).phase == P.RESIZE_PHASE_COMPLETED
    assert (ls[1].rank, ls[2].rank) == (0, 1)
    assert ls[2].master == "127.0.0.1:20001"


async def test_resize_is_idempotent_on_decision_id_and_exclusive_per_job(env: Env) -> None:
    await form(env, 2)
    again = ResizeWatch(env.stub, JOB, 1, 2)
    final = await again.final()
    assert again.phases() == [P.RESIZE_PHASE_COMPLETED]
    assert final.generation == 1

    await env.launcher(2)
    first = ResizeWatch(env.stub, JOB, 2, 3, deadline_s=60.0)
    await eventually(lambda: first.updates, what="progress")
    env.launchers[1].answer_checkpoint = False
    other = ResizeWatch(env.stub, JOB, 3, 1)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await other.final()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    attach = ResizeWatch(env.stub, JOB, 2, 3)
    await eventually(lambda: attach.updates, what="re-attached")
    assert attach.last.decision_id == 2


async def test_reregistration_returns_same_member_and_unacked_directives_are_resent(
    env: Env,
) -> None:
    ls = await form(env, 2)
    await env.heartbeat_all()
    ls[1].handle_directives = False
    ResizeWatch(env.stub, JOB, 2, 1, deadline_s=60.0)
    await eventually(lambda: K.KIND_CHECKPOINT in ls[1].kinds(), what="checkpoint sent")
    first_id = ls[1].member_id
    await ls[1].disconnect()
    resp = await ls[1].register()
    assert resp.member_id == first_id
    assert resp.state == pb.MEMBER_STATE_ACTIVE and resp.generation == 1
    ls[1].handle_directives = True
    await ls[1].connect()
    await eventually(lambda: ls[1].kinds().count(K.KIND_CHECKPOINT) == 2, what="re-sent")
    ids = [d.directive_id for d in ls[1].received if d.kind == K.KIND_CHECKPOINT]
    assert ids[0] == ids[1]


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        ({"job_id": "no-namespace", "target_world_size": 1, "deadline_s": 5}, "job_id"),
        ({"job_id": JOB, "target_world_size": 0, "deadline_s": 5}, "target_world_size"),
        ({"job_id": JOB, "target_world_size": 2, "deadline_s": -1}, "deadline_s"),
        ({"job_id": JOB, "target_world_size": 2, "deadline_s": float("nan")}, "deadline_s"),
        (
            {"job_id": JOB, "target_world_size": 2, "deadline_s": 5, "min_world_size": 3},
            "min_world_size",
        ),
        (
            {"job_id": JOB, "target_world_size": 3, "deadline_s": 5, "world_multiple": 2},
            "target_world_size: 3 is not a multiple of world_multiple 2",
        ),
        (
            {"job_id": JOB, "target_world_size": 4, "deadline_s": 5, "world_multiple": 2}
            | {"min_world_size": 3},
            "min_world_size: must be 0 or target_world_size (4) with world_multiple 2",
        ),
    ],
    ids=[
        "bad-job-id",
        "zero-target",
        "negative-deadline",
        "nan-deadline",
        "min-above-target",
        "part-of-a-group",
        "a-grow-of-part-of-a-group",
    ],
)
async def test_bad_resize_requests_are_invalid_argument(
    env: Env, request_fields: dict[str, object], field: str
) -> None:
    call = env.stub.Resize(
        pb.ResizeRequest(decision_id=9, **request_fields),  # type: ignore[arg-type]
        timeout=TIMEOUT_S,
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (err.value.details() or ""), err.value.details()


async def test_unknown_ids_are_not_found_and_bad_register_invalid(env: Env) -> None:
    for call in (
        env.stub.Heartbeat(pb.HeartbeatRequest(member_id="nobody"), timeout=TIMEOUT_S),
        env.stub.GetJobStatus(pb.GetJobStatusRequest(job_id="ns/none"), timeout=TIMEOUT_S),
        env.stub.AbortResize(pb.AbortResizeRequest(decision_id=77), timeout=TIMEOUT_S),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await env.stub.Register(
            pb.RegisterRequest(job_id=JOB, pod_name="p", launcher_id="l", free_port=1),
            timeout=TIMEOUT_S,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "host" in (err.value.details() or "")


async def test_watch_job_streams_membership_and_generation_changes(env: Env) -> None:
    seen: list[pb.JobStatus] = []

    async def watch() -> None:
        async for st in env.stub.WatchJob(pb.GetJobStatusRequest(job_id=JOB), timeout=30):
            seen.append(st)

    await env.launcher(0)
    task = asyncio.create_task(watch())
    try:
        await eventually(lambda: seen, what="initial status")
        assert (seen[0].generation, len(seen[0].members)) == (0, 1)
        await env.launcher(1)
        await eventually(lambda: len(seen[-1].members) == 2, what="second member")
        w = ResizeWatch(env.stub, JOB, 1, 2)
        await eventually(lambda: seen[-1].generation == 1, what="generation 1")
        await eventually(lambda: no_pending(env))
        await env.heartbeat_all()
        await w.final()
        await eventually(lambda: not seen[-1].HasField("active_resize"), what="resize done")
        assert any(s.active_resize.phase == P.RESIZE_PHASE_RENDEZVOUS for s in seen)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class FlakyStore(MemoryStore):
    """Fails the next ``fail`` saves, as a database that went away would."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = 0

    def save(self, unit: Unit) -> None:
        if self.fail:
            self.fail -= 1
            raise Unavailable("database unavailable (injected)")
        super().save(unit)


async def test_failed_commit_sends_nothing_and_reloads_the_job() -> None:
    store = FlakyStore()
    env = await make_env(store)
    try:
        ls = await form(env, 2)
        await env.heartbeat_all()
        store.fail = 1
        w = ResizeWatch(env.stub, JOB, 2, 1)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await w.final()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # Nothing of the failed unit reached anyone, and the job is as committed.
        assert [K.KIND_CHECKPOINT in fl.kinds() for fl in ls] == [False, False]
        st = await env.status()
        assert (st.generation, st.world_size) == (1, 2)
        assert not st.HasField("active_resize")
        # The launchers' streams were bound to the discarded state: they reconnect.
        for fl in ls:
            await eventually(fl.stream_ended, what="stream ended")
            await fl.register()
            await fl.connect()
        await env.heartbeat_all()
        retry = ResizeWatch(env.stub, JOB, 2, 1)
        await eventually(lambda: ls[1].exited, what="drained on retry")
        await eventually(lambda: ls[0].generation == 2)
        await env.heartbeat_all()
        assert (await retry.final()).phase == P.RESIZE_PHASE_COMPLETED
    finally:
        await close_env(env)


async def test_metrics_count_outcomes_pauses_and_losses(env: Env) -> None:
    ls = await form(env, 2)
    await env.heartbeat_all()
    ls.append(await env.launcher(2))
    w = ResizeWatch(env.stub, JOB, 2, 3)
    await eventually(lambda: all(fl.generation == 2 for fl in ls))
    await eventually(lambda: no_pending(env))
    await env.heartbeat_all()
    await w.final()
    ls[2].phase = pb.WORKER_PHASE_FAILED
    await ls[2].heartbeat()
    reg = env.coordinator.metrics.registry

    def value(name: str, **labels: str) -> float:
        return reg.get_sample_value(name, labels) or 0.0

    assert value("tide_coordinator_resizes_total", phase="completed") == 2
    assert value("tide_coordinator_resize_pause_duration_seconds_count") == 1
    assert value("tide_coordinator_generations_total", cause="resize") == 2
    assert value("tide_coordinator_generations_total", cause="recovery") == 1
    assert value("tide_coordinator_members_lost_total", job_id=JOB) == 1
    assert value("tide_coordinator_commit_duration_seconds_count") > 5


async def test_zero_deadline_means_the_phase_timeout_not_the_heartbeat_timeout(env: Env) -> None:
    assert TUNING.phase_timeout_s > TUNING.heartbeat_timeout_s
    await form(env, 2)
    await env.heartbeat_all()
    env.launchers[1].answer_checkpoint = False
    w = ResizeWatch(env.stub, JOB, 2, 1, deadline_s=0.0)
    await eventually(lambda: K.KIND_CHECKPOINT in env.launchers[1].kinds(), what="barrier")
    await env.heartbeat_all(advance_s=TUNING.phase_timeout_s - 1)
    env.coordinator.tick()
    assert env.coordinator.jobs[JOB].resizes[2].phase.name == "CHECKPOINTING"
    await env.heartbeat_all(advance_s=2)
    env.coordinator.tick()
    final = await w.final()
    assert final.phase == P.RESIZE_PHASE_ABORTED
    assert "barrier deadline (40.0 s)" in final.message


async def test_job_that_finishes_its_budget_ends_without_loss(env: Env) -> None:
    ls = await form(env, 2)
    await env.heartbeat_all(steps=9)  # step 10
    ls[0].last_checkpoint = 10  # the final checkpoint, written by session.finish()
    w = ResizeWatch(env.stub, JOB, 2, 3, deadline_s=60.0)  # waits for a newcomer
    await eventually(lambda: env.coordinator.jobs[JOB].active_resize() is not None)
    # Both workers exit 0 after their last step; each launcher says so with phase IDLE in
    # the current generation, then exits.
    for fl in ls:
        fl.phase = pb.WORKER_PHASE_IDLE
        await fl.heartbeat(steps=0)
        fl.exited = True
    final = await w.final()
    assert final.phase == P.RESIZE_PHASE_ABORTED and "finished at step 10" in final.message
    for _ in range(5):  # far past the heartbeat timeout: nothing is lost, nothing re-forms
        await env.heartbeat_all(advance_s=8.0)
        env.coordinator.tick()
    st = await env.status()
    assert (st.generation, st.world_size, st.step, st.last_checkpoint_step) == (1, 0, 10, 10)
    assert st.lost_steps_total == 0
    assert st.finished
    assert [(m.state, m.phase, m.rank, m.step) for m in st.members] == [
        (pb.MEMBER_STATE_GONE, pb.WORKER_PHASE_IDLE, 0, 10),
        (pb.MEMBER_STATE_GONE, pb.WORKER_PHASE_IDLE, 1, 10),
    ]
    assert not st.HasField("active_resize")
    assert env.coordinator.metrics.registry.get_sample_value(
        "tide_coordinator_members_lost_total", {"job_id": JOB}
    ) in (None, 0.0)
    # The launchers are gone for good: a heartbeat of theirs is refused.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ls[0].heartbeat()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_one_member_finishing_first_is_not_a_loss_of_the_others(env: Env) -> None:
    ls = await form(env, 2)
    await env.heartbeat_all(steps=4)
    ls[0].phase = pb.WORKER_PHASE_IDLE
    await ls[0].heartbeat(steps=0)
    ls[0].exited = True
    st = await env.status()
    assert (st.generation, st.world_size) == (1, 1)  # rank 1 still runs its last step
    assert not st.finished
    ls[1].phase = pb.WORKER_PHASE_IDLE
    await ls[1].heartbeat(steps=0)
    st = await env.status()
    assert (st.generation, st.world_size, st.lost_steps_total) == (1, 0, 0)
    assert env.coordinator.jobs[JOB].finished()
