"""A node's termination notice, Tide's way against Paddle's way, on this machine.

Both ways run the same job: the MLP of tide/trainer/examples/train_mlp.py on gloo, 3 pods
(one launcher each), periodic checkpoints every 10 steps. Once it trains, the node of
pod 1 (not the highest index) gets a spot interruption notice with ``--deadline-s``.

Tide's way: the scaler (in this process: tide.services.testing.preempt) sees the notice as an
agent's report, decides NODE_TERMINATION naming pod 1, the coordinator drains exactly
that member after a coordinated checkpoint, and the local actuator removes exactly that
pod. ``notice_to_released_s`` is from the notice to pod 1's process being gone.

Tide's way through the Kubernetes actuator (same run, keys prefixed ``kube_``): the
same, but the pods are a paddle-operator PaddleJob's on the API server emulator, run
by the stand-in kubelet (tide.services.testing.preempt.kube_preempt_rig); the actuator
deletes pod 1 by uid and keeps the replicas, and the operator recreates it as a spare.

Paddle's way (the baseline, same run): nothing reacts to the notice; at the deadline the
node takes the pod (SIGKILL of its launcher and workers), and the job restarts from its
last periodic checkpoint with the pods left. Its pod is released at the deadline.

For both: ``lost_steps`` (steps trained and thrown away), ``exactly_once`` (1 when every
step ran once in all and every epoch used every sample once, 0 otherwise), and
``wrong_pods_stopped`` (pods other than pod 1 whose process was stopped).

    python -m bench.preemption --quick     # one run each way, about 3 min

The last line is ``RESULT {json}`` with lost_steps, exactly_once, wrong_pods_stopped,
notice_to_released_s and the same keys prefixed ``kube_`` and ``baseline_``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tide.services.scaler.store import DecisionState
from tide.services.testing.localjob import LocalJob, sample_records
from tide.services.testing.preempt import KUBE_NAME, KUBE_NS, kube_preempt_rig, notice, preempt_rig

JOB = "ns/bench"
DATASET, BATCH = 600, 60
STEP_DELAY_S = 0.05
TRAIN = [
    "--dataset-size", str(DATASET),
    "--global-batch", str(BATCH),
    "--hidden", "16",
    "--seed", "7",
    "--ckpt-every-steps", "10",
    "--keep", "4",
    "--step-delay-s", str(STEP_DELAY_S),
]  # fmt: skip
#: The notice comes mid-period (checkpoints every 10 steps): the expected cost of a kill.
NOTICE_AT_STEP = 25


def budget(deadline_s: float) -> int:
    """Steps enough that the baseline still trains when its node goes at the deadline."""
    return NOTICE_AT_STEP + int(deadline_s / STEP_DELAY_S) + 60


def exactly_once(log_dir: Path, steps: int) -> int:
    """1 when each step 1..steps ran in exactly one generation and every complete epoch
    used every sample once; a step redone after a loss makes it 0."""
    runs: dict[int, set[int]] = defaultdict(set)
    ids: dict[tuple[int, int], list[int]] = defaultdict(list)
    epoch_of: dict[int, int] = {}
    for r in sample_records(log_dir):
        step, gen = int(r["step"]), int(r["gen"])
        runs[step].add(gen)
        ids[(gen, step)].extend(int(i) for i in r["ids"])
        epoch_of[step] = int(r["epoch"])
    if sorted(runs) != list(range(1, steps + 1)) or any(len(g) != 1 for g in runs.values()):
        return 0
    by_epoch: dict[int, list[int]] = defaultdict(list)
    for step, gens in runs.items():
        by_epoch[epoch_of[step]].extend(ids[(next(iter(gens)), step)])
    spe = DATASET // BATCH
    for epoch, got in by_epoch.items():
        if len(got) != len(set(got)):
            return 0
        if (epoch + 1) * spe <= steps and sorted(got) != list(range(DATASET)):
            return 0
    return 1


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat[stat.rfind(")") + 2] in "ZX"


async def _poll(cond: Callable[[], bool], timeout_s: float = 120.0) -> None:
    # A process's exit and a watch stream's update have no event here to wait on.
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.02)


async def tide_way(workdir: Path, deadline_s: float) -> dict[str, Any]:
    steps = budget(deadline_s)
    async with preempt_rig(workdir, [*TRAIN, "--steps", str(steps)], JOB) as rig:
        await rig.core.upsert_job(JOB, {"min_replicas": 1}, initial_replicas=3, gpus_per_replica=1)
        await rig.job.wait_status(
            lambda s: s.world_size == 3 and s.step >= NOTICE_AT_STEP, 120, "3 members training"
        )
        before = {p.index: p.pid for p in rig.actuator.pods(JOB)}
        await _poll(lambda: rig.core.registry.by_name.get("bench-trainer-1") == JOB)
        t0 = time.monotonic()
        notice(rig.core, "spot-1", ["bench-trainer-1"], deadline_s)
        await rig.core.evaluate(JOB)
        await _poll(lambda: _gone(before[1]))
        released_s = time.monotonic() - t0
        for task in list(rig.core.controller.tasks.values()):
            await task
        dec = (await rig.store.list_decisions(job_id=JOB)).decisions[0]
        detail = (await rig.store.get_decision(dec.id)).decision
        if detail.state is not DecisionState.COMPLETED:
            raise RuntimeError(f"the preemption ended {detail.state}: {detail.error}")
        st = await rig.job.wait_status(lambda s: s.finished, 180, "the job finished")
        wrong = sum(1 for i, pid in before.items() if i != 1 and _gone(pid))
        return {
            "lost_steps": int(detail.lost_steps) + int(st.lost_steps_total),
            "exactly_once": exactly_once(rig.job.log_dir, steps),
            "wrong_pods_stopped": wrong,
            "notice_to_released_s": round(released_s, 3),
            "barrier_deadline_s": dec.inputs.get("barrier_deadline_s"),
        }


async def kube_way(workdir: Path, deadline_s: float) -> dict[str, Any]:
    steps = budget(deadline_s)
    job_id = f"{KUBE_NS}/{KUBE_NAME}"
    doomed = f"{KUBE_NAME}-worker-1"
    train = [*TRAIN, "--steps", str(steps)]
    async with kube_preempt_rig(workdir, train, replicas=3, gpus=3) as rig:
        await rig.core.upsert_job(
            job_id, {"min_replicas": 1}, initial_replicas=3, gpus_per_replica=1
        )
        await rig.job.wait_status(
            lambda s: s.world_size == 3 and s.step >= NOTICE_AT_STEP, 120, "3 members training"
        )
        procs = {i: rig.kubelet.procs[(KUBE_NS, f"{KUBE_NAME}-worker-{i}")] for i in range(3)}
        await _poll(lambda: rig.core.registry.by_name.get(doomed) == job_id)
        t0 = time.monotonic()
        notice(rig.core, "spot-1", [doomed], deadline_s, namespace=KUBE_NS)
        await rig.core.evaluate(job_id)
        await _poll(lambda: procs[1].poll() is not None)
        released_s = time.monotonic() - t0
        for task in list(rig.core.controller.tasks.values()):
            await task
        dec = (await rig.store.list_decisions(job_id=job_id)).decisions[0]
        detail = (await rig.store.get_decision(dec.id)).decision
        if detail.state is not DecisionState.COMPLETED:
            raise RuntimeError(f"the preemption ended {detail.state}: {detail.error}")
        st = await rig.job.wait_status(lambda s: s.finished, 180, "the job finished")
        # A pod of the new generation whose process ended before the job did.
        wrong = sum(1 for i, p in procs.items() if i != 1 and p.poll() not in (None, 0))
        return {
            "lost_steps": int(detail.lost_steps) + int(st.lost_steps_total),
            "exactly_once": exactly_once(rig.job.log_dir, steps),
            "wrong_pods_stopped": wrong,
            "notice_to_released_s": round(released_s, 3),
        }


async def baseline(workdir: Path, deadline_s: float) -> dict[str, Any]:
    steps = budget(deadline_s)
    job = LocalJob(
        workdir / "job", [*TRAIN, "--steps", str(steps)], job_id=JOB, heartbeat_timeout_s=10.0
    )
    job.start_coordinator()
    try:
        for i in range(3):
            job.add_pod(i)
        await job.wait_standby(3)
        await job.resize(3)
        await job.wait_status(lambda s: s.step >= NOTICE_AT_STEP, 120, "training")
        t0 = time.monotonic()
        # Nothing listens to the notice: the node goes at its deadline, and the pod with it.
        await asyncio.sleep(deadline_s)
        workers = job.pods[1].worker_pids()
        job.pods[1].kill_launcher()
        for pid in workers:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        released_s = time.monotonic() - t0
        st = await job.wait_status(lambda s: s.finished, 240, "the job finished")
        others = [p for p in job.pods if p.index != 1]
        wrong = sum(1 for p in others if p.proc.poll() not in (None, 0))
        return {
            "lost_steps": int(st.lost_steps_total),
            "exactly_once": exactly_once(job.log_dir, steps),
            "wrong_pods_stopped": wrong,
            "notice_to_released_s": round(released_s, 3),
            "final_generation": int(st.generation),
        }
    finally:
        await job.close()


async def run(deadline_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tide-preempt-") as tmp:
        tide = await tide_way(Path(tmp) / "tide", deadline_s)
        print("tide:", json.dumps(tide), file=sys.stderr)
        kube = await kube_way(Path(tmp) / "kube", deadline_s)
        print("kube:", json.dumps(kube), file=sys.stderr)
        try:
            base = await baseline(Path(tmp) / "baseline", deadline_s)
        except (AssertionError, TimeoutError) as exc:
            # The baseline leans on the coordinator's recovery alone (no scaler) and on a
            # loaded machine may run past its timeout: its figures are then missing from the
            # RESULT, and the reason is in it, instead of the other ways' figures lost too.
            base = {k: None for k in ("lost_steps", "exactly_once", "wrong_pods_stopped")}
            base |= {"notice_to_released_s": None, "error": str(exc).split(";")[0]}
        print("baseline:", json.dumps(base), file=sys.stderr)
    return {
        "deadline_s": deadline_s,
        "lost_steps": tide["lost_steps"],
        "exactly_once": tide["exactly_once"],
        "wrong_pods_stopped": tide["wrong_pods_stopped"],
        "notice_to_released_s": tide["notice_to_released_s"],
        "barrier_deadline_s": tide["barrier_deadline_s"],
        **{f"kube_{k}": v for k, v in kube.items()},
        "baseline_lost_steps": base["lost_steps"],
        "baseline_exactly_once": base["exactly_once"],
        "baseline_wrong_pods_stopped": base["wrong_pods_stopped"],
        "baseline_notice_to_released_s": base["notice_to_released_s"],
        **({"baseline_error": base["error"]} if "error" in base else {}),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one run each way (about 3 min)")
    p.add_argument("--deadline-s", type=float, default=20.0, help="the notice's deadline")
    ns = p.parse_args(argv)
    # The coordinators it starts serve this run's own processes on loopback; without
    # TLS files they refuse to start unless told so (docs/security.md), as in tests.
    os.environ.setdefault("TIDE_INSECURE", "1")
    result = asyncio.run(run(ns.deadline_s))
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
