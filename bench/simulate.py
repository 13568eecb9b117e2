"""The simulator's figures: the e-commerce case under static allocation, the HPA path and
Tide, the pool rule against first come first served, and the simulator's own speed.

    python -m bench.simulate --quick   # the e-commerce case and the pool rule (seconds)
    python -m bench.simulate           # and 30 days of 100 jobs on 80 GPUs (pool.yaml)

Every figure compares policies on the same scenario and seed in the same run
(their ratios are the result; the absolute ones depend on the scenario's
assumptions, docs/simulate.md). ``sim_speed`` is simulated seconds per wall
second over every policy run, on this (shared, noisy) machine. The last line
is ``RESULT {json}`` with static_hours, hpa_hours, tide_hours (mean job
completion), static_cost, hpa_cost, tide_cost, tide_lost_steps, hpa_lost_steps,
tide_reaction_s, hpa_reaction_s (mean time from a load change to the decision
it prompted), sim_speed, and the pool rule's throughput against FCFS.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from tide.services.sim import scenario as sc
from tide.services.sim.report import Comparison, compare

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "scenarios"


def _r(x: float, nd: int = 2) -> float | None:
    return round(x, nd) if math.isfinite(x) else None


def show(c: Comparison) -> None:
    name = c.scenario["name"] + (f"/{c.scenario['variant']}" if c.scenario["variant"] else "")
    print(f"{name}: {c.scenario['jobs']} jobs, {c.scenario['duration_s'] / 86400:g} days")
    print(
        f"  {'policy':<10}{'JCT h':>8}{'GPU-h':>9}{'cost':>10}{'util':>6}{'resizes':>9}"
        f"{'flaps':>7}{'lost steps':>12}{'react s':>9}{'work/GPU-h':>12}"
    )
    for o in c.outcomes:
        print(
            f"  {o.policy:<10}{o.mean_jct_h:>8.2f}{o.gpu_hours:>9.0f}{o.cost:>10.0f}"
            f"{o.mean_util_pct:>5.0f}%{o.resizes:>9}{o.flaps:>7}{o.lost_steps:>12.0f}"
            f"{o.reaction_s:>9.1f}{o.work_per_gpu_hour:>12.3f}"
        )
    print(f"  {c.wall_s:.2f} s wall, {c.sim_speed:,.0f} simulated s per wall s")


SIGNALS = ("utilization", "sm_active", "tensor_active", "throughput")


def on_signal(s: sc.Scenario, signal: str) -> sc.Scenario:
    """``s`` with Tide's policy scaling on ``signal`` (docs/policy.md "Signals")."""
    policy = s.tide.policy.with_overrides({"signal": signal})
    return dataclasses.replace(s, tide=dataclasses.replace(s.tide, policy=policy))


def grows(c: Comparison, policy: str = "tide") -> int:
    """Resizes that added replicas, over every job of the run."""
    return sum(1 for r in c.sims[policy].runs for z in r.resizes if z.to_replicas > z.from_replicas)


def by_signal(s: sc.Scenario) -> dict[str, Comparison]:
    return {sig: compare(on_signal(s, sig), ("tide",)) for sig in SIGNALS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.simulate", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="skip the 30-day, 100-job pool")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    runs: list[Comparison] = []

    eco = compare(sc.load(SCENARIOS / "ecommerce.yaml"), ("static", "hpa", "tide"))
    show(eco)
    runs.append(eco)
    s, h, t = (eco.by_policy(p) for p in ("static", "hpa", "tide"))

    pool_rule = compare(sc.load(SCENARIOS / "contention.yaml"), ("tide", "tide-fcfs"))
    show(pool_rule)
    runs.append(pool_rule)
    marginal, fcfs = pool_rule.by_policy("tide"), pool_rule.by_policy("tide-fcfs")

    # The same scenarios under each signal Tide can scale on.
    eco_sig = by_signal(sc.load(SCENARIOS / "ecommerce.yaml"))
    busy = by_signal(sc.load(SCENARIOS / "busy_idle.yaml"))
    print(f"  {'signal':<14}{'ecommerce cost':>15}{'lost steps':>12}{'busy_idle grows':>17}")
    for sig in SIGNALS:
        o = eco_sig[sig].by_policy("tide")
        print(f"  {sig:<14}{o.cost:>15.0f}{o.lost_steps:>12.0f}{grows(busy[sig]):>17}")

    result: dict[str, Any] = {
        "static_hours": _r(s.mean_jct_h),
        "hpa_hours": _r(h.mean_jct_h),
        "tide_hours": _r(t.mean_jct_h),
        "static_cost": _r(s.cost, 0),
        "hpa_cost": _r(h.cost, 0),
        "tide_cost": _r(t.cost, 0),
        "tide_cost_vs_static": _r(t.cost / s.cost, 3),
        "hpa_cost_vs_static": _r(h.cost / s.cost, 3),
        "tide_lost_steps": _r(t.lost_steps, 0),
        "hpa_lost_steps": _r(h.lost_steps, 0),
        "tide_reaction_s": _r(t.reaction_s, 1),
        "hpa_reaction_s": _r(h.reaction_s, 1),
        "tide_resizes": t.resizes,
        "hpa_resizes": h.resizes,
        "pool_rule_throughput_vs_fcfs": _r(
            marginal.throughput_replica_equiv / fcfs.throughput_replica_equiv, 4
        ),
        "pool_rule_mean_jct_vs_fcfs": _r(marginal.mean_jct_h / fcfs.mean_jct_h, 4),
        "signal_costs": {
            sig: {
                "cost": _r(c.by_policy("tide").cost, 0),
                "lost_steps": _r(c.by_policy("tide").lost_steps, 0),
                "mean_jct_h": _r(c.by_policy("tide").mean_jct_h),
            }
            for sig, c in eco_sig.items()
        },
        "busy_idle_grows": {sig: grows(c) for sig, c in busy.items()},
        "sm_active_avoided_grows": grows(busy["utilization"]) - grows(busy["sm_active"]),
    }
    if not args.quick:
        pool = compare(sc.load(SCENARIOS / "pool.yaml"))
        show(pool)
        runs.append(pool)
        result["pool_30d_100_jobs_wall_s"] = _r(pool.wall_s, 1)
        result["pool_30d_100_jobs_sim_speed"] = _r(pool.sim_speed, 0)
    simulated = sum(c.scenario["duration_s"] * len(c.outcomes) for c in runs)
    wall = sum(c.wall_s for c in runs)
    result["sim_speed"] = _r(simulated / wall, 0)
    result["wall_s"] = _r(time.monotonic() - t0, 1)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
