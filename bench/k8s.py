"""The whole loop through the Kubernetes actuator, against the local actuator's loop in the
same run (the baseline).

Kubernetes: tide/services/testing/kube/loop.py — the API server emulator, paddle-operator's
stand-in and a kubelet running each pod's launcher with real Paddle workers (the MLP of
tide/trainer/examples/train_mlp.py on gloo), the scaler (``--actuator kubernetes:KUBECONFIG``)
and the coordinator as processes; load grows the PaddleJob 2 -> 4 and shrinks it 4 -> 2, with
a 409 armed on the PaddleJob before the grow and every watch cut with its history compacted
(so the re-watch gets 410).

Baseline: `tide demo` (tide/services/local/demo/) with the same policy windows, training and
load: the same grow and shrink through the local actuator (launchers as local processes).

    python -m bench.k8s --quick     # one loop each way (about 3 min here)
    python -m bench.k8s             # three of each, medians

The last line is ``RESULT {json}``: lost_steps, exactly_once (1/0), decisions_completed,
replicas_match (1/0: the PaddleJob's replicas equal the coordinator's world size at the end),
events_posted (Events on the PaddleJob), conflicts_retried, watches_expired, pause_grow_s and
pause_shrink_s (the coordinator's measured pause of each resize), the baseline's pauses, and
pause_ratio_grow / pause_ratio_shrink (Kubernetes over local).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tide.services.local.demo import Demo, DemoSettings
from tide.services.testing.kube.loop import KubeLoop, LoopOutcome, LoopSettings


async def kube_once(workdir: Path) -> LoopOutcome:
    out = await KubeLoop(LoopSettings(workdir)).run()
    if out.error:
        raise SystemExit(f"the Kubernetes loop failed: {out.error} (logs in {workdir})")
    return out


async def local_once(workdir: Path) -> tuple[float, float, int]:
    """(grow pause, shrink pause, lost steps) of one `tide demo` run."""
    demo = Demo(DemoSettings(state_dir=workdir, chart=workdir / "demo.png"), lambda s: None, print)
    outcome = await demo.run(asyncio.Event())
    if not outcome.ok:
        raise SystemExit(f"the local baseline failed: {outcome.error} (logs in {workdir})")
    resizes = [d.decision for d in outcome.decisions if d.decision.from_replicas > 0]
    grow = next(d.pause_s for d in resizes if d.to_replicas > d.from_replicas)
    shrink = next(d.pause_s for d in resizes if d.to_replicas < d.from_replicas)
    return grow, shrink, outcome.lost_steps


async def run(quick: bool, workdir: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    reps = 1 if quick else 3
    kube: list[LoopOutcome] = []
    local: list[tuple[float, float, int]] = []
    for i in range(reps):
        kube.append(await kube_once(workdir / f"kube-{i}"))
        local.append(await local_once(workdir / f"local-{i}"))

    def median(xs: list[float]) -> float:
        return round(statistics.median(xs), 3)

    grow = median([o.completed(grow=True)[0].pause_s for o in kube])
    shrink = median([o.completed(grow=False)[0].pause_s for o in kube])
    base_grow = median([g for g, _, _ in local])
    base_shrink = median([s for _, s, _ in local])
    for i, o in enumerate(kube):
        print(
            f"kubernetes #{i}: decisions "
            + ", ".join(
                f"{d.from_replicas}->{d.to_replicas} {d.state} {d.pause_s:.2f}s"
                for d in o.decisions
            )
            + f"; {o.audit.summary() if o.audit else 'no sample log'}; {o.elapsed_s:.0f} s"
        )
    for i, (g, s, lost) in enumerate(local):
        print(f"local #{i}: grow pause {g:.2f} s, shrink pause {s:.2f} s, lost steps {lost}")
    print(
        f"pause ratio kubernetes/local: grow {grow / base_grow:.2f}, shrink {shrink / base_shrink:.2f}"
    )
    return {
        "lost_steps": max(o.lost_steps for o in kube),
        "exactly_once": int(all(o.audit is not None and o.audit.exactly_once for o in kube)),
        "decisions_completed": min(
            sum(1 for d in o.decisions if d.state == "COMPLETED") for o in kube
        ),
        "replicas_match": int(all(o.paddlejob_replicas == o.world_size for o in kube)),
        "events_posted": min(len(o.events) for o in kube),
        "conflicts_retried": min(o.conflicts for o in kube),
        "watches_expired": min(o.expired_watches for o in kube),
        "pause_grow_s": grow,
        "pause_shrink_s": shrink,
        "baseline_pause_grow_s": base_grow,
        "baseline_pause_shrink_s": base_shrink,
        "baseline_lost_steps": max(lost for _, _, lost in local),
        "pause_ratio_grow": round(grow / base_grow, 2),
        "pause_ratio_shrink": round(shrink / base_shrink, 2),
        "reps": reps,
        "elapsed_s": round(time.monotonic() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one loop each way")
    p.add_argument("--workdir", default="", help="keep logs here (default: a temp dir)")
    args = p.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tide-k8s-"))
    result = asyncio.run(run(args.quick, workdir))
    print(f"logs in {workdir}")
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
