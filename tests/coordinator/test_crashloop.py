"""The crash-loop limit and the exact count of lost steps, over a real socket with fake
launchers and a fake clock: re-forms after worker failures back off and stop at the
restart budget with the job FAILED; lost steps come from what the survivors restored;
a Resize of a job that ended is refused at once."""

from __future__ import annotations

import dataclasses
import time

import grpc
import pytest

from tests.coordinator.fakes import TIMEOUT_S, FakeLauncher
from tests.coordinator.support import JOB, TUNING, Env, close_env, form, make_env, no_pending
from tests.support.poll import eventually
from tide.services.coordinator.store import MemoryStore
from tide.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.component

K = pb.Directive.Kind
CRASHY = dataclasses.replace(
    TUNING,
    restart_budget=3,
    restart_backoff_initial_s=1.0,
    restart_backoff_max_s=4.0,
    restart_reset_after_s=100.0,
)
SEGV = pb.WorkerExit(
    exit_code=-11,
    cause="was killed by SIGSEGV",
    log_tail="step 1: forward\nFatal Python error: Segmentation fault\n",
)


async def _crash(crasher: FakeLauncher) -> None:
    """``crasher``'s worker dies in its generation; the job re-forms (or fails)."""
    crasher.phase = pb.WORKER_PHASE_FAILED
    crasher.worker_exit = SEGV
    await crasher.heartbeat()


async def _reformed(env: Env, ls: list[FakeLauncher], generation: int) -> None:
    await eventually(lambda: all(fl.generation == generation for fl in ls), what="re-formed")
    await eventually(lambda: no_pending(env), what="rendezvous acks")


def _metric(env: Env, name: str) -> float:
    reg = env.coordinator.metrics.registry
    return reg.get_sample_value(name, {"job_id": JOB}) or 0.0


async def _resize_refused(env: Env, decision_id: int) -> grpc.aio.AioRpcError:
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in env.stub.Resize(
            pb.ResizeRequest(decision_id=decision_id, job_id=JOB, target_world_size=2),
            timeout=TIMEOUT_S,
        ):
            pass
    assert time.monotonic() - started < 2.0  # at once, not at a phase deadline
    return err.value


async def test_a_worker_that_fails_at_every_start_backs_off_then_fails_the_job() -> None:
    env = await make_env(MemoryStore(), CRASHY)
    try:
        ls = await form(env, 2)
        delays: list[float] = []
        for n in range(1, CRASHY.restart_budget + 1):
            await _crash(ls[1])
            await _reformed(env, ls, 1 + n)
            delays.append(ls[1].start_delays[-1])
            # It starts, then dies again two seconds later: never a healthy run.
            await env.heartbeat_all(advance_s=2.0)
        # The backoff doubles with each re-form in a row, for every member of the job.
        assert delays == [1.0, 2.0, 4.0]
        assert ls[0].start_delays[-3:] == delays
        created = [g.created_at for g in env.coordinator.jobs[JOB].generations.values()]
        assert len(created) == 1 + CRASHY.restart_budget

        await _crash(ls[1])  # one more than the budget allows
        await eventually(lambda: all(K.KIND_STOP in fl.kinds() for fl in ls), what="STOP")
        st = await env.status()
        assert st.failed and st.generation == 1 + CRASHY.restart_budget
        assert (st.restarts, st.restart_budget) == (3, 3)
        assert "restart budget spent" in st.failure and ls[1].member_id in st.failure
        assert "was killed by SIGSEGV" in st.failure
        assert "Fatal Python error: Segmentation fault" in st.failure  # the log's tail
        assert _metric(env, "tide_coordinator_jobs_failed_total") == 1
        assert _metric(env, "tide_coordinator_restarts_total") == CRASHY.restart_budget
        await eventually(lambda: not env.coordinator.jobs[JOB].current_members(), what="gone")

        err = await _resize_refused(env, 9)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "failed" in (err.details() or "")
        assert len(env.coordinator.jobs[JOB].generations) == 1 + CRASHY.restart_budget
    finally:
        await close_env(env)


async def test_a_healthy_run_starts_the_restart_count_again() -> None:
    env = await make_env(MemoryStore(), CRASHY)
    try:
        ls = await form(env, 2)
        for n in (1, 2):
            await _crash(ls[1])
            await _reformed(env, ls, 1 + n)
            await env.heartbeat_all(advance_s=2.0)
        assert ls[1].start_delays == [0.0, 1.0, 2.0]
        assert (await env.status()).restarts == 2
        # Generation 3 trains past restart_reset_after_s before the next failure.
        while env.clock.now() - env.coordinator.jobs[JOB].generations[3].created_at < 100.0:
            await env.heartbeat_all(advance_s=20.0)
        assert (await env.status()).restarts == 0
        await _crash(ls[1])
        await _reformed(env, ls, 4)
        assert ls[1].start_delays[-1] == CRASHY.restart_backoff_initial_s
        assert not (await env.status()).failed
    finally:
        await close_env(env)


async def test_lost_steps_are_what_the_survivors_restored_not_what_was_named(env: Env) -> None:
    ls = await form(env, 2)
    for _ in range(3):
        await env.heartbeat_all(steps=4)  # step 13
    ls[0].last_checkpoint = 10
    await env.heartbeat_all(steps=1)  # step 14; rank 0 reports the checkpoint of step 10
    ls[1].step += 2  # rank 1's worker reached 16 and died
    # Rank 0's worker wrote a periodic checkpoint of step 14 that its launcher had not yet
    # reported: the new workers restore it, not the named 10.
    for fl in ls:
        fl.restores = 14
    ls[1].phase = pb.WORKER_PHASE_FAILED
    await ls[1].heartbeat(steps=0)
    await eventually(lambda: ls[0].generation == 2 == ls[1].generation, what="recovery")
    assert ls[0].restore_step == 10  # named: the newest the coordinator knew
    await eventually(lambda: no_pending(env), what="rendezvous acks")
    gen = env.coordinator.jobs[JOB].generations[2]
    assert (gen.reached_step, gen.restored_step, gen.lost_steps) == (16, 14, 2)
    assert (await env.status()).lost_steps_total == 16 - 14  # redone: steps 15 and 16

    # Rank 0's last word: its worker had finished step 17 before it was replaced.
    await env.stub.Heartbeat(
        pb.HeartbeatRequest(
            member_id=ls[0].member_id, generation=1, phase=pb.WORKER_PHASE_RUNNING, step=17
        ),
        timeout=TIMEOUT_S,
    )
    assert (await env.status()).lost_steps_total == 17 - 14
    reg = env.coordinator.metrics.registry
    assert reg.get_sample_value("tide_coordinator_lost_steps_total", {"job_id": JOB}) == 3


async def test_a_restore_older_than_the_named_step_counts_every_step_redone(env: Env) -> None:
    ls = await form(env, 2)
    for _ in range(3):
        await env.heartbeat_all(steps=4)  # step 13
    ls[0].last_checkpoint = 10
    await env.heartbeat_all(steps=1)  # step 14
    for fl in ls:
        fl.restores = 5  # the checkpoint of step 10 was damaged: an older one loaded
    ls[1].phase = pb.WORKER_PHASE_FAILED
    await ls[1].heartbeat(steps=0)
    await eventually(lambda: ls[0].generation == 2 and no_pending(env), what="recovery")
    assert (await env.status()).lost_steps_total == 14 - 5


async def test_a_resize_of_a_finished_job_is_refused_at_once(env: Env) -> None:
    (fl,) = await form(env, 1)
    await env.heartbeat_all(steps=3)
    fl.phase = pb.WORKER_PHASE_IDLE  # its worker ran the budget to its end and exited 0
    await fl.heartbeat(steps=0)
    assert (await env.status()).finished
    err = await _resize_refused(env, 2)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "finished at step" in (err.details() or "")
