"""End to end on the CPU: a tensor-parallel job (tide/trainer/examples/train_tensor_parallel.py,
mp_degree 2 by hand over gloo) and a pipeline-parallel one (train_pipeline_parallel.py,
pp_degree 2 by hand over gloo) resized by whole replicas, 2 -> 4 -> 2 ranks (1 -> 2 -> 1 pods
of two workers, each pod a replica), under the coordinator and launchers, against a fixed
2-rank run: every parameter slice and optimizer slot, every sample once per epoch, no step
lost. The newcomers of the grow take their slices from the stayers at the same tensor rank or
pipeline stage (tide/trainer/slices.py); each stayer takes its own from its pod's memory. In
plain and in overlap mode."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tide.services.testing.localjob import ROOT, LocalJob, read_jsonl, reference_run
from tide.services.testing.parity import (
    check_exactly_once,
    final_losses,
    max_rel_loss_diff,
    max_rel_slice_diff,
    model_parallel_coords,
    steps_by_generation,
    worlds_by_generation,
)
from tide.v1 import coordinator_pb2 as pb

pytestmark = [pytest.mark.e2e, pytest.mark.paddle, pytest.mark.slow]


@dataclass(frozen=True)
class Kind:
    """A model-parallel job of two ranks a replica: its example, and which coordinate a
    worker's place in its pod (rank % 2) is."""

    name: str
    script: str
    axis: int  # 1: the pipeline stage, 2: the tensor rank (model_parallel_coords' order)

    @property
    def example(self) -> str:
        return str(ROOT / "tide" / "trainer" / "examples" / self.script)

    @property
    def stores(self) -> list[str]:
        return [
            f"slice-pp{k}-sep0-mp0" if self.axis == 1 else f"slice-pp0-sep0-mp{k}" for k in (0, 1)
        ]


KINDS = [
    Kind("tensor", "train_tensor_parallel.py", 2),
    Kind("pipeline", "train_pipeline_parallel.py", 1),
]
DATASET, BATCH = 96, 16
SPE = DATASET // BATCH
STEPS = 14
TRAIN = [
    "--dataset-size", str(DATASET),
    "--global-batch", str(BATCH),
    "--seed", "5",
    "--steps", str(STEPS),
    "--hidden", "16",
    "--ckpt-every-steps", "4",
]  # fmt: skip


@pytest.fixture(scope="module", params=KINDS, ids=[k.name for k in KINDS])
def kind(request: pytest.FixtureRequest) -> Kind:
    k: Kind = request.param
    return k


@pytest.fixture(scope="module")
def fixed(tmp_path_factory: pytest.TempPathFactory, kind: Kind) -> Path:
    """The fixed 2-rank (1 replica) run a kind's tests compare with: run once a kind."""
    return reference_run(tmp_path_factory.mktemp("fixed"), TRAIN, 2, example=kind.example)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["plain", "overlap"])
async def test_a_model_parallel_job_resized_by_replicas_matches_a_fixed_run(
    tmp_path: Path, kind: Kind, fixed: Path, mode: str
) -> None:
    # Pods of two workers, each pod one replica (as a node of GPUs runs a tensor-parallel
    # group): the grow and the shrink move whole pods. In overlap mode each worker's
    # prepared successor restores its slice while the old generation trains.
    job = LocalJob(
        tmp_path / "job",
        TRAIN,
        heartbeat_timeout_s=10.0,
        step_gate=True,
        resize_mode=mode,
        launcher_args=["--workers-per-pod", "2"],
    )
    job.example = kind.example
    job.start_coordinator()
    try:
        for i in range(2):
            job.add_pod(i)
        await job.wait_standby(2)
        assert (await job.resize(1))[-1].phase == pb.RESIZE_PHASE_COMPLETED
        results = []
        for target in (2, 1):
            await job.train_to(job.granted + 3, 60, "3 more steps")
            final = (await job.resize(target))[-1]
            assert final.phase == pb.RESIZE_PHASE_COMPLETED, final
            assert final.lost_steps == 0
            results.append(final)
        job.release()
        assert await job.wait_pods_exit(120) == [0, 0]
    finally:
        await job.close()

    _check_resized(job, tmp_path, results, kind, fixed)


def _check_resized(
    job: LocalJob, tmp_path: Path, results: list[pb.ResizeProgress], kind: Kind, fixed: Path
) -> None:
    steps_seen = sorted(s for ss in steps_by_generation(job.log_dir).values() for s in ss)
    assert steps_seen == list(range(1, STEPS + 1)), "a step was lost or repeated"
    assert sorted(set(worlds_by_generation(job.log_dir).values())) == [2, 4]
    check_exactly_once(job.log_dir, DATASET, STEPS, SPE)
    assert any(r.checkpoint_step % SPE for r in results), [r.checkpoint_step for r in results]
    logs = list(tmp_path.glob("job/trainer-*/local*/worker-*.log"))
    coords = model_parallel_coords(logs)
    # Each generation's ranks: replica rank // 2, tensor rank (or pipeline stage) rank % 2.
    layouts = {
        gen: {r: (c[0], c[kind.axis]) for r, c in ranks.items()} for gen, ranks in coords.items()
    }
    for ranks in layouts.values():
        assert ranks == {r: (r // 2, r % 2) for r in range(len(ranks))}, coords
    assert sorted(len(r) for r in layouts.values())[-1] == 4
    text = "".join(log.read_text(errors="replace") for log in logs)
    # The grow's two newcomers took their slices from the stayers, not from disk; the staying
    # pod's two workers, at the grow and at the shrink, each took its own slice from the
    # pod's memory (a handover per worker), none from disk.
    assert text.count(" from peer in ") >= 2, "no newcomer received its slice from a stayer"
    assert text.count(" from memory in ") >= 4, "a stayer's slice did not come from memory"
    assert " from disk in " not in text, "a slice of a planned resize came from disk"

    loss_diff = max_rel_loss_diff(final_losses(job.log_dir), final_losses(fixed))
    slice_diff = max_rel_slice_diff(job.log_dir, fixed)
    print(
        f"{kind.name} parallel 2 -> 4 -> 2 vs fixed 2: loss {loss_diff:.2e}, "
        f"slices {slice_diff:.2e}"
    )
    assert loss_diff <= 1e-5
    assert slice_diff <= 1e-5


def test_a_model_parallel_job_restarted_from_disk_at_other_replicas_matches_a_fixed_run(
    tmp_path: Path, kind: Kind, fixed: Path
) -> None:
    """No coordinator, no memory: 2 replicas to step 8, then 1 replica on to the end, each
    rank reading its own slice's durable store (a checkpoint per slice)."""
    base = [a for a in TRAIN if a not in ("--steps", str(STEPS))]
    for world, steps in ((4, 8), (2, STEPS)):
        logs = reference_run(
            tmp_path / "restarted", [*base, "--steps", str(steps)], world, example=kind.example
        )
    stores = sorted(p.name for p in (tmp_path / "restarted" / "ckpt").iterdir())
    assert stores == kind.stores
    # The trajectory does not depend on the world size, so a second run from scratch would
    # match the fixed run too: each of its ranks must say it resumed step 8 from its store.
    for rank in range(2):
        text = (tmp_path / "restarted" / f"ref-rank{rank}.log").read_text(errors="replace")
        restored = re.findall(r"restored step (\d+) from (\w+)", text)
        assert restored == [("0", "scratch"), ("8", "disk")], (rank, restored)
        records = read_jsonl(logs / f"samples-rank{rank}-g0.jsonl")
        assert [r["step"] for r in records if r["world"] == 2] == list(range(9, STEPS + 1))
    diff = max_rel_slice_diff(logs, fixed)
    print(f"{kind.name} parallel restarted 4 -> 2 from disk vs fixed 2: slices {diff:.2e}")
    assert diff <= 1e-5
