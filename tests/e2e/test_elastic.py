"""End to end with real Paddle workers on gloo: the coordinator, launchers as pods, resizes."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from tests.e2e.checks import (
    check_exactly_once,
    final_losses,
    max_rel_loss_diff,
    max_rel_param_diff,
    samples_per_step,
    steps_by_generation,
)
from tide.services.testing.localjob import LocalJob, loss_records, read_jsonl
from tide.services.testing.refcache import ReferenceRuns
from tide.v1 import coordinator_pb2 as pb

pytestmark = [pytest.mark.e2e, pytest.mark.paddle, pytest.mark.slow]

DATASET, BATCH = 1000, 64
SPE = -(-DATASET // BATCH)  # 16 steps per epoch; the 16th takes the 40-sample tail
STEPS = 200
TRAIN = [
    "--dataset-size", str(DATASET),
    "--global-batch", str(BATCH),
    "--seed", "3",
    "--steps", str(STEPS),
    "--ckpt-every-steps", "10",
    "--keep", "4",
]  # fmt: skip
SLOW = ["--step-delay-s", "0.05"]


@pytest.fixture
async def job(tmp_path: Path) -> AsyncIterator[LocalJob]:
    # A generous heartbeat timeout: with 5 other engineers' tests on 2 cores the coordinator has
    # been starved for over 4 s, and then declares every member lost.
    j = LocalJob(tmp_path / "job", [*TRAIN, *SLOW], heartbeat_timeout_s=10.0)
    j.start_coordinator()
    yield j
    await j.close()


@pytest.fixture(params=["plain", "overlap"])
async def job_in_mode(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[LocalJob]:
    """The same job in each resize mode (docs/resize-protocol.md, "Overlap mode")."""
    j = LocalJob(
        tmp_path / "job", [*TRAIN, *SLOW], heartbeat_timeout_s=10.0, resize_mode=request.param
    )
    j.start_coordinator()
    yield j
    await j.close()


def _steps_since(job: LocalJob, generation: int, since: float) -> list[int]:
    """The steps of ``generation`` rank 0 completed after the wall time ``since``."""
    return [
        int(r["step"])
        for r in loss_records(job.log_dir)
        if int(r["gen"]) == generation and float(r["t"]) > since
    ]


async def _progress_past(job: LocalJob, step: int, timeout_s: float = 60.0) -> pb.JobStatus:
    return await job.wait_status(lambda s: s.step >= step, timeout_s, f"step {step}")


async def _finished(
    job: LocalJob, generation: int, lost_steps_total: int, *, hold: bool = False
) -> pb.JobStatus:
    """The coordinator's view of a job whose workers finished the budget: the members of the
    last generation GONE in phase IDLE with the final step, no loss added, no new generation;
    with ``hold``, still so past the heartbeat timeout (the exited launchers are not lost)."""

    def done(s: pb.JobStatus) -> bool:
        return bool(s.members) and all(
            (m.state, m.phase, m.step) == (pb.MEMBER_STATE_GONE, pb.WORKER_PHASE_IDLE, STEPS)
            for m in s.members
        )

    st = await job.wait_status(done, 10, "the job finished")
    if hold:
        await asyncio.sleep(job.heartbeat_timeout_s + 1)  # long enough for silence to be a loss
    later = await job.status()
    assert later is not None and done(later), later
    for s in (st, later):
        assert (s.generation, s.world_size, s.step) == (generation, 0, STEPS), s
        assert s.lost_steps_total == lost_steps_total and s.last_checkpoint_step == STEPS, s
        assert not s.HasField("active_resize")
    return later


# Four pods, three resizes and a fixed run: about a minute alone here, past pytest's default
# 120 s bound when the 2 cores are shared by 25 runnable processes (waiting for a core).
@pytest.mark.timeout(300)
async def test_resize_2_3_1_2_loses_nothing_and_matches_a_fixed_run(
    job_in_mode: LocalJob, reference_runs: ReferenceRuns
) -> None:
    job = job_in_mode
    # Every pod starts now and waits STANDBY (warm) until a grow takes it, lowest index
    # first: a newcomer's cold start under load once outlasted the 200 steps' budget.
    for i in range(4):
        job.add_pod(i)
    await job.wait_standby(4)
    first = await job.resize(2)
    assert first[-1].phase == pb.RESIZE_PHASE_COMPLETED, first[-1]

    results = []
    for target in (3, 1, 2):
        st = await _progress_past(job, (await job.status()).step + 8)  # type: ignore[union-attr]
        assert st.step < STEPS - 20, "the run is too fast for the resizes to land mid-run"
        decided_at = time.time()
        updates = await job.resize(target)
        final = updates[-1]
        assert final.phase == pb.RESIZE_PHASE_COMPLETED, final
        assert final.lost_steps == 0
        if job.resize_mode == "overlap":
            assert pb.RESIZE_PHASE_PREPARING in [u.phase for u in updates], updates
        # g trained on between the decision and its barrier: while the newcomers started
        # and, in overlap mode, while g+1's group formed. Counted from rank 0's log.
        trained = _steps_since(job, st.generation, decided_at)
        assert trained and max(trained) == final.checkpoint_step, (trained, final)
        print(f"resize to {target}: {len(trained)} step(s) trained between decision and barrier")
        results.append(final)
        st = await job.wait_status(
            lambda s, t=target: s.world_size == t,  # type: ignore[misc]
            30,
            f"world {target}",
        )

    codes = await job.wait_pods_exit(120)
    # Pods 1 and 2 were drained by the 3 -> 1 shrink; all exit 0.
    assert codes == [0, 0, 0, 0], codes
    await _finished(job, generation=4, lost_steps_total=0)

    log_dir = job.log_dir
    gens = steps_by_generation(log_dir)
    all_steps = [s for steps in gens.values() for s in steps]
    assert sorted(all_steps) == list(range(1, STEPS + 1)), "a step was lost or repeated"
    per_step = samples_per_step(log_dir)
    worlds_seen = sorted({len(e["ranks"]) for e in per_step.values()})
    assert worlds_seen == [1, 2, 3]
    check_exactly_once(log_dir, DATASET, STEPS, SPE)
    # Resizes happened mid-epoch, not only at epoch boundaries.
    assert any(r.checkpoint_step % SPE for r in results)

    # Both modes compare with the same fixed run: the session runs it once.
    ref_logs = reference_runs(TRAIN, world_size=2)
    loss_diff = max_rel_loss_diff(final_losses(log_dir), final_losses(ref_logs))
    param_diff = max_rel_param_diff(log_dir / "final_params.npz", ref_logs / "final_params.npz")
    print(f"parity vs fixed 2-worker run: loss {loss_diff:.2e}, params {param_diff:.2e}")
    assert loss_diff < 1e-5
    assert param_diff < 1e-5
    for r in results:
        print(f"resize to {r.world_size}: pause {r.pause_s:.3f}s {r.pause}")


async def _mid_period_after_durable(job: LocalJob, at_least: int) -> int:
    """Poll until rank 0 is 3 to 8 steps past the newest durable checkpoint (at least
    ``at_least``), so that a kill now lands mid-period with its period's start durable;
    returns that durable step."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 120
    while True:
        st = await job.status()
        durable = st.durable_checkpoint_step if st else 0
        step = max((r["step"] for r in loss_records(job.log_dir)), default=0)
        if durable >= at_least and 3 <= step - durable <= 8:
            return int(durable)
        assert loop.time() < deadline, f"step {step}, durable {durable}: never mid-period"
        await asyncio.sleep(0.005)


async def test_sigkilled_worker_survivors_resume_from_the_last_periodic_checkpoint(
    job: LocalJob,
) -> None:
    for i in range(2):
        job.add_pod(i)
    await job.wait_standby(2)
    assert (await job.resize(2))[-1].phase == pb.RESIZE_PHASE_COMPLETED
    await _progress_past(job, 25)
    (victim,) = [
        e["pid"]
        for e in read_jsonl(job.log_dir / "timings.jsonl")
        if e["event"] == "first_step" and e["gen"] == 1 and e["rank"] == 1
    ]
    assert victim in job.pods[1].worker_pids()
    # Kill mid-period (checkpoints every 10 steps), watching rank 0's log, not heartbeats,
    # once the period's checkpoint is durable: rank 0 writes the durable copy from a niced
    # thread, and on a loaded machine step 30's copy committed after step 33 (this test
    # once restored 20 at load 30). What survivors must restore is the newest durable one.
    durable = await _mid_period_after_durable(job, at_least=30)
    killed_at = asyncio.get_running_loop().time()
    os.kill(victim, signal.SIGKILL)
    await job.wait_status(
        lambda s: s.generation == 2 and s.world_size == 2, job.heartbeat_timeout_s + 5, "re-formed"
    )
    reformed_s = asyncio.get_running_loop().time() - killed_at
    assert reformed_s < job.heartbeat_timeout_s, f"re-rendezvous took {reformed_s:.2f}s"
    # Counted once the survivors said which checkpoint they restored (their RENDEZVOUS acks).
    await job.wait_status(lambda s: s.lost_steps_total > 0, 30, "the loss reported")

    codes = await job.wait_pods_exit(120)
    assert codes == [0, 0], codes
    gens = steps_by_generation(job.log_dir)
    restored = min(gens[2]) - 1
    reached = max(gens[1])
    assert restored % 10 == 0 and restored > 0, f"restored {restored}: not a periodic checkpoint"
    # The newest durable checkpoint at the kill (or a later one that committed after the
    # status was read): what is redone is what the durable copy had not yet taken.
    assert durable <= restored <= reached, f"restored {restored}, durable {durable} at the kill"
    redone = sorted(set(gens[1]) & set(gens[2]))
    assert redone == list(range(restored + 1, reached + 1)) and redone
    # The survivors reported the step they restored and where the generation stopped, so
    # the steps the coordinator counts lost are exactly the steps redone.
    final = await _finished(job, generation=2, lost_steps_total=len(redone), hold=True)
    restore_named = [
        line
        for line in (job.pods[0].state_dir / "launcher.log").read_text().splitlines()
        if "generation 2 rank" in line
    ]
    # The launcher's text line ends with its ids (job_id=..., member=...) after the message.
    assert restore_named and f"restore {restored} " in restore_named[0], restore_named
    per_step = samples_per_step(job.log_dir)
    for step in redone:
        # Redone steps used exactly the samples the lost ones had (the log shows which).
        if (1, step) in per_step and len(per_step[(1, step)]["ranks"]) == 2:
            assert sorted(per_step[(1, step)]["ids"]) == sorted(per_step[(2, step)]["ids"])
    check_exactly_once(job.log_dir, DATASET, STEPS, SPE)
    print(
        f"worker killed at step ~{reached}: re-formed in {reformed_s:.2f}s from step {restored}; "
        f"{len(redone)} steps redone, coordinator reported {final.lost_steps_total} lost"
    )


@pytest.fixture
async def slow_barrier_job(tmp_path: Path) -> AsyncIterator[LocalJob]:
    # The checkpoint step is placed further ahead than a lost member takes to be noticed, so
    # the barrier is still open when the newcomer dies.
    j = LocalJob(
        tmp_path / "job",
        [*TRAIN, "--step-delay-s", "0.08"],
        heartbeat_timeout_s=3.0,
        heartbeat_interval_s=0.3,
        checkpoint_lead_s=7.0,
    )
    j.start_coordinator()
    yield j
    await j.close()


async def test_member_killed_during_the_barrier_aborts_and_the_others_resume(
    slow_barrier_job: LocalJob,
) -> None:
    job = slow_barrier_job
    for i in range(2):
        job.add_pod(i)
    await job.wait_standby(2)
    assert (await job.resize(2))[-1].phase == pb.RESIZE_PHASE_COMPLETED
    await _progress_past(job, 5)
    workers_before = [sorted(p.worker_pids()) for p in job.pods]
    before = await job.status()
    assert before is not None
    newcomer = job.add_pod(2)
    await job.wait_standby(1)

    def kill_in_barrier(p: pb.ResizeProgress) -> None:
        if p.phase == pb.RESIZE_PHASE_CHECKPOINTING:
            newcomer.kill_launcher()

    updates = await job.resize(3, on_progress=kill_in_barrier)
    assert pb.RESIZE_PHASE_CHECKPOINTING in [u.phase for u in updates]
    assert updates[-1].phase == pb.RESIZE_PHASE_ABORTED, updates[-1]
    st = await job.status()
    assert st is not None and st.generation == 1 and st.world_size == 2
    # The abort promoted nothing: the barrier's step was not reached, so no report of it
    # either (rank 0 reports checkpoints once written, periodic ones included).
    aborted = updates[-1].checkpoint_step
    assert before.last_checkpoint_step <= st.last_checkpoint_step < aborted, (st, aborted)
    step_at_abort = st.step
    await _progress_past(job, step_at_abort + 5)
    # Same worker processes: resumed in their generation without a restart.
    assert [sorted(p.worker_pids()) for p in job.pods[:2]] == workers_before
    codes = await job.wait_pods_exit(120)
    assert codes[:2] == [0, 0], codes
    assert set(steps_by_generation(job.log_dir)) == {1}
    check_exactly_once(job.log_dir, DATASET, STEPS, SPE)


async def _kill_coordinator_in_the_barrier_of_a_grow(job: LocalJob) -> int:
    """A job of 2 grown to 3 whose coordinator is SIGKILLed as the barrier starts; returns
    the resize's decision id."""
    for i in range(2):
        job.add_pod(i)
    await job.wait_standby(2)
    assert (await job.resize(2))[-1].phase == pb.RESIZE_PHASE_COMPLETED
    await _progress_past(job, 10)
    job.add_pod(2)
    await job.wait_standby(1)

    def kill_in_barrier(p: pb.ResizeProgress) -> None:
        if p.phase == pb.RESIZE_PHASE_CHECKPOINTING:
            job.kill_coordinator()

    with pytest.raises(grpc.aio.AioRpcError):
        await job.resize(3, on_progress=kill_in_barrier)
    return job._decision


def _each_step_trained_once(job: LocalJob) -> None:
    # Never split: each step was trained once, by one generation.
    all_steps = sorted(s for steps in steps_by_generation(job.log_dir).values() for s in steps)
    assert all_steps == list(range(1, STEPS + 1))
    check_exactly_once(job.log_dir, DATASET, STEPS, SPE)


async def test_coordinator_killed_mid_resize_ends_in_one_generation(job_in_mode: LocalJob) -> None:
    # In overlap mode the barrier is a commit point: the restarted coordinator carries it on
    # (members may have switched to g+1 at their hold) instead of resuming g.
    job = job_in_mode
    decision = await _kill_coordinator_in_the_barrier_of_a_grow(job)
    job.start_coordinator(port=job.port)  # the launchers know this address
    final = (await job.resize(3, decision_id=decision))[-1]
    assert final.phase in (pb.RESIZE_PHASE_COMPLETED, pb.RESIZE_PHASE_ABORTED), final
    want_gen, want_world = (2, 3) if final.phase == pb.RESIZE_PHASE_COMPLETED else (1, 2)
    # Or finished there: in overlap mode g+1 trains on from the hold while the coordinator
    # is away, and on a loaded machine it has run the budget out before it is back.
    st = await job.wait_status(
        lambda s: (
            s.generation == want_gen
            and (s.world_size == want_world or s.finished)
            and not s.HasField("active_resize")
        ),
        30,
        "one generation",
    )
    if not st.finished:
        active = [m for m in st.members if m.state == pb.MEMBER_STATE_ACTIVE]
        assert sorted(m.rank for m in active) == list(range(want_world))
        st = await _progress_past(job, min(st.step + 5, STEPS))
        assert st.generation == want_gen
    if final.phase == pb.RESIZE_PHASE_ABORTED:
        job.pods[2].proc.terminate()  # the newcomer never joined; the job ends without it
    codes = await job.wait_pods_exit(120)
    assert codes[:2] == [0, 0], codes
    _each_step_trained_once(job)
    print(f"coordinator killed in the barrier: resize {pb.ResizePhase.Name(final.phase)}")


async def test_coordinator_down_until_a_committed_overlap_grow_finished_the_job(
    tmp_path: Path,
) -> None:
    """Overlap mode: the coordinator killed as the committing barrier went out stays down
    until g+1, which every member switched to at its hold, has trained to the budget's end
    and its prepared workers exited. The RENDEZVOUS of the restarted coordinator confirms
    those workers as they ended: the grow COMPLETES and the job finished in generation 2.
    It ended FAILED: the launchers had dropped their ended prepared workers and started
    fresh ones into a group that was gone (docs/resize-protocol.md, "Overlap mode")."""
    job = LocalJob(
        tmp_path / "job", [*TRAIN, *SLOW], heartbeat_timeout_s=10.0, resize_mode="overlap"
    )
    job.start_coordinator()
    try:
        decision = await _kill_coordinator_in_the_barrier_of_a_grow(job)
        final_checkpoint = job.ckpt_dir / f"step-{STEPS:08d}" / "manifest.json"
        deadline = time.monotonic() + 120
        while not final_checkpoint.exists():
            assert time.monotonic() < deadline, "g+1 never reached the budget's end"
            await asyncio.sleep(0.2)
        job.start_coordinator(port=job.port)
        final = (await job.resize(3, decision_id=decision))[-1]
        assert final.phase == pb.RESIZE_PHASE_COMPLETED, final
        st = await job.wait_status(lambda s: s.finished, 60, "the job finished")
        assert (st.generation, st.step, st.lost_steps_total) == (2, STEPS, 0)
        assert await job.wait_pods_exit(120) == [0, 0, 0]
        assert set(steps_by_generation(job.log_dir)) == {1, 2}
        _each_step_trained_once(job)
    finally:
        await job.close()
