"""The pause and the lost steps of a resize, Tide's way (both resize modes) against Paddle's
way, on this machine.

Tide's way, once per resize mode (the coordinator's ``resize_mode``): ``plain`` forms the new
generation's group inside the pause; ``overlap`` forms it in standby workers before the
barrier, while the old generation trains (docs/resize-protocol.md, "Overlap mode"). Each: the
real coordinator and one launcher per "pod" (each with a warm zygote), the MLP of
tide/trainer/examples/train_mlp.py on gloo; resizes 2 -> 4 and 4 -> 2 through ``Resize`` (the
scaler's call). The pause is the time training stood still: the gap between rank 0's last step of the
old generation and its first step of the new one (from the loss log's wall times), less one
ordinary step of the new generation (the median interval between its later steps), since the
first new step does a step's work like any other. It is split by the coordinator into barrier,
checkpoint write, worker restart, group init and restore. The raw gap is reported too.

Paddle's way, in the same run: the job is killed and relaunched at the new size as fresh
processes (import Paddle, init, restore the last periodic checkpoint); it is killed half a
checkpoint period after a checkpoint, the expected loss of an unplanned kill.

The unavoidable part of a pause is what any checkpoint-based rescale must pay on this machine:
checkpoint write + checkpoint read (both measured in the resize itself) + gloo group init of the
new world size with already-imported processes that start together (measured here with
processes forked from a zygote; Paddle's import is not unavoidable, a warm parent hides it).

    python -m bench.rescale --quick     # one resize each way, < 2 min
    python -m bench.rescale             # three of each, medians

A planned resize reads nothing from disk: stayers restore from their pod's memory, newcomers
from a peer over the new group (tide/trainer/restore.py); ``disk_read_s`` (target 0) is the most any
rank of a new generation read from the durable store.

The last line is ``RESULT {json}`` with plain_pause_over_unavoidable and
overlap_pause_over_unavoidable (each mode's worse of 2 -> 4 and 4 -> 2; targets 1.5 and 0.35),
unavoidable_s (of the plain mode's worse resize), lost_steps (over both modes), pause_s_by_mode
(each mode's and direction's pause), pause_s and pause_over_unavoidable (the plain mode's, as
before), disk_read_s and transfer_s (worst over both modes), baseline_lost_steps and
baseline_pause_s (Paddle's way, worst), and per-resize details.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tide.services.testing.localjob import (
    EXAMPLE,
    ROOT,
    LocalJob,
    Pod,
    gloo_env,
    loss_records,
    read_jsonl,
)
from tide.services.testing.ports import free_port as _free_port
from tide.trainer.checkpoint import CheckpointStore
from tide.trainer.spawner import ZygoteSpawner
from tide.v1 import coordinator_pb2 as pb

CKPT_EVERY = 10
TRAIN = [
    "--dataset-size", "4000",
    "--global-batch", "128",
    "--hidden", "512",
    "--seed", "1",
    "--ckpt-every-steps", str(CKPT_EVERY),
    "--keep", "3",
    "--step-delay-s", "0.02",
]  # fmt: skip


@dataclass
class Measure:
    way: str
    resize: str
    pause_s: float
    lost_steps: int
    barrier_s: float = 0.0
    checkpoint_write_s: float = 0.0
    worker_restart_s: float = 0.0
    group_init_s: float = 0.0
    restore_s: float = 0.0
    # Parts of restore_s: from the pod's memory, from the durable store, from a peer.
    handover_s: float = 0.0
    disk_read_s: float = 0.0
    transfer_s: float = 0.0
    unavoidable_s: float = 0.0
    coordinator_pause_s: float = 0.0
    gap_s: float = 0.0
    step_s: float = 0.0


def _step_s(times: dict[tuple[int, int], float], gen: int) -> float:
    """Median interval between consecutive steps of ``gen`` after its first step."""
    steps = sorted(s for g, s in times if g == gen)[1:]
    gaps = [times[(gen, b)] - times[(gen, a)] for a, b in itertools.pairwise(steps) if b == a + 1]
    return statistics.median(gaps) if gaps else 0.0


def _times(log_dir: Path) -> dict[tuple[int, int], float]:
    return {(int(r["gen"]), int(r["step"])): float(r["t"]) for r in loss_records(log_dir)}


async def _wait_step(job: LocalJob, step: int, timeout_s: float = 120.0) -> None:
    await job.wait_status(lambda s: s.step >= step, timeout_s, f"step {step}")


MODES = ("plain", "overlap")


async def tide_way(
    workdir: Path,
    reps: int,
    group_init: dict[int, float],
    mode: str = "plain",
    train: list[str] = TRAIN,
    example: str = EXAMPLE,
    steps: int = 0,
    settle: bool = False,
) -> list[Measure]:
    """``train`` and ``example``: the training script and its flags (bench/statesize.py's);
    ``steps``: the job's budget (0: enough for ``reps`` at this script's pace); ``settle``:
    each resize waits until every pod's standby worker has built its model and waits for a
    rendezvous (on two cores, new pods building a large model beside the hold took most of
    the CPU the old workers' handover needed; on a cluster they have their own)."""
    # Enough budget that the job never ends inside a barrier; it is stopped after the last resize.
    steps = steps or 100 + reps * 300
    job = LocalJob(
        workdir,
        [*train, "--steps", str(steps)],
        example=example,
        # A long sync timeout: a coordinator starved of CPU by 6 processes on 2 cores must
        # not declare members lost (it happened with 4 s).
        heartbeat_timeout_s=15.0,
        heartbeat_interval_s=0.5,
        checkpoint_lead_s=1.5,
        resize_mode=mode,
    )
    job.start_coordinator()
    out: list[Measure] = []
    try:
        for i in range(2):
            job.add_pod(i)
        await job.wait_standby(2)
        await job.resize(2)
        step = 20
        for rep in range(reps):
            for target in (4, 2):
                await _wait_step(job, step)
                if target == 4:
                    for i in (2 + 2 * rep, 3 + 2 * rep):
                        job.add_pod(10 + i)
                    await job.wait_standby(2)
                if settle:
                    await _standby_settled(job)
                updates = await job.resize(target)
                final = updates[-1]
                if final.phase != pb.RESIZE_PHASE_COMPLETED:
                    raise RuntimeError(f"resize to {target} ended {final}")
                gen = final.generation

                def in_new_generation(s: pb.JobStatus, g: int = gen) -> bool:
                    return s.generation == g and s.step > 0

                await job.wait_status(in_new_generation, 60, "new generation")
                times = _times(job.log_dir)
                # The old generation's last step, normally the coordinated checkpoint.
                ckpt = max(s for g, s in times if g == gen - 1)
                await _wait_step(job, ckpt + 8)
                times = _times(job.log_dir)
                restored = min(s for g, s in times if g == gen) - 1
                gap = times[(gen, restored + 1)] - times[(gen - 1, ckpt)]
                step_s = _step_s(times, gen)
                pause = gap - step_s
                m = _breakdown(job.log_dir, gen, ckpt, mode)
                m.resize = f"{4 if target == 2 else 2}->{target}"
                m.pause_s = pause
                m.gap_s = gap
                m.step_s = step_s
                m.lost_steps = max(int(final.lost_steps), ckpt - restored)
                m.unavoidable_s = m.checkpoint_write_s + m.restore_s + group_init[target]
                m.coordinator_pause_s = final.pause_s
                out.append(m)
                step = ckpt + 30
        for pod in job.pods:
            if pod.proc.poll() is None:
                pod.proc.terminate()
    finally:
        await job.close()
    return out


async def _standby_settled(job: LocalJob, timeout_s: float = 300.0) -> None:
    """Until the newest standby worker of every live pod logged that it waits for a
    rendezvous (its model built and warmed)."""

    def settled(pod: Pod) -> bool:
        logs = sorted(
            pod.state_dir.glob("worker-standby-*.log"), key=lambda p: int(p.stem.rsplit("-", 1)[1])
        )
        return bool(logs) and "waiting for a rendezvous" in logs[-1].read_text(errors="replace")

    async with asyncio.timeout(timeout_s):
        while True:
            if all(settled(p) for p in job.pods if p.proc.poll() is None):
                return
            await asyncio.sleep(0.1)


def _breakdown(log_dir: Path, gen: int, ckpt: int, mode: str) -> Measure:
    """Where the pause into generation ``gen`` went, from the workers' timings.jsonl."""
    events = read_jsonl(log_dir / "timings.jsonl")
    held = [e for e in events if e["event"] == "held" and e["gen"] == gen - 1 and e["step"] == ckpt]
    first = [e for e in events if e["event"] == "first_step" and e["gen"] == gen]
    rendezvous_at = min(e["restart_started_at"] for e in first)
    # No hold means no barrier happened (the old generation was lost, not resized).
    held_at = max((e["held_at"] for e in held), default=rendezvous_at)
    write_s = max(((e["checkpoint"] or {}).get("write_s", 0.0) for e in held), default=0.0)
    return Measure(
        way=mode,
        resize="",
        pause_s=0.0,
        lost_steps=0,
        barrier_s=max(0.0, rendezvous_at - held_at - write_s),
        checkpoint_write_s=write_s,
        worker_restart_s=max(e["worker_restart_s"] for e in first),
        group_init_s=max(e["group_init_s"] for e in first),
        restore_s=max(e["restore_s"] for e in first),
        handover_s=max(e.get("handover_s", 0.0) for e in first),
        disk_read_s=max(e.get("disk_read_s", 0.0) for e in first),
        transfer_s=max(e.get("transfer_s", 0.0) for e in first),
    )


def _fixed_env(world: int, tag: str) -> list[dict[str, str]]:
    ports = [_free_port() for _ in range(world)]
    return [
        {
            **os.environ,
            **gloo_env(rank, ports),
            "TIDE_GENERATION": tag,
        }
        for rank in range(world)
    ]


def _train_argv(workdir: Path, extra: list[str], example: str = EXAMPLE) -> list[str]:
    return [
        sys.executable,
        example,
        "--ckpt-dir",
        str(workdir / "ckpt"),
        "--log-dir",
        str(workdir / "logs"),
        *extra,
    ]


async def paddle_way(
    workdir: Path,
    old: int,
    new: int,
    zygote: ZygoteSpawner,
    train: list[str] = TRAIN,
    example: str = EXAMPLE,
    ckpt_every: int = CKPT_EVERY,
) -> Measure:
    """Kill every process half a checkpoint period after a checkpoint; relaunch fresh.

    The killed job is forked from a zygote only to start it quickly: how it started does not
    matter. The relaunch is what is measured, with fresh processes as Paddle does it."""
    workdir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - before any timing
    argv = _train_argv(workdir, [*train, "--steps", "100000"], example)
    workers = [
        await zygote.spawn(argv, env, str(ROOT), str(workdir / f"old-rank{rank}.log"))
        for rank, env in enumerate(_fixed_env(old, "1"))
    ]
    kill_after = 2 * ckpt_every + ckpt_every // 2
    try:
        async with asyncio.timeout(300):
            while True:
                recs = loss_records(workdir / "logs")
                # The checkpoint before the kill must be committed: a large state's write
                # (a background thread) can still be under way at the kill step.
                committed = CheckpointStore(workdir / "ckpt").list_steps()
                if (
                    recs
                    and int(recs[-1]["step"]) >= kill_after
                    and committed
                    and committed[-1] >= kill_after - kill_after % ckpt_every
                ):
                    break
                await asyncio.sleep(0.005)
    finally:
        for w in workers:
            w.kill(signal.SIGKILL)
        for w in workers:
            await w.wait()
    last = loss_records(workdir / "logs")[-1]
    reached = int(last["step"])
    argv = _train_argv(workdir, [*train, "--steps", str(reached + 3)], example)
    procs = []
    for rank, env in enumerate(_fixed_env(new, "2")):
        log = open(workdir / f"new-rank{rank}.log", "ab")  # noqa: SIM115, ASYNC230
        procs.append(
            await asyncio.create_subprocess_exec(*argv, cwd=ROOT, env=env, stdout=log, stderr=log)
        )
        log.close()
    async with asyncio.timeout(180):
        codes = [await p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"relaunch failed with {codes}; see {workdir}")
    recs = [r for r in loss_records(workdir / "logs") if int(r["gen"]) == 2]
    first = recs[0]
    gap = float(first["t"]) - float(last["t"])
    step_s = _step_s(_times(workdir / "logs"), 2)
    return Measure(
        way="paddle",
        resize=f"{old}->{new}",
        pause_s=gap - step_s,
        lost_steps=reached - (int(first["step"]) - 1),
        gap_s=gap,
        step_s=step_s,
    )


_PROBE = """
import os, socket, sys, time
import paddle.distributed as dist
start_at = float(os.environ["PROBE_START_AT"])
time.sleep(max(0.0, start_at - time.time()))
t = time.monotonic()
if os.environ["PADDLE_TRAINER_ID"] != "0":
    host, port = os.environ["PADDLE_MASTER"].rsplit(":", 1)
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            break
        except OSError:
            time.sleep(0.005)
dist.init_parallel_env()
elapsed = time.monotonic() - t
# Leave together: a rank that exits while others still connect their pairs times them out.
import paddle
dist.all_reduce(paddle.ones([1]))
with open(os.environ["PROBE_OUT"], "a") as f:
    f.write(f"{elapsed}\\n")
"""


async def pure_group_init(workdir: Path, world: int, reps: int) -> float:
    """Group init of ``world`` already-imported processes started together (max over ranks)."""
    workdir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, before any timing
    script = workdir / "probe.py"
    script.write_text(_PROBE)
    zygote = ZygoteSpawner()
    results = []
    try:
        await zygote.wait_ready()
        for rep in range(reps):
            out = workdir / f"init-{world}-{rep}.txt"
            ports = [_free_port() for _ in range(world)]
            start_at = time.time() + 0.3
            workers = []
            for rank in range(world):
                env = {
                    **os.environ,
                    **gloo_env(rank, ports),
                    "PROBE_START_AT": repr(start_at),
                    "PROBE_OUT": str(out),
                }
                log = str(workdir / f"init-{world}-{rep}-{rank}.log")
                workers.append(
                    await zygote.spawn([sys.executable, str(script)], env, str(ROOT), log)
                )
            try:
                async with asyncio.timeout(60):
                    codes = [await w.wait() for w in workers]
            finally:
                for w in workers:
                    w.kill()
            if any(codes):
                raise RuntimeError(f"group init probe failed: {codes}")
            results.append(max(float(x) for x in out.read_text().split()))
    finally:
        await zygote.close()
    return statistics.median(results)


def _median(ms: list[Measure], way: str, resize: str) -> Measure:
    sel = [m for m in ms if m.way == way and m.resize == resize]
    fields = {}
    for k, v in asdict(sel[0]).items():
        fields[k] = statistics.median(getattr(m, k) for m in sel) if isinstance(v, float) else v
    fields["lost_steps"] = max(m.lost_steps for m in sel)
    return Measure(**fields)


def tide_rows(rows: list[Measure], mode: str = "") -> list[Measure]:
    """Tide's rows: of one resize mode, or of both."""
    return [m for m in rows if m.way == mode or (not mode and m.way in MODES)]


def _ratio(m: Measure) -> float:
    return m.pause_s / m.unavoidable_s if m.unavoidable_s else float("nan")


async def run(quick: bool, workdir: Path) -> dict[str, Any]:
    reps = 1 if quick else 3
    t0 = time.monotonic()
    group_init = {w: await pure_group_init(workdir / "probe", w, 1 if quick else 3) for w in (2, 4)}
    measures: list[Measure] = []
    for mode in MODES:
        measures += await tide_way(workdir / f"tide-{mode}", reps, group_init, mode)
    zygote = ZygoteSpawner()
    try:
        for rep in range(reps):
            measures.append(await paddle_way(workdir / f"paddle-up-{rep}", 2, 4, zygote))
            measures.append(await paddle_way(workdir / f"paddle-down-{rep}", 4, 2, zygote))
    finally:
        await zygote.close()
    ways = (*MODES, "paddle")
    rows = [_median(measures, way, r) for way in ways for r in ("2->4", "4->2")]
    print(
        f"{'way':8}{'resize':8}{'gap':>7}{'step':>7}{'pause':>8}{'lost':>6}{'barrier':>9}"
        f"{'write':>8}{'restart':>9}{'init':>7}{'restore':>9}{'unavoid.':>10}{'ratio':>7}"
    )
    for m in rows:
        ratio = _ratio(m)
        print(
            f"{m.way:8}{m.resize:8}{m.gap_s:7.3f}{m.step_s:7.3f}{m.pause_s:8.3f}{m.lost_steps:6d}"
            f"{m.barrier_s:9.3f}"
            f"{m.checkpoint_write_s:8.3f}{m.worker_restart_s:9.3f}{m.group_init_s:7.3f}"
            f"{m.restore_s:9.3f}{m.unavoidable_s:10.3f}{ratio:7.2f}"
        )
    for m in tide_rows(rows):
        print(
            f"{m.way} {m.resize}: restore from memory {m.handover_s:.4f}s, "
            f"from a peer {m.transfer_s:.4f}s, from disk {m.disk_read_s:.4f}s"
        )
    print(f"pure gloo group init (pre-imported, started together): {group_init}")
    print("pause = gap between the last old and the first new step, less one ordinary step")
    tide = tide_rows(rows)
    paddle = [m for m in rows if m.way == "paddle"]
    worst = {mode: max(tide_rows(rows, mode), key=_ratio) for mode in MODES}
    plain = worst["plain"]
    result = {
        "plain_pause_over_unavoidable": round(_ratio(plain), 2),
        "overlap_pause_over_unavoidable": round(_ratio(worst["overlap"]), 2),
        "pause_s_by_mode": {
            mode: {m.resize: round(m.pause_s, 3) for m in tide_rows(rows, mode)} for mode in MODES
        },
        "unavoidable_s_by_resize": {
            m.resize: round(m.unavoidable_s, 3) for m in tide_rows(rows, "plain")
        },
        "pause_s": round(plain.pause_s, 3),
        "unavoidable_s": round(plain.unavoidable_s, 3),
        "pause_over_unavoidable": round(_ratio(plain), 2),
        "worst_resize": {mode: m.resize for mode, m in worst.items()},
        "lost_steps": max(m.lost_steps for m in tide),
        # Read from disk in a planned resize's pause (the slowest rank; target 0).
        "disk_read_s": round(max(m.disk_read_s for m in tide), 4),
        "transfer_s": round(max(m.transfer_s for m in tide), 4),
        "baseline_lost_steps": max(m.lost_steps for m in paddle),
        "baseline_pause_s": round(max(m.pause_s for m in paddle), 3),
        "baseline_pause_ratio": round(
            max(m.pause_s for m in paddle) / max(m.pause_s for m in tide_rows(rows, "plain")), 2
        ),
        "group_init_s": group_init,
        "resizes": [asdict(m) for m in rows],
        "reps": reps,
        "elapsed_s": round(time.monotonic() - t0, 1),
    }
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one resize each way (< 2 min)")
    p.add_argument("--workdir", default="", help="keep logs here (default: a temp dir)")
    args = p.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tide-rescale-"))
    result = asyncio.run(run(args.quick, workdir))
    print(f"logs in {workdir}")
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
