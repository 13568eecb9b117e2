"""End to end with real Paddle workers on gloo: the coordinator, launchers as pods, resizes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tide.v1 import coordinator_pb2 as pb

from tests.e2e.checks import (
    check_exactly_once,
    final_losses,
    max_rel_loss_diff,
    max_rel_param_diff,
    samples_per_step,
    steps_by_generation,
)
from trainer.localjob import LocalJob, reference_run

pytestmark = [pytest.mark.paddle, pytest.mark.slow]

DATASET, BATCH = 1000, 64
SPE = -(-DATASET // BATCH)  # 16 steps per epoch; the 16th takes the 40-sample tail
STEPS = 120
TRAIN = [
    "--dataset-size", str(DATASET),
    "--global-batch", str(BATCH),
    "--seed", "3",
    "--steps", str(STEPS),
    "--ckpt-every-steps", "10",
    "--keep", "4",
]  # fmt: skip
SLOW = ["--step-delay-s", "0.04"]


@pytest.fixture
async def job(tmp_path: Path) -> AsyncIterator[LocalJob]:
    j = LocalJob(tmp_path / "job", [*TRAIN, *SLOW])
    j.start_coordinator()
    yield j
    await j.close()


async def _progress_past(job: LocalJob, step: int, timeout_s: float = 60.0) -> pb.JobStatus:
    return await job.wait_status(lambda s: s.step >= step, timeout_s, f"step {step}")


async def test_resize_2_3_1_2_loses_nothing_and_matches_a_fixed_run(
    job: LocalJob, tmp_path: Path
) -> None:
    for i in range(2):
        job.add_pod(i)
    await job.wait_standby(2)
    first = await job.resize(2)
    assert first[-1].phase == pb.RESIZE_PHASE_COMPLETED, first[-1]

    results = []
    for target, newcomer in ((3, 2), (1, None), (2, 3)):
        st = await _progress_past(job, (await job.status()).step + 8)  # type: ignore[union-attr]
        assert st.step < STEPS - 20, "the run is too fast for the resizes to land mid-run"
        if newcomer is not None:
            job.add_pod(newcomer)
            await job.wait_standby(1)
        updates = await job.resize(target)
        final = updates[-1]
        assert final.phase == pb.RESIZE_PHASE_COMPLETED, final
        assert final.lost_steps == 0
        results.append(final)
        st = await job.wait_status(lambda s: s.world_size == target, 30, f"world {target}")

    codes = await job.wait_pods_exit(120)
    # Pods 1 and 2 were drained by the 3 -> 1 shrink; all exit 0.
    assert codes == [0, 0, 0, 0], codes

    log_dir = job.log_dir
    gens = steps_by_generation(log_dir)
    all_steps = [s for steps in gens.values() for s in steps]
    assert sorted(all_steps) == list(range(1, STEPS + 1)), "a step was lost or repeated"
    worlds = {r["gen"]: set() for r in []}
    per_step = samples_per_step(log_dir)
    worlds_seen = sorted({len(e["ranks"]) for e in per_step.values()})
    assert worlds_seen == [1, 2, 3]
    check_exactly_once(log_dir, DATASET, STEPS, SPE)
    # Resizes happened mid-epoch, not only at epoch boundaries.
    assert any(r.checkpoint_step % SPE for r in results)

    ref_logs = reference_run(tmp_path / "ref", TRAIN, world_size=2)
    loss_diff = max_rel_loss_diff(final_losses(log_dir), final_losses(ref_logs))
    param_diff = max_rel_param_diff(log_dir / "final_params.npz", ref_logs / "final_params.npz")
    print(f"parity vs fixed 2-worker run: loss {loss_diff:.2e}, params {param_diff:.2e}")
    assert loss_diff < 1e-5
    assert param_diff < 1e-5
    for r in results:
        print(f"resize to {r.world_size}: pause {r.pause_s:.3f}s {r.pause}")
