"""The pause of a planned resize against the size of the state, against the bytes' own cost.

For each state size per rank (1 MB, 100 MB, 1 GB by default; bench/statesize_train.py: the MLP
of tide/trainer/examples/train_mlp.py plus a persistable buffer of that size that every step
changes) and each resize mode (plain, overlap): a real coordinator and one launcher per pod
resize the job 2 -> 4 and 4 -> 2 (bench/rescale.py's way: the pause is the gap between rank
0's last old step and its first new one, less one ordinary step). In the same run:

- Paddle's way: every process killed half a checkpoint period after a checkpoint, and a
  fresh job at the new size that imports Paddle, joins and loads the checkpoint from disk;
- a bare gloo broadcast of the same bytes to 4 ranks, the median of BARE_REPEATS (what moving
  the state costs at best);
- a profile of the state's path by stage in one process (snapshot into the handover, take,
  load into the model, the durable write, a spare filled while the state taken is mapped and a
  put into it, the next put over the taken handover's pages), with the bytes each stage
  copies.

Fidelity: every new generation's rank checks after its first step that the buffer is exactly
what the steps made of it (``restore.jsonl``); exactly-once samples and lost steps from the
logs; the loss trajectory against a fixed 2-rank run of the same MLP (``max_rel_diff``).

    python -m bench.statesize --quick   # 1 MB, 100 MB, 1 GB: one resize each way, each mode
    python -m bench.statesize           # and 2 GB
    python -m bench.statesize --sizes-mb 1,100,400 --modes plain
    python -m bench.statesize --quick --senders-max 2   # two stayers send a share each

The newcomers' transfer follows the workers' TIDE_TRANSFER_* settings (tide/trainer/transfer.py):
``--group-min-mb`` and ``--senders-max`` set them for the run, and the result names them.

The last line is ``RESULT {json}``: ms_per_mb (the plain mode's pause, least-squares slope
over the sizes, the worse direction), bare_broadcast_ms_per_mb, slope_over_bare (target <= 2),
pause_over_relaunch_1gb (each mode's worse direction at the largest size; target <= 0.2),
barrier_growth_s (the barrier at the largest size less at the smallest; target <= 0.1),
peak_extra_mem_mb_per_rank (the most a new worker's peak RSS grew during its restore),
lost_steps (0), exactly_once (1), max_rel_diff (<= 1e-5), and the figures behind them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from bench.rescale import Measure, paddle_way, tide_way
from tide.services.testing.localjob import ROOT, read_jsonl, reference_run, sample_records
from tide.services.testing.parity import final_losses
from tide.trainer.spawner import ZygoteSpawner
from tide.trainer.transfer import GROUP_MIN_MB_ENV, SENDERS_MAX_ENV, TransferSettings

SCRIPT = str(ROOT / "bench" / "statesize_train.py")
MODES = ("plain", "overlap")
DATASET = 4000
BATCH = 128
TRAIN = [
    "--dataset-size", str(DATASET),
    "--global-batch", str(BATCH),
    "--hidden", "64",
    "--seed", "1",
    "--keep", "2",
    "--step-delay-s", "0.02",
]  # fmt: skip
# Paddle's way restores its last periodic checkpoint: one every this many steps. The killed
# run trains 2.5 periods first (bench/rescale.py), and at 1 GB a step and a checkpoint cost
# seconds here: the run-up, not the relaunch it measures, was a quarter of --quick at 10.
RELAUNCH_CKPT_EVERY = 4


def train_args(state_mb: float, ckpt_every: int) -> list[str]:
    return [*TRAIN, "--ckpt-every-steps", str(ckpt_every), "--state-mb", str(state_mb)]


_BCAST = """
import json, os, sys, time
import numpy as np, paddle, paddle.distributed as dist
dist.init_parallel_env()
rank = dist.get_rank()
out = {}
for mb in json.loads(os.environ["PROBE_SIZES"]):
    buf = np.full(int(mb * 2**20), rank, dtype=np.uint8)
    t = paddle.from_dlpack(buf)
    took = []
    for _ in range(int(os.environ["PROBE_REPEATS"])):
        buf[-1] = rank
        dist.barrier()
        started = time.monotonic()
        dist.broadcast(t, src=0)
        dist.barrier()
        took.append(time.monotonic() - started)
        assert int(buf[-1]) == 0
    out[str(mb)] = took
    del t, buf
with open(os.environ["PROBE_OUT"] + f".{rank}", "w") as f:
    json.dump(out, f)
"""


#: The bare broadcast of each size is timed this many times and the median kept: one
#: broadcast of 1 GB took 0.66 to 1.5 s on this machine from run to run, and the ratio
#: slope_over_bare moved with it as much as with the pause.
BARE_REPEATS = 3


async def bare_broadcast(
    workdir: Path, sizes_mb: list[float], world: int = 4
) -> dict[float, float]:
    """Seconds for a gloo broadcast of each size from rank 0 to ``world`` ranks (from a
    barrier to a barrier after it: every rank has the bytes), the median of BARE_REPEATS
    (each the slowest rank's)."""
    from tide.services.testing.localjob import gloo_env
    from tide.services.testing.ports import free_port

    workdir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - before any timing
    script = workdir / "bcast.py"
    script.write_text(_BCAST)
    ports = [free_port() for _ in range(world)]
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            **gloo_env(rank, ports),
            "PROBE_SIZES": json.dumps(sizes_mb),
            "PROBE_REPEATS": str(BARE_REPEATS),
            "PROBE_OUT": str(workdir / "bcast"),
        }
        log = open(workdir / f"bcast-{rank}.log", "ab")  # noqa: SIM115, ASYNC230
        procs.append(
            await asyncio.create_subprocess_exec(
                sys.executable, str(script), cwd=ROOT, env=env, stdout=log, stderr=log
            )
        )
        log.close()
    async with asyncio.timeout(300):
        codes = [await p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"broadcast probe failed with {codes}; see {workdir}")
    per_rank = [json.loads((workdir / f"bcast.{r}").read_text()) for r in range(world)]
    return {
        mb: statistics.median(
            max(float(r[str(mb)][k]) for r in per_rank) for k in range(BARE_REPEATS)
        )
        for mb in sizes_mb
    }


# The longest a spare's fill may take in the stage profile (1 GB took 0.5-13 s here).
SPARE_FILL_MAX_S = 120.0


def stage_profile(state_mb: float, workdir: Path) -> dict[str, float]:
    """The state's path in one process, by stage, seconds (the bytes each copies: docs)."""
    import paddle

    from bench.statesize_train import Sized
    from tide.trainer import paddle_state, rawstate
    from tide.trainer.checkpoint import CheckpointStore
    from tide.trainer.handover import RESERVE, ShmHandover, pod_handover_dir

    paddle.seed(0)
    model = Sized(64, state_mb)
    opt = paddle.optimizer.Adam(parameters=model.parameters())
    model(paddle.ones([4, 32])).sum().backward()
    opt.step()
    out: dict[str, float] = {}
    handover = ShmHandover(pod_handover_dir("bench/statesize", "profile", os.urandom(4).hex()))
    try:
        t = time.monotonic()
        files = paddle_state.state_files(model, opt, None, raw=True)
        out["snapshot_s"] = time.monotonic() - t
        t = time.monotonic()
        handover.put(1, files, {})
        out["shm_put_s"] = time.monotonic() - t
        # The pod's next worker (rank 0: it maps the state it took until its durable write).
        nxt = ShmHandover(handover.root)
        t = time.monotonic()
        taken = nxt.take()
        assert taken is not None
        out["shm_take_s"] = time.monotonic() - t
        t = time.monotonic()
        paddle_state.load_state(taken.files, model, opt, None)
        out["load_s"] = time.monotonic() - t
        t = time.monotonic()
        CheckpointStore(workdir / f"profile-{state_mb}", keep=1).write(1, taken.files, {})
        out["durable_write_s"] = time.monotonic() - t
        # After its first step, with the state taken still mapped: a spare (none before
        # this change), filled beside training; the hold's put goes into it.
        arrays = getattr(files, "arrays", {})
        t = time.monotonic()
        if nxt.reserve(rawstate.layout(rawstate.specs(arrays))[2]):
            # A fill that fails (no room) logs it and leaves no spare: give up, loudly.
            deadline = time.monotonic() + SPARE_FILL_MAX_S
            while not (nxt.root / RESERVE).exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the spare's fill did not end in {SPARE_FILL_MAX_S} s")
                time.sleep(0.01)
        out["spare_fill_s"] = time.monotonic() - t
        t = time.monotonic()
        nxt.put(2, files, {})
        out["shm_put_spare_s"] = time.monotonic() - t
        del taken
        gc.collect()
        # The next hold's put: over the pages of the handover taken (nothing maps it now).
        t = time.monotonic()
        nxt.put(3, files, {})
        out["shm_put_again_s"] = time.monotonic() - t
        del files, arrays
    finally:
        shutil.rmtree(handover.root, ignore_errors=True)
        del model, opt
        gc.collect()
    return out


def _slope(points: dict[float, float]) -> float:
    """Least-squares slope of seconds over MB, in ms per MB."""
    xs, ys = np.array(list(points)), np.array(list(points.values()))
    if len(xs) < 2:
        raise ValueError("a slope needs two sizes or more (--sizes-mb)")
    return float(np.polyfit(xs, ys, 1)[0] * 1000)


def _exactly_once(log_dir: Path, upto: int) -> int:
    """1 when each step 1..upto ran in exactly one generation, and no epoch used a sample
    twice (and every complete epoch used every sample)."""
    gens: dict[int, set[int]] = defaultdict(set)
    ids: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for r in sample_records(log_dir):
        step = int(r["step"])
        if step <= upto:
            gens[step].add(int(r["gen"]))
            ids[int(r["epoch"])][step].extend(int(i) for i in r["ids"])
    if sorted(gens) != list(range(1, upto + 1)) or any(len(g) != 1 for g in gens.values()):
        return 0
    spe = -(-DATASET // BATCH)
    for epoch, steps in ids.items():
        got = [i for s in steps.values() for i in s]
        if len(got) != len(set(got)):
            return 0
        if (epoch + 1) * spe <= upto and sorted(set(got)) != list(range(DATASET)):
            return 0
    return 1


async def tide_at(
    workdir: Path, state_mb: float, mode: str
) -> tuple[list[Measure], dict[str, Any]]:
    rows = await tide_way(
        workdir,
        1,
        {2: 0.0, 4: 0.0},
        mode,
        train=train_args(state_mb, 100000),
        example=SCRIPT,
        # A large state's standby workers take long to build: the job must not end first.
        steps=100000,
        settle=True,
    )
    log_dir = workdir / "logs"
    restores = read_jsonl(log_dir / "restore.jsonl")
    later = [r for r in restores if int(r["restored_step"]) > 0]
    losses = final_losses(log_dir)
    # The last step every rank finished (the job is stopped after the last resize).
    upto = max(losses) - 1
    facts = {
        "ballast_ok": int(bool(later) and all(r["ballast_ok"] for r in later)),
        "peak_extra_mb": max((r["peak_mb"] - r["before_mb"] for r in later), default=0.0),
        "exactly_once": _exactly_once(log_dir, upto),
        "losses": {s: v for s, v in losses.items() if s <= upto},
    }
    return rows, facts


async def run(
    quick: bool, sizes_mb: list[float], workdir: Path, modes: tuple[str, ...] = MODES
) -> dict[str, Any]:
    t0 = time.monotonic()
    load_before = os.getloadavg()
    bare = await bare_broadcast(workdir / "bcast", sizes_mb)
    profile = {mb: stage_profile(mb, workdir) for mb in sizes_mb}
    tide: dict[tuple[str, float], list[Measure]] = {}
    facts: dict[tuple[str, float], dict[str, Any]] = {}
    for mode in modes:
        for mb in sizes_mb:
            tide[(mode, mb)], facts[(mode, mb)] = await tide_at(
                workdir / f"tide-{mode}-{mb:g}", mb, mode
            )
    largest, smallest = max(sizes_mb), min(sizes_mb)
    relaunch: list[Measure] = []
    zygote = ZygoteSpawner()
    try:
        for old, new in ((2, 4), (4, 2)):
            relaunch.append(
                await paddle_way(
                    workdir / f"paddle-{old}-{new}",
                    old,
                    new,
                    zygote,
                    train=train_args(largest, RELAUNCH_CKPT_EVERY),
                    example=SCRIPT,
                    ckpt_every=RELAUNCH_CKPT_EVERY,
                )
            )
    finally:
        await zygote.close()
    steps = max(max(f["losses"]) for f in facts.values())
    ref_dir = reference_run(
        workdir / "fixed", [*train_args(smallest, 100000), "--steps", str(steps)], 2, 300, SCRIPT
    )
    fixed = final_losses(ref_dir)
    max_rel = max(
        abs(v - fixed[s]) / max(abs(fixed[s]), 1e-12)
        for f in facts.values()
        for s, v in f["losses"].items()
    )

    def worst(mode: str, mb: float, key: str = "pause_s") -> float:
        return max(float(getattr(m, key)) for m in tide[(mode, mb)])

    print(f"{'mode':8}{'MB':>7}{'resize':>7}{'pause':>8}{'barrier':>9}{'put':>7}{'restart':>9}"
          f"{'init':>7}{'restore':>9}{'memory':>8}{'peer':>7}{'disk':>7}{'lost':>6}")  # fmt: skip
    for (mode, mb), rows in tide.items():
        for m in rows:
            print(
                f"{mode:8}{mb:7g}{m.resize:>7}{m.pause_s:8.3f}{m.barrier_s:9.3f}"
                f"{m.checkpoint_write_s:7.3f}{m.worker_restart_s:9.3f}{m.group_init_s:7.3f}"
                f"{m.restore_s:9.3f}{m.handover_s:8.3f}{m.transfer_s:7.3f}{m.disk_read_s:7.3f}"
                f"{m.lost_steps:6d}"
            )
    for m in relaunch:
        print(f"paddle  {largest:7g}{m.resize:>7}{m.pause_s:8.3f}  (kill + relaunch)")
    for mb, stages in profile.items():
        print(f"stages at {mb:g} MB: " + ", ".join(f"{k} {v:.3f}" for k, v in stages.items()))
    print(
        "bare gloo broadcast to 4 ranks: "
        + ", ".join(f"{mb:g} MB {s:.3f}s" for mb, s in bare.items())
    )
    pause_by_mb = {mb: worst("plain", mb) for mb in sizes_mb}
    ms_per_mb = _slope(pause_by_mb)
    bare_ms_per_mb = _slope(bare)
    relaunch_s = max(m.pause_s for m in relaunch)
    result = {
        "ms_per_mb": round(ms_per_mb, 3),
        "bare_broadcast_ms_per_mb": round(bare_ms_per_mb, 3),
        "slope_over_bare": round(ms_per_mb / bare_ms_per_mb, 2),
        "ms_per_mb_by_mode": {
            mode: round(_slope({mb: worst(mode, mb) for mb in sizes_mb}), 3) for mode in modes
        },
        "pause_over_relaunch_1gb": {
            mode: round(worst(mode, largest) / relaunch_s, 3) for mode in modes
        },
        "barrier_growth_s": round(
            max(
                worst(mode, largest, "barrier_s") - worst(mode, smallest, "barrier_s")
                for mode in modes
            ),
            3,
        ),
        "peak_extra_mem_mb_per_rank": round(max(f["peak_extra_mb"] for f in facts.values()), 1),
        "lost_steps": max(m.lost_steps for rows in tide.values() for m in rows),
        "exactly_once": min(f["exactly_once"] for f in facts.values()),
        "state_exact": min(f["ballast_ok"] for f in facts.values()),
        "max_rel_diff": float(f"{max_rel:.3g}"),
        "largest_mb": largest,
        "pause_s": {
            mode: {
                f"{mb:g}": {m.resize: round(m.pause_s, 3) for m in tide[(mode, mb)]}
                for mb in sizes_mb
            }
            for mode in modes
        },
        "barrier_s": {
            mode: {f"{mb:g}": round(worst(mode, mb, "barrier_s"), 3) for mb in sizes_mb}
            for mode in modes
        },
        "relaunch_pause_s": {m.resize: round(m.pause_s, 3) for m in relaunch},
        "bare_broadcast_s": {f"{mb:g}": round(s, 3) for mb, s in bare.items()},
        "stages_s": {
            f"{mb:g}": {k: round(v, 4) for k, v in st.items()} for mb, st in profile.items()
        },
        "resizes": {
            f"{mode}-{mb:g}": [asdict(m) for m in rows] for (mode, mb), rows in tide.items()
        },
        "loadavg_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "quick": quick,
        "elapsed_s": round(time.monotonic() - t0, 1),
    }
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1 MB, 100 MB and 1 GB per rank")
    p.add_argument(
        "--sizes-mb",
        default="",
        help="state per rank, MB, comma-separated (default 1,100,1024; without --quick ,2048)",
    )
    p.add_argument("--modes", default=",".join(MODES), help="resize modes, comma-separated")
    p.add_argument(
        "--group-min-mb",
        type=float,
        default=None,
        help="TIDE_TRANSFER_GROUP_MIN_MB for the workers (default: the setting's)",
    )
    p.add_argument(
        "--senders-max",
        type=int,
        default=None,
        help="TIDE_TRANSFER_SENDERS_MAX for the workers (default: the setting's)",
    )
    p.add_argument(
        "--workdir", default="", help="keep logs here (default: a temp dir, removed at the end)"
    )
    args = p.parse_args(argv)
    sizes_mb = args.sizes_mb or ("1,100,1024" if args.quick else "1,100,1024,2048")
    sizes = [float(s) for s in sizes_mb.split(",")]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tide-statesize-"))
    modes = tuple(m for m in args.modes.split(",") if m)
    # The launchers and their workers inherit this environment.
    if args.group_min_mb is not None:
        os.environ[GROUP_MIN_MB_ENV] = str(args.group_min_mb)
    if args.senders_max is not None:
        os.environ[SENDERS_MAX_ENV] = str(args.senders_max)
    transfer = TransferSettings.from_env()
    result = asyncio.run(run(args.quick, sizes, workdir, modes))
    result["transfer"] = asdict(transfer)
    if args.workdir:
        print(f"logs in {workdir}")
    else:
        # Gigabytes of checkpoints: a temporary workdir goes (--workdir keeps one).
        shutil.rmtree(workdir, ignore_errors=True)
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
