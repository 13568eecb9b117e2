"""The trainer's contract end to end (issue 27): a BatchNorm CNN fed by a DataLoader with
worker processes and random augmentation inside ``__getitem__`` follows a fixed run through
resizes and a killed worker; ``num_workers=0`` is deterministic; a forgotten batch sampler
and a summed loss stop the job at step 1 with their cause."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.e2e.checks import (
    check_exactly_once,
    final_losses,
    max_rel_loss_diff,
    max_rel_param_diff,
    samples_per_step,
    steps_by_generation,
)
from tide.services.testing.localjob import ROOT, LocalJob, loss_records, reference_run
from tide.v1 import coordinator_pb2 as pb

pytestmark = [pytest.mark.e2e, pytest.mark.paddle, pytest.mark.slow]

BN = str(ROOT / "tide" / "trainer" / "examples" / "train_bn.py")
DATASET, BATCH = 100, 20
SPE = DATASET // BATCH
# The job is gated (each event lands at the step the test grants), so its last resize comes
# by step ~30 whatever the budget; 60 leaves six epochs after it. (150 dated from before the
# gate, when a long run was what made the events land mid-run.)
STEPS = 60


def _train(steps: int, workers: int, *extra: str) -> list[str]:
    return [
        "--dataset-size", str(DATASET),
        "--global-batch", str(BATCH),
        "--seed", "6",
        "--steps", str(steps),
        "--width", "4",
        "--ckpt-every-steps", "10",
        # Five micro-batches of four in any world, 1 to 5 workers.
        "--virtual-ranks", "5",
        "--augment",
        "--loader-workers", str(workers),
        "--lr", "0.01",
        *extra,
    ]  # fmt: skip


@pytest.fixture
async def job(tmp_path: Path) -> AsyncIterator[LocalJob]:
    # Gated: the job trains the steps the test grants and waits for its next event there,
    # so each event lands mid-run however fast or loaded the machine.
    j = LocalJob(
        tmp_path / "job",
        _train(STEPS, 2, "--step-delay-s", "0.08"),
        heartbeat_timeout_s=10.0,
        example=BN,
        step_gate=True,
    )
    j.start_coordinator()
    yield j
    await j.close()


async def _steps_on(job: LocalJob, n: int) -> pb.JobStatus:
    """``n`` more steps; the job then waits there for the test's next event."""
    return await job.train_to(job.granted + n, 90, f"{n} more steps")


async def _resize(job: LocalJob, target: int) -> None:
    await _steps_on(job, 4)
    final = (await job.resize(target))[-1]
    assert final.phase == pb.RESIZE_PHASE_COMPLETED, final


# Eight pods, six generations and a reference run: ~2-3 minutes here under load.
@pytest.mark.timeout(420)
async def test_augmented_loader_workers_follow_a_fixed_run_through_resizes_and_a_kill(
    job: LocalJob, tmp_path: Path
) -> None:
    for i in range(5):
        job.add_pod(i)
    await job.wait_standby(5)
    assert (await job.resize(2))[-1].phase == pb.RESIZE_PHASE_COMPLETED
    await _resize(job, 5)
    await _resize(job, 3)
    # Pods that leave go away (as deleted pods do): the last grow takes three new ones,
    # started now so that they are warm by then.
    for i in range(5, 8):
        job.add_pod(i)
    # An unplanned loss: the worker that trains for trainer-1 SIGKILLed (not its prewarmed
    # standby, whose loss re-forms nothing); the job re-forms from its newest checkpoint
    # and redoes the steps after it, with the same augmentation.
    st = await _steps_on(job, 6)
    victim = job.pods[1].training_worker(st.generation)
    # Granted first, so that the kill lands while the generation trains.
    job.grant(st.step + 3)
    os.kill(victim, signal.SIGKILL)
    await job.wait_status(
        lambda s: s.generation > st.generation and s.world_size == 3 and s.step > st.step,
        90,
        "the job re-formed after the kill and trained on",
    )
    await job.wait_standby(3, timeout_s=90)
    await _resize(job, 1)
    await _resize(job, 4)
    job.release()
    assert await job.wait_pods_exit(180) == [0] * 8

    worlds = sorted({len(e["ranks"]) for e in samples_per_step(job.log_dir).values()})
    assert worlds == [1, 2, 3, 4, 5]
    steps_seen = sorted({s for ss in steps_by_generation(job.log_dir).values() for s in ss})
    assert steps_seen == list(range(1, STEPS + 1))
    check_exactly_once(job.log_dir, DATASET, STEPS, SPE)

    ref = reference_run(tmp_path / "ref", _train(STEPS, 2), world_size=2, example=BN)
    loss_diff = max_rel_loss_diff(final_losses(job.log_dir), final_losses(ref))
    state_diff = max_rel_param_diff(job.log_dir / "final_params.npz", ref / "final_params.npz")
    print(f"augmented parity vs a fixed 2-worker run: loss {loss_diff:.2e}, state {state_diff:.2e}")
    assert loss_diff <= 1e-5
    assert state_diff <= 1e-5


async def test_a_fixed_run_with_augmentation_in_the_loader_thread_is_deterministic(
    tmp_path: Path,
) -> None:
    # num_workers=0: Paddle fetches in a thread of the training process; its draws used to
    # race with the loop's per-micro-batch paddle.seed() (two runs differed by 0.93).
    args = _train(12, 0)
    a = reference_run(tmp_path / "a", args, world_size=2, example=BN)
    b = reference_run(tmp_path / "b", args, world_size=2, example=BN)
    assert final_losses(a) == final_losses(b)
    assert max_rel_param_diff(a / "final_params.npz", b / "final_params.npz") == 0.0


@pytest.mark.parametrize(
    ("flag", "cause"),
    [
        ("--forget-sampler", "the DataLoader does not use session.batch_sampler()"),
        ("--summed-loss", "older form"),
    ],
)
async def test_a_broken_script_stops_at_step_1_with_its_cause(
    tmp_path: Path, flag: str, cause: str
) -> None:
    with pytest.raises(RuntimeError, match="reference run failed"):
        reference_run(tmp_path, [*_train(6, 0), flag], world_size=2, example=BN)
    for rank in range(2):
        log = (tmp_path / f"ref-rank{rank}.log").read_text()
        assert "step 1 (micro-batch 1" in log and cause in log, log[-2000:]
    assert not loss_records(tmp_path / "logs"), "a step went through"
