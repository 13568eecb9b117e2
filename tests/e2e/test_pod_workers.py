"""End to end: pods of two workers each (the shape of a 2-GPU pod, on gloo here)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.e2e.checks import (
    check_exactly_once,
    final_losses,
    max_rel_loss_diff,
    max_rel_param_diff,
    steps_by_generation,
)
from tide.services.testing.localjob import LocalJob, read_jsonl, reference_run, sample_records
from tide.v1 import coordinator_pb2 as pb

pytestmark = [pytest.mark.e2e, pytest.mark.paddle, pytest.mark.slow]

DATASET, BATCH, STEPS = 200, 24, 80
SPE = -(-DATASET // BATCH)
TRAIN = [
    "--dataset-size", str(DATASET),
    "--global-batch", str(BATCH),
    "--hidden", "16",
    "--seed", "5",
    "--steps", str(STEPS),
    "--ckpt-every-steps", "10",
]  # fmt: skip


@pytest.fixture
async def job(tmp_path: Path) -> AsyncIterator[LocalJob]:
    # Gated: the job waits for the grow after the steps the test grants, so it lands
    # mid-run however fast or loaded the machine.
    j = LocalJob(
        tmp_path / "job",
        [*TRAIN, "--step-delay-s", "0.1"],
        heartbeat_timeout_s=10.0,
        launcher_args=["--workers-per-pod", "2"],
        step_gate=True,
    )
    j.start_coordinator()
    yield j
    await j.close()


async def test_two_workers_per_pod_ranks_pod_by_pod_and_a_resize_keeps_parity(
    job: LocalJob, tmp_path: Path
) -> None:
    job.add_pod(0)
    job.add_pod(1)  # waits STANDBY (warm) until the grow takes it
    await job.wait_standby(2)
    first = await job.resize(1)
    assert first[-1].phase == pb.RESIZE_PHASE_COMPLETED, first[-1]
    await job.train_to(5, 60, "step 5")
    grow = await job.resize(2)
    assert grow[-1].phase == pb.RESIZE_PHASE_COMPLETED, grow[-1]
    assert grow[-1].lost_steps == 0
    job.release()
    assert await job.wait_pods_exit(120) == [0, 0]

    gens = steps_by_generation(job.log_dir)
    assert sorted(s for steps in gens.values() for s in steps) == list(range(1, STEPS + 1))
    # World = pods x workers per pod; pod 0 holds ranks 0-1, pod 1 ranks 2-3.
    worlds = {(int(r["gen"]), int(r["world"])) for r in sample_records(job.log_dir)}
    assert worlds == {(1, 2), (2, 4)}, worlds
    placed = {
        (int(r["rank"]), int(r["pod_rank"]), int(r["local_rank"]))
        for r in read_jsonl(job.log_dir / "timings.jsonl")
        if r["event"] == "first_step" and r["gen"] == 2
    }
    assert placed == {(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)}, placed
    check_exactly_once(job.log_dir, DATASET, STEPS, SPE)

    ref = reference_run(tmp_path / "ref", TRAIN, world_size=4)
    assert max_rel_loss_diff(final_losses(job.log_dir), final_losses(ref)) < 1e-5
    assert max_rel_param_diff(job.log_dir / "final_params.npz", ref / "final_params.npz") < 1e-5
