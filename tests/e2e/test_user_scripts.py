"""End to end with a stock-shaped script (tide/trainer/examples/train_bn.py): a BatchNorm CNN fed
by ``paddle.io.DataLoader`` with worker processes, exact across resizes through virtual
ranks; and the same script under ``paddle.DataParallel``."""

from __future__ import annotations

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
from tide.services.testing.localjob import ROOT, LocalJob, reference_run
from tide.v1 import coordinator_pb2 as pb

pytestmark = [pytest.mark.e2e, pytest.mark.paddle, pytest.mark.slow]

BN = str(ROOT / "tide" / "trainer" / "examples" / "train_bn.py")
DATASET, BATCH = 120, 16
SPE = -(-DATASET // BATCH)  # 8 steps an epoch, the last one a 8-sample tail


def _train(steps: int, *extra: str) -> list[str]:
    return [
        "--dataset-size", str(DATASET),
        "--global-batch", str(BATCH),
        "--seed", "4",
        "--steps", str(steps),
        "--ckpt-every-steps", "10",
        "--virtual-ranks", "4",
        # A gentle rate: float32 rounding (the only difference between world sizes) grows
        # with how chaotic training is, and 1e-5 must hold over 90 steps.
        "--lr", "0.01",
        *extra,
    ]  # fmt: skip


async def _job(tmp_path: Path, train: list[str]) -> LocalJob:
    # Gated: the job waits for each resize after the steps the test grants, so every
    # resize lands mid-run however fast or loaded the machine.
    job = LocalJob(
        tmp_path / "job",
        [*train, "--step-delay-s", "0.08"],
        heartbeat_timeout_s=10.0,
        step_gate=True,
    )
    job.example = BN
    job.start_coordinator()
    return job


@pytest.fixture
async def bn_job(tmp_path: Path) -> AsyncIterator[LocalJob]:
    job = await _job(tmp_path, _train(90, "--loader-workers", "1"))
    yield job
    await job.close()


async def _resize(job: LocalJob, target: int) -> pb.ResizeProgress:
    await job.train_to(job.granted + 4, 60, "4 more steps")
    final = (await job.resize(target))[-1]
    assert final.phase == pb.RESIZE_PHASE_COMPLETED, final
    assert final.lost_steps == 0
    return final


# Three resizes of four pods and a reference run: ~100 s alone here, more under load.
@pytest.mark.timeout(300)
async def test_batchnorm_with_a_dataloader_resized_2_3_1_2_matches_a_fixed_run(
    bn_job: LocalJob, tmp_path: Path
) -> None:
    job, steps = bn_job, 90
    # Every pod starts now: a newcomer stays STANDBY (warm) until a grow takes it, lowest
    # pod index first, so no resize waits for a cold start on a loaded machine.
    for i in range(4):
        job.add_pod(i)
    await job.wait_standby(4)
    assert (await job.resize(2))[-1].phase == pb.RESIZE_PHASE_COMPLETED
    for target in (3, 1, 2):
        await _resize(job, target)
    job.release()
    assert await job.wait_pods_exit(120) == [0, 0, 0, 0]

    steps_seen = sorted(s for ss in steps_by_generation(job.log_dir).values() for s in ss)
    assert steps_seen == list(range(1, steps + 1)), "a step was lost or repeated"
    worlds = sorted({len(e["ranks"]) for e in samples_per_step(job.log_dir).values()})
    assert worlds == [1, 2, 3]
    check_exactly_once(job.log_dir, DATASET, steps, SPE)

    ref = reference_run(tmp_path / "ref", _train(steps), world_size=2, example=BN)
    loss_diff = max_rel_loss_diff(final_losses(job.log_dir), final_losses(ref))
    # Parameters and BatchNorm's running statistics (virtual rank 0's) alike.
    state_diff = max_rel_param_diff(job.log_dir / "final_params.npz", ref / "final_params.npz")
    print(f"batchnorm parity vs a fixed 2-worker run: loss {loss_diff:.2e}, state {state_diff:.2e}")
    assert loss_diff <= 1e-5
    assert state_diff <= 1e-5


@pytest.fixture
async def dp_job(tmp_path: Path) -> AsyncIterator[LocalJob]:
    job = await _job(tmp_path, _train(50, "--data-parallel"))
    yield job
    await job.close()


async def test_a_data_parallel_script_resized_keeps_samples_once_and_the_trajectory(
    dp_job: LocalJob, tmp_path: Path
) -> None:
    job, steps = dp_job, 50
    for i in range(3):
        job.add_pod(i)
    await job.wait_standby(3)
    assert (await job.resize(2))[-1].phase == pb.RESIZE_PHASE_COMPLETED
    await _resize(job, 3)
    job.release()
    assert await job.wait_pods_exit(120) == [0, 0, 0]

    check_exactly_once(job.log_dir, DATASET, steps, SPE)
    # DataParallel's mean over ranks and the session's own sum make the same step, up to
    # rounding: DataParallel adds a x W / W and reduces in its own buckets' order, and the
    # differences grow over the steps (measured 2e-7 to 1.8e-5 at lr 0.05 over 50 steps).
    ref = reference_run(tmp_path / "ref", _train(steps), world_size=2, example=BN)
    assert max_rel_loss_diff(final_losses(job.log_dir), final_losses(ref)) <= 1e-4
    assert max_rel_param_diff(job.log_dir / "final_params.npz", ref / "final_params.npz") <= 1e-4
