"""End to end: a Paddle fleet job with AdamW's state sharded (stage 1, tide/trainer/sharding.py)
resized 2 -> 3 -> 2 under the coordinator and launchers, against a fixed 2-rank run; data
parallel beside sharding (``sharding_degree_max`` 2) resized 4 -> 3 -> 2 -> 4; and a layout
Tide refuses, failing before its first step."""

from __future__ import annotations

import os
import subprocess
import sys
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
from tide.services.testing.localjob import ROOT, LocalJob, gloo_env, reference_run, resize_along
from tide.services.testing.parity import (
    fleet_layouts,
    max_rel_array_diff,
    optimizer_state,
    worlds_by_generation,
)
from tide.services.testing.refcache import ReferenceRuns
from tide.trainer.sharding import degrees
from tide.v1 import coordinator_pb2 as pb

pytestmark = [pytest.mark.e2e, pytest.mark.paddle, pytest.mark.slow]

SHARDED = str(ROOT / "tide" / "trainer" / "examples" / "train_sharded.py")
MLP = str(ROOT / "tide" / "trainer" / "examples" / "train_mlp.py")
DATASET, BATCH = 400, 32
SPE = -(-DATASET // BATCH)  # 13 steps an epoch, the last one a 16-sample tail
# The resized jobs are gated, so their last resize lands by step ~15 whatever the budget:
# 40 steps leave two epochs and more after it, and are the length of the restarted tests'
# fixed runs, which are therefore the resized tests' shared ones (reference_runs).
STEPS = 40
TRAIN = [
    "--dataset-size", str(DATASET),
    "--global-batch", str(BATCH),
    "--seed", "5",
    "--steps", str(STEPS),
    "--hidden", "256",
    "--ckpt-every-steps", "10",
    "--keep", "3",
]  # fmt: skip


# The sharded script, and the same model in plain data parallel (train_mlp.py): the baseline
# of the pause figures in docs/sharded.md, measured in the same session; and the sharded script
# in overlap mode, its fleet groups formed ahead by prepared workers.
@pytest.fixture(
    params=[
        (SHARDED, "plain"),
        (MLP, "plain"),
        (SHARDED, "overlap"),
    ],
    ids=["sharded", "dp", "sharded-overlap"],
)
async def sharded_job(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[LocalJob]:
    # Gated: the job waits for each resize after the steps the test grants, so both land
    # mid-run however fast or loaded the machine.
    example, mode = request.param
    job = LocalJob(
        tmp_path / "job",
        [*TRAIN, "--step-delay-s", "0.1"],
        heartbeat_timeout_s=10.0,
        resize_mode=mode,
        step_gate=True,
    )
    job.example = example
    job.start_coordinator()
    yield job
    await job.close()


@pytest.mark.timeout(300)
async def test_sharded_job_resized_2_3_2_matches_a_fixed_run(
    sharded_job: LocalJob, reference_runs: ReferenceRuns
) -> None:
    job = sharded_job
    for i in range(3):
        job.add_pod(i)
    await job.wait_standby(3)
    assert (await job.resize(2))[-1].phase == pb.RESIZE_PHASE_COMPLETED
    results = []
    for target in (3, 2):
        await job.train_to(job.granted + 5, 60, "5 more steps")
        final = (await job.resize(target))[-1]
        assert final.phase == pb.RESIZE_PHASE_COMPLETED, final
        assert final.lost_steps == 0
        results.append(final)
        await job.wait_status(lambda s, t=target: s.world_size == t, 30, f"world {target}")  # type: ignore[misc]
    job.release()
    assert await job.wait_pods_exit(120) == [0, 0, 0]

    steps_seen = sorted(s for ss in steps_by_generation(job.log_dir).values() for s in ss)
    assert steps_seen == list(range(1, STEPS + 1)), "a step was lost or repeated"
    worlds = sorted({len(e["ranks"]) for e in samples_per_step(job.log_dir).values()})
    assert worlds == [2, 3]
    check_exactly_once(job.log_dir, DATASET, STEPS, SPE)
    assert any(r.checkpoint_step % SPE for r in results), "no resize landed mid-epoch"

    # The sharded and sharded-overlap params compare with the same fixed run: run once.
    ref = reference_runs(TRAIN, world_size=2, example=job.example)
    loss_diff = max_rel_loss_diff(final_losses(job.log_dir), final_losses(ref))
    param_diff = max_rel_param_diff(job.log_dir / "final_params.npz", ref / "final_params.npz")
    # Every moment and beta power of every parameter, whole in the final checkpoint.
    opt_diff = max_rel_array_diff(
        optimizer_state(job.ckpt_dir), optimizer_state(ref.parent / "ckpt")
    )
    kind = "sharded" if job.example == SHARDED else "dp"
    print(
        f"{kind} parity vs a fixed 2-rank run: loss {loss_diff:.2e}, params {param_diff:.2e}, "
        f"optimizer {opt_diff:.2e}"
    )
    for r in results:
        print(f"{kind} resize to {r.world_size}: pause {r.pause_s:.3f}s {r.pause}")
    assert loss_diff <= 1e-5
    assert param_diff <= 1e-5
    assert opt_diff <= 1e-5


@pytest.mark.parametrize(
    ("flag", "named"),
    [("--hybrid=mp_degree:2", "mp_degree=2"), ("--hybrid=pp_degree:2", "pp_degree=2")],
)
def test_a_layout_tide_cannot_resize_fails_before_its_first_step(
    tmp_path: Path, flag: str, named: str
) -> None:
    # One rank: the refusal comes from Tide's strategy, before fleet.init (which itself
    # refuses tensor parallelism on a CPU, with a message about devices).
    env = {**gloo_env(0, [0]), "PYTHONPATH": f"{ROOT}"}
    done = subprocess.run(
        [sys.executable, SHARDED, "--ckpt-dir", str(tmp_path / "ckpt"), "--steps", "3", flag],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "UnsupportedLayout" in done.stderr and named in done.stderr, done.stderr[-2000:]
    assert "not supported under Tide" in done.stderr
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_a_sharded_job_restarted_from_disk_at_other_degrees_matches_a_fixed_run(
    tmp_path: Path, reference_runs: ReferenceRuns
) -> None:
    """The durable checkpoint is whole: restarts at 3, then 2 ranks (no coordinator, no
    handover; every rank reads the store) follow the fixed run's trajectory, moments too.
    A checkpoint holding rank 0's shard alone would restart the other slots at zero."""
    base = [a for a in TRAIN if a not in ("--steps", str(STEPS))]
    # 20, 30 then 40 steps: the last restart ends where the fixed run does.
    for world, steps in ((2, STEPS // 2), (3, STEPS * 3 // 4), (2, STEPS)):
        logs = reference_run(
            tmp_path / "restarted", [*base, "--steps", str(steps)], world, example=SHARDED
        )
    # The fixed run the resized sharded tests compare with: the session runs it once.
    fixed = reference_runs(TRAIN, world_size=2, example=SHARDED)
    param_diff = max_rel_param_diff(logs / "final_params.npz", fixed / "final_params.npz")
    opt_diff = max_rel_array_diff(
        optimizer_state(tmp_path / "restarted/ckpt"), optimizer_state(fixed.parent / "ckpt")
    )
    print(f"restarted 2 -> 3 -> 2 from disk: params {param_diff:.2e}, optimizer {opt_diff:.2e}")
    assert param_diff <= 1e-5
    assert opt_diff <= 1e-5


CAP = "--sharding-degree-max=2"


@pytest.mark.timeout(480)
@pytest.mark.parametrize("mode", ["plain", "overlap"])
async def test_dp_beside_sharding_resized_4_3_2_4_matches_a_fixed_run(
    tmp_path: Path, mode: str, reference_runs: ReferenceRuns
) -> None:
    """dp 2 x sharding 2 -> dp 3 x sharding 1 -> dp 1 x sharding 2 -> dp 2 x sharding 2, by
    the rule under sharding_degree_max 2, against a fixed run at the first layout. Each
    generation's ranks log the degrees they run (tide/trainer/session.py), and the state gathered
    from the first replica's sharding group (a replica's own shards would leave out the
    other groups') is whole at every checkpoint. In overlap mode the prepared workers form
    fleet's subgroups (their own stores) while the old generation trains."""
    # Gated: each resize waits for the job (resize_along), never the other way round.
    job = LocalJob(
        tmp_path / "job",
        [*TRAIN, CAP, "--step-delay-s", "0.1"],
        heartbeat_timeout_s=10.0,
        resize_mode=mode,
        step_gate=True,
    )
    job.example = SHARDED
    chain = await resize_along(job, (4, 3, 2, 4))
    assert chain.lost_steps == 0
    steps_seen = sorted(s for ss in steps_by_generation(job.log_dir).values() for s in ss)
    assert steps_seen == list(range(1, STEPS + 1)), "a step was lost or repeated"
    check_exactly_once(job.log_dir, DATASET, STEPS, SPE)
    worlds = worlds_by_generation(job.log_dir)
    assert [w for _, w in sorted(worlds.items())] == [4, 3, 2, 4]
    logged = fleet_layouts(job.workdir.glob("trainer-*/*.log"))
    for gen, world in worlds.items():
        assert logged[gen] == {r: degrees(world, 2) for r in range(world)}, (gen, logged)
    assert {degrees(w, 2) for w in worlds.values()} == {(2, 2), (3, 1), (1, 2)}

    # Both modes compare with the same fixed run: the session runs it once.
    ref = reference_runs([*TRAIN, CAP], world_size=4, example=SHARDED)
    loss_diff = max_rel_loss_diff(final_losses(job.log_dir), final_losses(ref))
    param_diff = max_rel_param_diff(job.log_dir / "final_params.npz", ref / "final_params.npz")
    opt_diff = max_rel_array_diff(
        optimizer_state(job.ckpt_dir), optimizer_state(ref.parent / "ckpt")
    )
    print(
        f"dp x sharding ({mode}) parity vs a fixed 4-rank run: loss {loss_diff:.2e}, "
        f"params {param_diff:.2e}, optimizer {opt_diff:.2e}; "
        f"pauses {[round(r.pause_s, 3) for r in chain.completed[1:]]}"
    )
    assert loss_diff <= 1e-5
    assert param_diff <= 1e-5
    assert opt_diff <= 1e-5


def test_dp_beside_sharding_restarted_from_disk_at_other_layouts_matches_a_fixed_run(
    tmp_path: Path, reference_runs: ReferenceRuns
) -> None:
    """Restarts at 4 (dp 2 x sharding 2), 3 (dp 3), 2 (sharding 2) ranks from the durable
    checkpoint, against a fixed 4-rank run: the gathered state is whole whichever layout
    wrote it and whichever reads it."""
    base = [a for a in TRAIN if a not in ("--steps", str(STEPS))] + [CAP]
    for world, steps in ((4, STEPS // 2), (3, STEPS * 3 // 4), (2, STEPS)):
        logs = reference_run(
            tmp_path / "restarted", [*base, "--steps", str(steps)], world, example=SHARDED
        )
    # The fixed 4-rank run the resized dp x sharding tests compare with (shared).
    fixed = reference_runs([*TRAIN, CAP], world_size=4, example=SHARDED)
    param_diff = max_rel_param_diff(logs / "final_params.npz", fixed / "final_params.npz")
    opt_diff = max_rel_array_diff(
        optimizer_state(tmp_path / "restarted/ckpt"), optimizer_state(fixed.parent / "ckpt")
    )
    print(
        f"dp x sharding restarted 4 -> 3 -> 2 from disk: params {param_diff:.2e}, "
        f"optimizer {opt_diff:.2e}"
    )
    assert param_diff <= 1e-5
    assert opt_diff <= 1e-5
