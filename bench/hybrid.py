"""Sharded fleet jobs resized while they train (issue 26), on this machine.

A small transformer (embedding, 2 encoder blocks, a head; AdamW; tide/trainer/examples/
train_transformer.py ``--sharded``: fleet's sharding stage 1, the optimizer state sharded
over every rank) under a coordinator and launchers (tide/services/testing/localjob.py: the
scaler's part played by ``Resize`` calls), resized 2 -> 3 -> 1 -> 4 while it trains; in the
same invocation, a fixed 2-rank run of the same script (no coordinator) and the same chain
in plain data parallel (the same script without ``--sharded``).

- ``stage1_rel_diff``: the largest per-step loss and final-parameter difference of the
  resized sharded run from the fixed run, relative (bench/parity.py's ``rel_diff``);
  ``stage1_optimizer_rel_diff``: the same for every optimizer slot (Adam's moments, beta
  powers) of the two runs' final checkpoints.
- ``stage2_rel_diff``: null, with ``stage2_reason`` and ``stage2_probe``: Paddle 3.3 runs
  sharding stage 2 on GPUs and XPUs only (bench/stage2_probe.py asks this machine's Paddle for
  it on the CPU in this run, and the reason quotes its errors), and Tide refuses it.
- ``exactly_once``: 1 when the resized run used every sample once per epoch, no step twice.
- ``lost_steps``: the coordinator's count, plus any step of the budget never completed.
- ``resizes``: world-size changes in the run's own sample logs.
- ``layouts``: per generation, what its workers logged they sharded over (every rank of a
  generation must agree: ``layouts_consistent``).
- ``pause_s`` / ``dp_pause_s``: each resize's pause, sharded and data parallel; ``stages`` and
  ``dp_stages``: where each went (:func:`stages`);
  ``pause_over_dp_pause``: their sums' ratio (target <= 1.2).
- ``step_s`` / ``dp_step_s``: each generation's median step interval (rank 0's loss log, the
  ``--step-delay-s`` pacing included): a pause holds one step of the new layout
  (:func:`step_intervals`).
- ``aborted_tries``: resizes ABORTED and tried again (all three chains), as the scaler's next
  decision would: on a loaded machine a worker can pass the checkpoint step before its
  directive comes, and the coordinator then aborts rather than checkpoint the wrong step.
- ``stage1_overlap_rel_diff``, ``overlap_pause_s``, ``overlap_lost_steps``: the sharded chain
  again in the coordinator's overlap mode (g+1's groups, fleet's included, formed while g
  trains: docs/resize-protocol.md).
- ``dpsh_*``: data parallel beside sharding (``--sharding-degree-max 2``: each generation
  shards over the largest divisor of its world size up to 2), resized 4 -> 3 -> 2 -> 4 (dp 2 x
  sharding 2 -> dp 3 x 1 -> dp 1 x 2 -> dp 2 x 2) against a fixed 4-rank run of the same
  layout: ``dpsh_rel_diff``, ``dpsh_optimizer_rel_diff``, ``dpsh_layouts`` (per generation,
  the degrees its workers logged), ``dpsh_pause_s``, ``dpsh_exactly_once``,
  ``dpsh_lost_steps``; ``dpsh_dp_pause_s`` and ``dpsh_pause_over_dp_pause``: the same chain in
  plain data parallel, its pauses and their sums' ratio; ``dpsh_stages`` and
  ``dpsh_dp_stages``: where each of the two chains' pauses went (:func:`stages`).

    python -m bench.hybrid --quick   # about 3-4 minutes here (2 cores)
    python -m bench.hybrid --quick --only dpsh   # the dp x sharding chain alone

The last line is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.parity import rel_diff
from tide.services.testing.localjob import ROOT, Chain, LocalJob, reference_run, resize_along
from tide.services.testing.parity import (
    check_exactly_once,
    final_losses,
    fleet_layouts,
    max_rel_array_diff,
    optimizer_state,
    worlds_by_generation,
)

EXAMPLE = str(ROOT / "tide" / "trainer" / "examples" / "train_transformer.py")
CHAIN = (2, 3, 1, 4)
DPSH_CHAIN, DPSH_CAP = (4, 3, 2, 4), 2
DATASET, BATCH = 256, 16
MODEL = [
    "--dataset-size", str(DATASET), "--global-batch", str(BATCH), "--seed", "3",
    # Dropout draws per-rank masks: off, so that the fixed run is the reference. The keys'
    # bias has no gradient but rounding, which AdamW would blow up (train_transformer.py).
    "--dropout", "0", "--no-attention-bias",
    "--d-model", "32", "--layers", "2", "--ckpt-every-steps", "10",
]  # fmt: skip


def stage2() -> dict[str, Any]:
    """``stage2_rel_diff`` and its reason: bench.stage2_probe asks this machine's Paddle for
    stage 2 on the CPU (about 9 s); while no way of asking trains, Tide refuses it and there
    is nothing to compare."""
    from bench.stage2_probe import probe

    found = probe()
    if "trained" in found.values():
        # A Paddle that runs it here: the refusal's premise is gone and the chain is unbuilt.
        return {
            "stage2_rel_diff": None,
            "stage2_reason": f"stage 2 trains on this CPU ({found}) but Tide still refuses "
            "it: build its resharding (docs/sharded.md 'Stage 2')",
            "stage2_probe": found,
        }
    return {
        "stage2_rel_diff": None,
        "stage2_reason": "Paddle runs sharding stage 2 on GPUs and XPUs only: on this CPU "
        f"group_sharded_parallel(level='os_g') fails with {found['api']!r}, "
        f"GroupShardedOptimizerStage2(device='cpu') with {found['direct']!r}; Tide refuses "
        "it (tide/trainer/sharding.py WHY_STAGE2)",
        "stage2_probe": found,
    }


def layouts(job: LocalJob, cap: int = 0) -> tuple[list[dict[str, int]], bool]:
    """Per generation, the degrees its workers logged, and whether every rank of every
    generation logged the degrees tide/trainer/sharding.py's rule gives its world size under
    ``cap`` (one rank alone trains unwrapped: nothing sharded, nothing logged)."""
    from tide.trainer.sharding import degrees as rule

    logged = fleet_layouts(job.workdir.glob("trainer-*/*.log"))
    worlds = worlds_by_generation(job.log_dir)
    out, consistent = [], bool(worlds)
    for gen, world in sorted(worlds.items()):
        seen = logged.get(gen, {})
        consistent = consistent and seen == (
            {r: rule(world, cap) for r in range(world)} if world > 1 else {}
        )
        dp, degree = max(seen.values(), default=(1, 1))
        out.append({"generation": gen, "world": world, "sharding_degree": degree, "dp_degree": dp})
    return out, consistent


def audit(job: LocalJob, chain: Chain, steps: int) -> tuple[int, int]:
    """What really happened to a chain's job: 1 if every sample was read once per epoch (else
    0), and the steps lost (the chain's, and any of 1..steps no generation finished)."""
    try:
        check_exactly_once(job.log_dir, DATASET, steps, -(-DATASET // BATCH))
        once = 1
    except AssertionError:
        once = 0
    done = set(final_losses(job.log_dir))
    return once, chain.lost_steps + steps - len(done & set(range(1, steps + 1)))


def stages(job: LocalJob) -> list[dict[str, float]]:
    """Where each resize's pause went after the barrier, per new generation (the slowest rank
    of each part, from the workers' timings.jsonl): ``group_init_s`` (init_parallel_env, the
    default group), ``script_s`` (the script between that and its first step: fleet.init and
    its groups, the wrappers, attach), ``restore_s`` (handover or transfer), ``first_step_s``,
    and ``gather_s``: the old generation's gather of the optimizer shards at the barrier's
    checkpoint step (0 for plain data parallel)."""
    rows = [json.loads(line) for line in (job.log_dir / "timings.jsonl").read_text().splitlines()]
    firsts: dict[int, list[dict[str, Any]]] = {}
    gathers: dict[int, list[float]] = {}
    for r in rows:
        if r["event"] == "first_step":
            firsts.setdefault(r["gen"], []).append(r)
        elif r["event"] == "shards_gathered":
            gathers.setdefault(r["gen"], []).append(r["gather_s"])
    out = []
    for gen in sorted(firsts)[1:]:
        fs = firsts[gen]
        script = [
            r["first_step_at"] - r["restart_started_at"] - r["worker_restart_s"]
            - r["group_init_s"] - r["restore_s"] - r["first_step_s"]
            for r in fs
        ]  # fmt: skip
        out.append(
            {
                "generation": gen,
                "group_init_s": round(max(r["group_init_s"] for r in fs), 3),
                "script_s": round(max(script), 3),
                "restore_s": round(max(r["restore_s"] for r in fs), 3),
                "first_step_s": round(max(r["first_step_s"] for r in fs), 3),
                "gather_s": round(max(gathers.get(gen - 1, [0.0])), 3),
            }
        )
    return out


def step_intervals(job: LocalJob) -> list[float]:
    """Per generation, the median time between two of its steps, seconds, from the job's
    ``loss.jsonl``. A pause holds the new generation's first step, so a layout whose steps
    cost more (fleet's stage 1 with one collective a tensor, before
    tide/trainer/fused_sync.py) shows it in ``pause_s`` too."""
    rows = [json.loads(line) for line in (job.log_dir / "loss.jsonl").read_text().splitlines()]
    rows.sort(key=lambda r: r["step"])
    by_gen: dict[int, list[float]] = {}
    for a, b in itertools.pairwise(rows):
        if a["gen"] == b["gen"]:
            by_gen.setdefault(b["gen"], []).append(b["t"] - a["t"])
    return [round(statistics.median(by_gen[g]), 3) for g in sorted(by_gen)]


def dp_by_sharding(train: list[str], workdir: Path) -> dict[str, Any]:
    """The ``dpsh_*`` keys: data parallel beside sharding, resized along DPSH_CHAIN."""
    args = [*train, "--sharded", "--sharding-degree-max", str(DPSH_CAP)]
    fixed = reference_run(workdir / "dpsh-fixed", args, DPSH_CHAIN[0], example=EXAMPLE)
    job = LocalJob(workdir / "dpsh", [*args, "--step-delay-s", "0.1"], heartbeat_timeout_s=10.0)
    job.example = EXAMPLE
    chain = asyncio.run(resize_along(job, DPSH_CHAIN))
    steps = int(train[train.index("--steps") + 1])
    out: dict[str, Any] = {
        "dpsh_rel_diff": float(f"{rel_diff(job.log_dir, fixed):.3g}"),
        "dpsh_optimizer_rel_diff": float(
            f"{max_rel_array_diff(optimizer_state(job.ckpt_dir), optimizer_state(workdir / 'dpsh-fixed' / 'ckpt')):.3g}"
        ),
        "dpsh_pause_s": [round(f.pause_s, 3) for f in chain.completed[1:]],
        "dpsh_aborted_tries": len(chain.aborted),
    }
    out["dpsh_exactly_once"], out["dpsh_lost_steps"] = audit(job, chain, steps)
    out["dpsh_layouts"], out["dpsh_layouts_consistent"] = layouts(job, DPSH_CAP)
    out["dpsh_stages"] = stages(job)
    # The same chain of the same model in plain data parallel: the pauses' baseline.
    dp = LocalJob(workdir / "dpsh-dp", [*train, "--step-delay-s", "0.1"], heartbeat_timeout_s=10.0)
    dp.example = EXAMPLE
    dp_chain = asyncio.run(resize_along(dp, DPSH_CHAIN))
    out["dpsh_dp_pause_s"] = [round(f.pause_s, 3) for f in dp_chain.completed[1:]]
    out["dpsh_dp_stages"] = stages(dp)
    out["dpsh_pause_over_dp_pause"] = round(
        sum(out["dpsh_pause_s"]) / max(sum(out["dpsh_dp_pause_s"]), 1e-9), 3
    )
    out["dpsh_aborted_tries"] += len(dp_chain.aborted)
    return out


def run(quick: bool, workdir: Path) -> dict[str, Any]:
    # Long enough that the chain ends before the run does on a loaded machine (newcomers
    # start while it trains on).
    steps = 80 if quick else 200
    train = [*MODEL, "--steps", str(steps)]
    paced = ["--step-delay-s", "0.1"]  # the chain's resizes land mid-run
    fixed = reference_run(workdir / "fixed", [*train, "--sharded"], 2, example=EXAMPLE)
    sharded = LocalJob(workdir / "sharded", [*train, "--sharded", *paced], heartbeat_timeout_s=10.0)
    sharded.example = EXAMPLE
    chain = asyncio.run(resize_along(sharded, CHAIN))
    # Overlap mode: g+1's group (fleet's groups included) forms while g trains.
    overlap = LocalJob(
        workdir / "overlap",
        [*train, "--sharded", *paced],
        heartbeat_timeout_s=10.0,
        resize_mode="overlap",
    )
    overlap.example = EXAMPLE
    over = asyncio.run(resize_along(overlap, CHAIN))
    dp = LocalJob(workdir / "dp", [*train, *paced], heartbeat_timeout_s=10.0)
    dp.example = EXAMPLE
    dp_chain = asyncio.run(resize_along(dp, CHAIN))

    opt_diff = max_rel_array_diff(
        optimizer_state(sharded.ckpt_dir), optimizer_state(workdir / "fixed" / "ckpt")
    )
    result: dict[str, Any] = {
        "stage1_rel_diff": float(f"{rel_diff(sharded.log_dir, fixed):.3g}"),
        "stage1_optimizer_rel_diff": float(f"{opt_diff:.3g}"),
        "stage1_overlap_rel_diff": float(f"{rel_diff(overlap.log_dir, fixed):.3g}"),
        **stage2(),
    }
    result["exactly_once"], result["lost_steps"] = audit(sharded, chain, steps)
    worlds = [w for _, w in sorted(worlds_by_generation(sharded.log_dir).items())]
    result["resizes"] = sum(a != b for a, b in itertools.pairwise(worlds))
    result["layouts"], result["layouts_consistent"] = layouts(sharded)
    # The first "resize" forms generation 1: not a resize of a running job.
    result["pause_s"] = [round(f.pause_s, 3) for f in chain.completed[1:]]
    result["dp_pause_s"] = [round(f.pause_s, 3) for f in dp_chain.completed[1:]]
    result["overlap_pause_s"] = [round(f.pause_s, 3) for f in over.completed[1:]]
    result["overlap_lost_steps"] = over.lost_steps
    result["stages"], result["dp_stages"] = stages(sharded), stages(dp)
    result["step_s"], result["dp_step_s"] = step_intervals(sharded), step_intervals(dp)
    # Tried again, as the scaler would: a barrier missed under load, not a loss.
    result["aborted_tries"] = sum(len(c.aborted) for c in (chain, over, dp_chain))
    result["pause_over_dp_pause"] = round(
        sum(result["pause_s"]) / max(sum(result["dp_pause_s"]), 1e-9), 3
    )
    result.update(dp_by_sharding(train, workdir))
    result["ok"] = (
        result["dpsh_rel_diff"] <= 1e-5
        and result["dpsh_optimizer_rel_diff"] <= 1e-5
        and result["dpsh_exactly_once"] == 1
        and result["dpsh_lost_steps"] == 0
        and result["dpsh_layouts_consistent"]
        and result["stage1_rel_diff"] <= 1e-5
        and result["stage1_optimizer_rel_diff"] <= 1e-5
        and result["stage1_overlap_rel_diff"] <= 1e-5
        and over.lost_steps == 0
        and result["exactly_once"] == 1
        and result["lost_steps"] == 0
        and result["resizes"] >= 3
        and result["layouts_consistent"]
    )
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", choices=["dpsh"], help="run one chain alone")
    ns = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-hybrid-") as tmp:
        if ns.only == "dpsh":
            result = dp_by_sharding([*MODEL, "--steps", "80" if ns.quick else "200"], Path(tmp))
            result["ok"] = (
                result["dpsh_rel_diff"] <= 1e-5
                and result["dpsh_optimizer_rel_diff"] <= 1e-5
                and result["dpsh_exactly_once"] == 1
                and result["dpsh_lost_steps"] == 0
                and result["dpsh_layouts_consistent"]
            )
        else:
            result = run(ns.quick, Path(tmp))
    print("RESULT " + json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
