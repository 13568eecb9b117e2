"""The simulator's mechanics and what each policy does with them, on small scenarios
whose answers are known."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tide.services.sim import scenario as sc
from tide.services.sim.report import compare, simulate

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def one_job(**job: Any) -> dict[str, Any]:
    base = {
        "name": "a",
        "arrive": {"at": "1h"},
        "work": {"hours": 4, "at_replicas": 2},
        "min_replicas": 2,
        "max_replicas": 8,
        "initial_replicas": 2,
        "static_replicas": 2,
        "checkpoint_interval": "30m",
    }
    return {
        "duration": "2d",
        "seed": 3,
        "pool": {"nodes": 2, "gpus_per_node": 8},
        "pauses": {"pod_start_s": 60},
        "tide": {"policy": {"sustain_s": 60, "bucket_s": 10, "cooldown_s": 60}},
        "jobs": [{**base, **job}],
    }


def test_static_runs_the_work_in_the_time_it_takes() -> None:
    o, sim = simulate(sc.parse(one_job()), "static")
    (r,) = sim.runs
    # 4 h of work at 2 replicas, plus the pod start and the launch (60 s + 4.32 s).
    assert o.completed == 1
    assert r.done_at is not None
    assert r.done_at - r.spec.arrive_s == pytest.approx(4 * 3600 + 64.32, abs=1e-6)
    assert o.gpu_hours == pytest.approx(2 * (4 + 64.32 / 3600), rel=1e-6)
    assert (o.resizes, o.lost_steps) == (0, 0)


def test_tide_grows_a_job_that_scales_and_loses_no_step() -> None:
    o, sim = simulate(sc.parse(one_job()), "tide")
    (r,) = sim.runs
    assert [x.to_replicas for x in r.resizes] == [4, 7, 8]
    assert o.lost_steps == 0 and o.flaps == 0
    assert r.pause_s == pytest.approx(3 * 1.36)
    # The decisions come a sustain (60 s) after each change, less a few seconds of the
    # oldest bucket: not a bucket later, and not before.
    assert all(50.0 <= x.reaction_s <= 61.0 for x in r.resizes if x.reaction_s is not None)
    assert o.mean_jct_h < 4 * 2 / 8 + 0.2


def test_the_hpa_path_restarts_and_loses_the_work_since_its_checkpoint() -> None:
    o, sim = simulate(sc.parse(one_job()), "hpa")
    (r,) = sim.runs
    assert r.resizes and all(x.to_replicas > x.from_replicas for x in r.resizes)
    assert o.lost_steps > 0
    assert r.lost_samples > 0


def test_a_curve_that_peaks_at_4_stops_tide_at_4_and_not_the_hpa() -> None:
    """The goodput guard in the simulator: GPU utilization stays high whatever the size
    (NCCL waits look busy), so the HPA grows the job past its best size and keeps it
    there; Tide measures the throughput, reverts the grow that made it slower and does
    not try that size again."""
    peak = {
        "points": [[1, 115], [2, 200], [3, 255], [4, 280], [5, 275], [6, 240], [7, 175], [8, 80]]
    }
    s = sc.parse(one_job(curve=peak, work={"hours": 8, "at_replicas": 2}))
    tide, tsim = simulate(s, "tide")
    hpa, hsim = simulate(s, "hpa")
    sizes = [(x.from_replicas, x.to_replicas, x.why) for x in tsim.runs[0].resizes]
    assert "SLOWER_AFTER_SCALE_UP" in {w for _, _, w in sizes}, sizes
    # Tide ends at the best size and stays there.
    assert tsim.runs[0].worlds[-2][1] == 4
    assert max(w for _, w in hsim.runs[0].worlds) == 8
    assert tide.mean_jct_h < hpa.mean_jct_h
    assert tide.gpu_hours < hpa.gpu_hours


def test_spot_reclaims_cost_tide_a_pause_and_the_hpa_path_lost_work() -> None:
    doc = {**one_job(work={"hours": 200, "at_replicas": 2}), "duration": "4d"}
    doc["pool"] = {
        "nodes": 0,
        "spot_nodes": 3,
        "gpus_per_node": 8,
        "spot_reclaims_per_node_day": 4.0,
        "spot_notice_s": 120,
    }
    s = sc.parse(doc)
    tide, tsim = simulate(s, "tide")
    hpa, _ = simulate(s, "hpa")
    shrinks = [x for x in tsim.runs[0].resizes if x.why == "NODE_TERMINATION"]
    assert shrinks, "no reclaim hit the job"
    # A shrink off the doomed node in its notice: a checkpoint, not lost work (unless the
    # whole job sat on that node: the replica the policy keeps, floor 1, goes with it).
    lost = [x for x in tsim.runs[0].resizes if x.why == "lost"]
    assert all(x.from_replicas == 1 for x in lost)
    assert hpa.lost_steps > tide.lost_steps
    assert tide.completed == hpa.completed == 1


def test_the_same_seed_gives_the_same_cluster_to_every_policy() -> None:
    s = sc.load(
        ROOT / "scenarios" / "pool.yaml",
        overrides={"duration": "2d", "jobs.0.count": 6, "jobs.1.count": 2},
    )
    a = compare(s, ("tide",)).outcomes[0]
    b = compare(s, ("tide",)).outcomes[0]
    assert a.summary() | {"wall_s": 0, "sim_speed": 0} == b.summary() | {
        "wall_s": 0,
        "sim_speed": 0,
    }


def test_the_pool_rule_against_first_come_first_served() -> None:
    """When a job ends, its GPUs go to the jobs whose next replica adds the most: the
    cluster gets more done per hour than when they go to whoever asked first."""
    s = sc.load(ROOT / "scenarios" / "contention.yaml")
    c = compare(s, ("tide", "tide-fcfs"))
    marginal, fcfs = c.by_policy("tide"), c.by_policy("tide-fcfs")
    assert marginal.throughput_replica_equiv > fcfs.throughput_replica_equiv
    assert marginal.makespan_h < fcfs.makespan_h


def test_each_signal_replays_and_sm_active_does_not_grow_a_busy_idle_job() -> None:
    """scenarios/busy_idle.yaml: utilization 95 %, SM activity 30 %: the utilization rule
    grows the job, sm_active does not; GPUs without GPM make sm_active refuse (no grow,
    no shrink on a missing reading)."""
    from bench.simulate import SCENARIOS, by_signal, grows, on_signal

    busy = by_signal(sc.load(SCENARIOS / "busy_idle.yaml"))
    assert grows(busy["utilization"]) >= 1
    assert grows(busy["sm_active"]) == 0
    no_gpm = sc.parse(one_job(work={"hours": 8, "at_replicas": 2}))
    _, sim = simulate(on_signal(no_gpm, "sm_active"), "tide")
    assert sim.runs[0].resizes == []
