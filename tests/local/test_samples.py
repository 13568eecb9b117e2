"""The exactly-once audit over sample logs written the way the trainer writes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tide.base.errors import InvalidArgument
from tide.services.local.samples import audit
from tide.trainer.sampler import ResumableSampler, SamplerConfig

pytestmark = pytest.mark.unit

SIZE, BATCH, SEED = 100, 16, 3  # 7 steps per epoch, the last one takes 4 samples
SAMPLER = ResumableSampler(SamplerConfig(SIZE, BATCH, SEED))
# Generations of an elastic run: 2 workers, grown to 4, shrunk back to 2.
RUN = ((1, 2, range(1, 11)), (2, 4, range(11, 21)), (3, 2, range(21, 31)))


def write(log_dir: Path, gen: int, world: int, steps: range, *, skip_rank: int = -1) -> None:
    log_dir.mkdir(exist_ok=True)
    for rank in range(world):
        if rank == skip_rank:
            continue
        with open(log_dir / f"samples-rank{rank}-g{gen}.jsonl", "a") as f:
            for step in steps:
                p = SAMPLER.plan(step, rank, world)
                rec = {
                    "step": step,
                    "epoch": p.epoch,
                    "gen": gen,
                    "rank": rank,
                    "world": world,
                    "ids": [int(i) for i in p.local_indices],
                }
                f.write(json.dumps(rec) + "\n")


def run_audit(log_dir: Path):  # type: ignore[no-untyped-def]
    return audit(log_dir, dataset_size=SIZE, global_batch=BATCH, seed=SEED)


def test_an_elastic_run_consumes_every_sample_exactly_once(tmp_path: Path) -> None:
    for gen, world, steps in RUN:
        write(tmp_path, gen, world, steps)
    a = run_audit(tmp_path)
    assert a.exactly_once, a.summary()
    assert (a.last_step, a.steps_checked) == (30, 30)
    assert a.samples == 4 * SIZE + 2 * BATCH  # four whole epochs (28 steps) and two steps
    assert a.worlds == ((1, 2), (2, 4), (3, 2))
    assert "g1×2, g2×4, g3×2" in a.summary()


def test_a_step_run_by_two_generations_is_reported(tmp_path: Path) -> None:
    for gen, world, steps in RUN:
        write(tmp_path, gen, world, steps)
    write(tmp_path, 1, 2, range(11, 13))  # the old generation went past the checkpoint
    a = run_audit(tmp_path)
    assert not a.exactly_once and a.repeated_steps == (11, 12)
    assert "repeated steps 11, 12" in a.summary()


def test_a_step_no_generation_finished_is_missing(tmp_path: Path) -> None:
    write(tmp_path, 1, 2, range(1, 11))
    write(tmp_path, 2, 4, range(12, 21))  # restored one step too far: step 11 skipped
    a = run_audit(tmp_path)
    assert a.missing_steps == (11,) and not a.exactly_once


def test_samples_other_than_planned_are_wrong(tmp_path: Path) -> None:
    write(tmp_path, 1, 2, range(1, 6))
    path = tmp_path / "samples-rank1-g1.jsonl"
    lines = path.read_text().splitlines()
    rec = json.loads(lines[2])
    rec["ids"][0] = (rec["ids"][0] + 1) % SIZE  # one sample swapped for another
    lines[2] = json.dumps(rec)
    path.write_text("\n".join(lines) + "\n")
    assert run_audit(tmp_path).wrong_steps == (3,)


def test_a_step_cut_short_at_the_end_is_not_an_error(tmp_path: Path) -> None:
    write(tmp_path, 1, 2, range(1, 9))
    write(tmp_path, 1, 2, range(9, 10), skip_rank=1)
    with open(tmp_path / "samples-rank0-g1.jsonl", "a") as f:
        f.write('{"step": 10, "ep')  # the worker was killed mid-write
    a = run_audit(tmp_path)
    assert a.exactly_once and a.last_step == 8 and a.unfinished_steps == (9,)


def test_nothing_logged(tmp_path: Path) -> None:
    assert not run_audit(tmp_path).exactly_once
    with pytest.raises(InvalidArgument):
        run_audit(tmp_path / "absent")
