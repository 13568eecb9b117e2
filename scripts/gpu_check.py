"""The trainer's GPU paths on a real GPU, in one short run (a few minutes on one H200).

Needs a machine with an NVIDIA GPU, its driver, and ``paddlepaddle-gpu`` in place of
``paddlepaddle`` (``pip install paddlepaddle-gpu``; the code path is the same):

    python scripts/gpu_check.py [--workdir DIR]

It checks, in order, and stops at the first failure (each check's outcome is in the result):

1. ``nvml``: real NVML readings through the agent's own source
   (tide.services.agent.nvml.NvmlSource): utilization, memory, power, temperature, health,
   and on GPUs with NVML GPM (Hopper and later) SM, occupancy, tensor and DRAM activity:
   every GPU that reports GPM support must carry all four, in 0..100, from its second
   sample on (``gpm_supported`` lists them; a GPU without GPM carries none).
2. ``devices``: the launcher's view of the pod (tide/trainer/devices.py): backend nccl, one
   worker per visible GPU.
3. ``launcher_nccl``: the BatchNorm CNN (tide/trainer/examples/train_bn.py) under the real
   coordinator and launcher with ``--backend nccl`` at world size 1: the worker is pinned
   (CUDA_VISIBLE_DEVICES, FLAGS_selected_gpus) and trains on gpu:0 to the end of its budget.
4. ``restore_parity``: the same script run 0 -> N/2, restored from its checkpoint, then
   N/2 -> N, against one straight run, on the GPU: relative difference of every step's loss
   and of the final parameters and buffers.
5. ``amp``: ``paddle.amp`` with a ``GradScaler`` on the GPU (enabled only there): losses
   finite, the scaler's state in the checkpoint, and restore parity as in 4.
6. ``mp_layout`` (2 GPUs or more; skipped, and said so, with fewer): plain fleet processes
   (Paddle's launcher, NCCL) with ``mp_degree`` 2 and as many data-parallel replicas as
   the GPUs hold whole (1 at 2-3 GPUs, 2 at 4 or more), a tensor-parallel MLP
   (``ColumnParallelLinear`` then ``RowParallelLinear``) trained a few AdamW steps. It checks
   tide/trainer/layout.py against fleet's own groups: every rank's (dp, mp) coordinates and the
   data-parallel groups; and, with 2 replicas, the premise of the resize transfer: the
   slice (parameters and Adam moments) each rank holds equals the slice of the rank
   ``plan_transfer`` names as its source in a resize 2 -> 4 (a newcomer at mp rank k gets
   the stayer's at mp rank k). Not run yet: no machine with 2 GPUs has been lent to this
   work (issue 26); ``--mp-dry-run`` runs the same program on the CPU with mp 1 (gloo),
   which checks the plumbing only.
7. ``mp_elastic`` (2 GPUs or more; the restart part 4): the session's path for such a job
   (tide/trainer/examples/train_tensor_parallel.py ``--tensor-parallel=fleet``, mp_degree 2
   from the strategy): a fixed 1-replica run; 2 replicas to half the budget, then 1 replica on
   from the per-slice durable stores, within 1e-5 of it on every parameter slice and
   optimizer slot; and fleet's run within 1e-4 of the same model by hand on the CPU. Not run
   yet either (no GPU lent); ``--mp-dry-run`` runs it by hand over gloo on the CPU (the
   layout, the per-slice stores and the parity; not fleet's layers).
8. ``pp_elastic`` (2 GPUs or more; the restart part 4): the same for a pipeline by hand
   (tide/trainer/examples/train_pipeline_parallel.py, pp_degree 2 in
   ``SessionConfig.model_parallel``, activations and gradients broadcast between the stages
   over NCCL): a fixed 1-replica run, the 4 -> 2 restart from the per-stage stores, and the
   GPU run within 1e-4 of the same on the CPU. Not run yet (no GPU lent); ``--mp-dry-run``
   runs it over gloo on the CPU.

The last line is ``RESULT {json}``; the exit code is 0 when every check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

BN = str(ROOT / "tide" / "trainer" / "examples" / "train_bn.py")
STEPS = 40
TRAIN = [
    "--dataset-size", "512",
    "--global-batch", "64",
    "--width", "32",
    "--seed", "11",
    "--virtual-ranks", "2",
    "--ckpt-every-steps", "10",
]  # fmt: skip


def check_nvml() -> dict[str, Any]:
    from tide.services.agent.nvml import NvmlSource

    source = NvmlSource()
    count = source.open()
    try:
        readings = []
        for _ in range(3):
            readings = source.sample()
            # Longer than NVML's minimum GPM period (tide/services/agent/gpm.py).
            time.sleep(0.5)
        supported = source.gpm.supported
    finally:
        source.close()
    gpus = [
        {
            "index": r.index,
            "uuid": r.uuid,
            "utilization_pct": r.utilization_pct,
            "memory_used_bytes": r.memory_used_bytes,
            "memory_total_bytes": r.memory_total_bytes,
            "power_w": r.power_w,
            "temperature_c": r.temperature_c,
            "health": r.health.name,
            "gpm": dataclasses.asdict(r.gpm) if r.gpm is not None else None,
        }
        for r in readings
    ]
    ok = count > 0 and all(r.memory_total_bytes > 0 and r.health.name == "OK" for r in readings)
    gpm_ok = all(
        (r.gpm is not None) == (r.index in supported)
        and (r.gpm is None or all(0.0 <= v <= 100.0 for v in dataclasses.astuple(r.gpm)))
        for r in readings
    )
    return {"ok": ok and gpm_ok, "gpm_ok": gpm_ok, "gpm_supported": supported, "gpus": gpus}


def check_devices() -> dict[str, Any]:
    from tide.trainer.devices import Backend, detect

    pod = detect()
    return {
        "ok": pod.backend is Backend.NCCL and len(pod.gpus) > 0 and pod.workers == len(pod.gpus),
        "backend": pod.backend.value,
        "gpus": list(pod.gpus),
        "workers": pod.workers,
    }


async def check_launcher(workdir: Path) -> dict[str, Any]:
    from tide.services.testing.localjob import LocalJob, loss_records, read_jsonl
    from tide.v1 import coordinator_pb2 as pb

    job = LocalJob(
        workdir,
        [*TRAIN, "--steps", str(STEPS)],
        heartbeat_timeout_s=20.0,
        example=BN,
        launcher_args=["--backend", "nccl"],
    )
    job.start_coordinator()
    try:
        job.add_pod(0)
        await job.wait_standby(1, timeout_s=180)
        started = time.monotonic()
        final = (await job.resize(1, deadline_s=180, timeout_s=300))[-1]
        codes = await job.wait_pods_exit(300)
        wall = time.monotonic() - started
    finally:
        await job.close()
    firsts = [r for r in read_jsonl(job.log_dir / "timings.jsonl") if r["event"] == "first_step"]
    losses = [float(r["loss"]) for r in loss_records(job.log_dir)]
    return {
        "ok": final.phase == pb.RESIZE_PHASE_COMPLETED
        and codes == [0]
        and len(losses) == STEPS
        and all(r.get("device", "").startswith("gpu") for r in firsts),
        "phase": pb.ResizePhase.Name(final.phase),
        "exit_codes": codes,
        "steps": len(losses),
        "devices": sorted({r.get("device", "") for r in firsts}),
        "steps_per_s": round(len(losses) / wall, 2) if wall else 0.0,
    }


def check_restore(workdir: Path, extra: list[str]) -> dict[str, Any]:
    from tide.services.testing.localjob import reference_run
    from tide.services.testing.parity import final_losses, max_rel_loss_diff, max_rel_param_diff

    args = [*TRAIN, *extra]
    straight = reference_run(workdir / "straight", [*args, "--steps", str(STEPS)], 1, example=BN)
    reference_run(workdir / "resumed", [*args, "--steps", str(STEPS // 2)], 1, example=BN)
    resumed = reference_run(workdir / "resumed", [*args, "--steps", str(STEPS)], 1, example=BN)
    losses = final_losses(resumed)
    loss_diff = max_rel_loss_diff(losses, final_losses(straight))
    param_diff = max_rel_param_diff(resumed / "final_params.npz", straight / "final_params.npz")
    ckpts = sorted((workdir / "resumed" / "ckpt").glob("step-*"))
    files = sorted(p.name for p in ckpts[-1].iterdir()) if ckpts else []
    return {
        "ok": max(loss_diff, param_diff) <= 1e-5 and all(map(_finite, losses.values())),
        "loss_rel_diff": float(f"{loss_diff:.3g}"),
        "param_rel_diff": float(f"{param_diff:.3g}"),
        "checkpoint_files": files,
    }


# One rank of the mp_layout check; argv: mp degree, output folder.
_MP_RANK = """
import json, sys
import numpy as np
import paddle
import paddle.distributed as dist
from paddle.distributed import fleet
mp, out = int(sys.argv[1]), sys.argv[2]
dist.init_parallel_env()
world = dist.get_world_size()
strategy = fleet.DistributedStrategy()
strategy.hybrid_configs = {"dp_degree": world // mp, "mp_degree": mp, "pp_degree": 1}
fleet.init(is_collective=True, strategy=strategy)
hcg = fleet.get_hybrid_communicate_group()
paddle.seed(7)
mpu = fleet.meta_parallel
if mp > 1:
    net = paddle.nn.Sequential(
        mpu.ColumnParallelLinear(16, 32, has_bias=True, gather_output=False),
        mpu.RowParallelLinear(32, 4, has_bias=True, input_is_parallel=True),
    )
else:
    net = paddle.nn.Sequential(paddle.nn.Linear(16, 32), paddle.nn.Linear(32, 4))
opt = paddle.optimizer.AdamW(parameters=net.parameters())
model, opt = fleet.distributed_model(net), fleet.distributed_optimizer(opt)
dp_rank = hcg.get_data_parallel_rank()
for step in range(5):
    x = np.random.default_rng(step * 100 + dp_rank).random((8, 16), dtype=np.float32)
    loss = model(paddle.to_tensor(x)).square().mean()
    loss.backward()
    opt.step()
    opt.clear_grad()
# This rank's slice by position (names are per-process counters).
params = [p.numpy() for p in net.parameters()]
state = opt.state_dict()
moments = [state[k].numpy() for k in sorted(state) if "moment" in k]
digest = [float(np.abs(a).sum()) for a in params + moments]
json.dump({
    "rank": dist.get_rank(),
    "dp": dp_rank,
    "mp": hcg.get_model_parallel_rank(),
    "dp_group": sorted(hcg.get_data_parallel_group().ranks),
    "digest": digest,
}, open(f"{out}/rank{dist.get_rank()}.json", "w"))
"""


def check_mp_layout(workdir: Path, dry_run: bool = False) -> dict[str, Any]:
    import subprocess

    from tide.trainer.layout import (
        ModelParallel,
        coordinates,
        dp_groups,
        plan_transfer,
        stayers_by_replica,
    )

    backend: list[str] = []
    if dry_run:
        mp, n = 1, 2
    else:
        import paddle

        gpus = paddle.device.cuda.device_count()
        if gpus < 2:
            return {"ok": True, "skipped": f"needs 2 GPUs, this machine has {gpus}"}
        mp, n = 2, 4 if gpus >= 4 else 2
        backend = ["--gpus", ",".join(map(str, range(n)))]
    workdir.mkdir(parents=True, exist_ok=True)
    program = workdir / "mp_rank.py"
    program.write_text(_MP_RANK)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}"}
    cmd = [str(program), str(mp), str(workdir)]
    if dry_run:
        # Paddle's launcher wants devices; on the CPU the ranks start the plain way (gloo).
        from tide.services.testing.localjob import gloo_env
        from tide.services.testing.ports import free_port

        ports = [free_port() for _ in range(n)]
        procs = [
            subprocess.Popen(
                [sys.executable, *cmd],
                env={**env, **gloo_env(r, ports)},
                stdout=subprocess.DEVNULL,
                stderr=open(workdir / f"rank{r}.log", "w"),  # noqa: SIM115
            )
            for r in range(n)
        ]
        codes = [p.wait(timeout=300) for p in procs]
        if any(codes):
            return {"ok": False, "error": f"ranks exited {codes}", "logs": str(workdir)}
    else:
        done = subprocess.run(
            [sys.executable, "-m", "paddle.distributed.launch", "--log_dir",
             str(workdir / "log"), *backend, *cmd],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if done.returncode:
            return {"ok": False, "error": done.stderr[-2000:], "logs": str(workdir / "log")}
    ranks = [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(n)]
    model = ModelParallel(mp_degree=mp)
    coords = coordinates(n, model)
    coords_ok = all((c.dp, c.mp) == (r["dp"], r["mp"]) for c, r in zip(coords, ranks, strict=True))
    groups_ok = all(r["dp_group"] in dp_groups(n, model) for r in ranks)
    outcome: dict[str, Any] = {"world": n, "mp_degree": mp, "coords_ok": coords_ok}
    outcome["dp_groups_ok"] = groups_ok
    transfer_ok = True
    if n // mp >= 2:
        # The resize 1 replica -> 2 by the plan: every newcomer's source holds its slice.
        plan = plan_transfer(mp, 2 * mp, model, stayers_by_replica(mp, 2 * mp, model))
        transfer_ok = all(
            np.allclose(ranks[m.source]["digest"], ranks[m.to]["digest"], rtol=1e-5)
            for m in plan.moves
        )
        outcome["transfer_sources"] = {m.to: m.source for m in plan.moves}
    outcome["transfer_ok"] = transfer_ok
    outcome["ok"] = coords_ok and groups_ok and transfer_ok
    return outcome


TP = str(ROOT / "tide" / "trainer" / "examples" / "train_tensor_parallel.py")
PP = str(ROOT / "tide" / "trainer" / "examples" / "train_pipeline_parallel.py")
SPLIT_STEPS = 12
SPLIT_TRAIN = [
    "--dataset-size", "96",
    "--global-batch", "16",
    "--seed", "5",
    "--hidden", "16",
    "--ckpt-every-steps", "3",
]  # fmt: skip


def _run_split(
    workdir: Path, world: int, steps: int, mode: str, gpus: bool, example: str = TP
) -> Path:
    """train_tensor_parallel.py at mp 2 in ``mode`` (``example`` PP: train_pipeline_parallel.py
    at pp 2, by hand) on ``world`` ranks for ``steps`` (its checkpoints in ``workdir``/ckpt,
    one store per slice, so a second call restarts from them): through Paddle's launcher on
    GPUs, else the plain way on the CPU (gloo)."""
    from tide.services.testing.localjob import reference_run

    args = [*SPLIT_TRAIN, "--steps", str(steps)]
    if example == TP:
        args.append(f"--tensor-parallel={mode}")
    if not gpus:
        # paddlepaddle-gpu puts tensors on the GPU by default: gloo needs them on the CPU.
        os.environ["CUDA_VISIBLE_DEVICES"], saved = "", os.environ.get("CUDA_VISIBLE_DEVICES")
        try:
            return reference_run(workdir, args, world, timeout_s=300, example=example)
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES")
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "paddle.distributed.launch", "--log_dir",
         str(workdir / f"launch-w{world}-s{steps}"), "--gpus", ",".join(map(str, range(world))),
         example, "--ckpt-dir", str(workdir / "ckpt"), "--log-dir", str(workdir / "logs"), *args],
        env={**os.environ, "PYTHONPATH": f"{ROOT}"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"{Path(example).name} at world {world} failed: {done.stderr[-2000:]}")
    return workdir / "logs"


def restarted_steps(log_dir: Path, world: int) -> list[int] | None:
    """The steps every rank of the run at ``world`` ranks took (from the step logs, which
    every run appends to), or None when its ranks disagree."""
    from tide.services.testing.localjob import read_jsonl

    by_rank = [
        [int(r["step"]) for r in read_jsonl(path) if int(r["world"]) == world]
        for path in sorted(log_dir.glob("samples-rank*-g0.jsonl"))
    ]
    mine = [steps for steps in by_rank if steps]
    if len(mine) != world or any(steps != mine[0] for steps in mine):
        return None
    return mine[0]


def check_mp_elastic(workdir: Path, dry_run: bool = False, example: str = TP) -> dict[str, Any]:
    """The session's path for a tensor-parallel job (mp_degree 2, elastic by replicas):
    through fleet on GPUs (``--tensor-parallel=fleet``: fleet's ColumnParallelLinear and
    RowParallelLinear, the degree from the strategy), by hand over gloo in the dry run.
    A fixed 1-replica run; with 4 GPUs (or in the dry run) 2 replicas to half the budget
    then 1 replica on from the per-slice durable stores, which must match it within 1e-5 on
    every parameter slice and optimizer slot; on GPUs also fleet's run against the same
    model by hand on the CPU (``fleet_vs_hand_rel_diff``, within 1e-4: other devices add in
    another order). ``example`` PP: the same for a pipeline by hand (pp_degree 2), by hand
    on the GPUs too. The resize in memory under the launchers is the CPU test's
    (tests/trainer/test_tensor_parallel_resize.py)."""
    from tide.services.testing.parity import max_rel_slice_diff

    gpus = 0
    if not dry_run:
        import paddle

        gpus = paddle.device.cuda.device_count()
        if gpus < 2:
            return {"ok": True, "skipped": f"needs 2 GPUs, this machine has {gpus}"}
    mode = "hand" if dry_run or example == PP else "fleet"
    on_gpus = not dry_run

    def run(name: str, world: int, steps: int, mode: str, gpus: bool) -> Path:
        return _run_split(workdir / name, world, steps, mode, gpus, example)

    fixed = run("fixed", 2, SPLIT_STEPS, mode, on_gpus)
    outcome: dict[str, Any] = {"mode": mode, "gpus": gpus}
    ok = True
    if dry_run or gpus >= 4:
        run("restarted", 4, SPLIT_STEPS // 2, mode, on_gpus)
        restarted = run("restarted", 2, SPLIT_STEPS, mode, on_gpus)
        diff = max_rel_slice_diff(restarted, fixed)
        outcome["restart_4_2_rel_diff"] = diff
        # The trajectory does not depend on the world size: a second run from scratch would
        # match the fixed one too. Its steps say it resumed.
        resumed = restarted_steps(restarted, 2) == list(
            range(SPLIT_STEPS // 2 + 1, SPLIT_STEPS + 1)
        )
        outcome["restart_4_2_resumed"] = resumed
        ok = ok and diff <= 1e-5 and resumed
    else:
        outcome["restart_4_2"] = f"needs 4 GPUs, this machine has {gpus}"
    if on_gpus:
        hand = run("hand", 2, SPLIT_STEPS, "hand", False)
        diff = max_rel_slice_diff(fixed, hand)
        outcome["fleet_vs_hand_rel_diff" if example == TP else "gpu_vs_cpu_rel_diff"] = diff
        ok = ok and diff <= 1e-4
    outcome["ok"] = ok
    return outcome


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--workdir", default="", help="keep the runs here (default: a temp dir)")
    p.add_argument(
        "--mp-dry-run",
        action="store_true",
        help="run only the mp_layout, mp_elastic and pp_elastic checks' plumbing on the CPU",
    )
    args = p.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tide-gpu-check-"))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    # cuDNN picks kernels that add in a varying order otherwise: parity needs the same one.
    os.environ.setdefault("FLAGS_cudnn_deterministic", "1")
    result: dict[str, Any] = {"workdir": str(workdir)}
    started = time.monotonic()
    if args.mp_dry_run:
        outcome = check_mp_layout(workdir / "mp_layout", dry_run=True)
        elastic = check_mp_elastic(workdir / "mp_elastic", dry_run=True)
        pipeline = check_mp_elastic(workdir / "pp_elastic", dry_run=True, example=PP)
        ok = outcome["ok"] and elastic["ok"] and pipeline["ok"]
        dry = {"mp_layout": outcome, "mp_elastic": elastic, "pp_elastic": pipeline, "ok": ok}
        print("RESULT " + json.dumps(dry))
        return 0 if ok else 1
    checks = [
        ("nvml", check_nvml),
        ("devices", check_devices),
        ("launcher_nccl", lambda: asyncio.run(check_launcher(workdir / "launcher"))),
        ("restore_parity", lambda: check_restore(workdir / "restore", [])),
        ("amp", lambda: check_restore(workdir / "amp", ["--amp"])),
        ("mp_layout", lambda: check_mp_layout(workdir / "mp_layout")),
        ("mp_elastic", lambda: check_mp_elastic(workdir / "mp_elastic")),
        ("pp_elastic", lambda: check_mp_elastic(workdir / "pp_elastic", example=PP)),
    ]
    for name, check in checks:
        t0 = time.monotonic()
        try:
            outcome = check()
        except Exception as exc:
            outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        outcome["s"] = round(time.monotonic() - t0, 1)
        result[name] = outcome
        print(f"{name}: {json.dumps(outcome)}", flush=True)
        if not outcome["ok"]:
            break
    if "amp" in result and result["amp"]["ok"]:
        result["amp"]["ok"] = "scaler.pdstate" in result["amp"].get("checkpoint_files", [])
    result["ok"] = all(result.get(n, {}).get("ok") for n, _ in checks)
    result["wall_s"] = round(time.monotonic() - started, 1)
    print("RESULT " + json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
