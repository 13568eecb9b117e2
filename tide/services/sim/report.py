"""Running the policies on a scenario and what comes out: per policy and per job."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from tide.services.scaler.goodput import PoolRule
from tide.services.sim.hpa import HpaPath, Static
from tide.services.sim.scenario import Scenario, describe
from tide.services.sim.simulation import Controller, Run, Simulation, hours, nan_mean
from tide.services.sim.tide import TideController

#: Resizes that are not decisions: replicas lost with a node, and static's replacements.
NOT_DECIDED = frozenset({"lost", "replaced"})


def controller(policy: str) -> Controller:
    if policy == "static":
        return Static()
    if policy == "hpa":
        return HpaPath()
    if policy == "tide":
        return TideController(PoolRule.MARGINAL)
    if policy == "tide-fcfs":
        return TideController(PoolRule.FCFS)
    raise ValueError(policy)


@dataclass
class JobOutcome:
    name: str
    arrive_h: float
    start_h: float | None
    done_h: float | None
    jct_h: float | None
    gpu_hours: float
    lost_steps: float
    pause_s: float
    resizes: int
    losses: int
    flaps: int
    max_replicas_reached: int
    best_replicas: int


@dataclass
class PolicyOutcome:
    policy: str
    completed: int
    jobs: int
    mean_jct_h: float
    p95_jct_h: float
    makespan_h: float
    gpu_hours: float
    cost: float
    mean_util_pct: float
    resizes: int
    losses: int
    lost_steps: float
    flaps: int
    reaction_s: float
    reaction_up_s: float
    reaction_down_s: float
    # Work done, in hours of one replica of its job, per GPU-hour paid: 1.0 if every GPU
    # did a single replica's work, less where scaling did not pay or GPUs sat idle.
    work_per_gpu_hour: float
    # The same work per hour of the makespan: what the cluster got done while it had jobs.
    throughput_replica_equiv: float
    background_unmet_gpu_hours: float
    events: int
    evaluations: int
    wall_s: float
    sim_speed: float
    job_outcomes: list[JobOutcome] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("job_outcomes")
        return d


def _job(sim: Simulation, r: Run) -> JobOutcome:
    planned = [x for x in r.resizes if x.why not in NOT_DECIDED]
    done = r.done_at
    return JobOutcome(
        name=r.name,
        arrive_h=hours(r.spec.arrive_s),
        start_h=None if r.started_at is None else hours(r.started_at),
        done_h=None if done is None else hours(done),
        jct_h=None if done is None else hours(done - r.spec.arrive_s),
        gpu_hours=hours(r.gpu_s),
        lost_steps=r.lost_samples / r.spec.global_batch,
        pause_s=r.pause_s,
        resizes=len(planned),
        losses=len(r.resizes) - len(planned),
        flaps=sim.flaps(r),
        max_replicas_reached=max((w for _, w in r.worlds), default=0),
        best_replicas=min(r.spec.curve.best, r.spec.max_replicas),
    )


def simulate(scenario: Scenario, policy: str) -> tuple[PolicyOutcome, Simulation]:
    ctl = controller(policy)
    sim = Simulation(scenario, ctl)
    t0 = time.perf_counter()
    sim.run()
    wall = time.perf_counter() - t0
    s = scenario
    dur_h = hours(s.duration_s)
    p = s.pricing
    if policy == "static" and p.static_reserved_gpus:
        paid_h = p.static_reserved_gpus * dur_h
        cost = p.reserved_gpu_hour * paid_h
    else:
        over_h = hours(sim.gpu_s_over)
        paid_h = p.elastic_reserved_gpus * dur_h + over_h
        cost = p.reserved_gpu_hour * p.elastic_reserved_gpus * dur_h + p.on_demand_gpu_hour * over_h
    jobs = [_job(sim, r) for r in sim.runs]
    done = [j.jct_h for j in jobs if j.jct_h is not None]
    reactions = [x for r in sim.runs for x in r.resizes if x.reaction_s is not None]
    ups = [x.reaction_s for x in reactions if x.to_replicas > x.from_replicas]
    downs = [x.reaction_s for x in reactions if x.to_replicas < x.from_replicas]
    busy_h = hours(sum(r.busy_gpu_s for r in sim.runs))
    equiv_h = hours(sum(r.samples / r.spec.curve.at(1) for r in sim.runs if r.spec.curve.at(1) > 0))
    first = min((r.spec.arrive_s for r in sim.runs), default=0.0)
    last = max((r.done_at for r in sim.runs if r.done_at is not None), default=s.duration_s)
    evaluations = getattr(ctl, "evaluations", 0)
    out = PolicyOutcome(
        policy=policy,
        completed=len(done),
        jobs=len(jobs),
        mean_jct_h=nan_mean(done),
        p95_jct_h=_pct(done, 0.95),
        makespan_h=max((j.done_h for j in jobs if j.done_h is not None), default=float("nan")),
        gpu_hours=paid_h,
        cost=cost,
        mean_util_pct=100.0 * busy_h / paid_h if paid_h > 0 else float("nan"),
        resizes=sum(j.resizes for j in jobs),
        losses=sum(j.losses for j in jobs),
        lost_steps=sum(j.lost_steps for j in jobs),
        flaps=sum(j.flaps for j in jobs),
        reaction_s=nan_mean([x.reaction_s for x in reactions if x.reaction_s is not None]),
        reaction_up_s=nan_mean([x for x in ups if x is not None]),
        reaction_down_s=nan_mean([x for x in downs if x is not None]),
        work_per_gpu_hour=equiv_h / paid_h if paid_h > 0 else float("nan"),
        throughput_replica_equiv=equiv_h / hours(last - first) if last > first else float("nan"),
        background_unmet_gpu_hours=hours(sim.bg_unmet_gpu_s),
        events=sim.events,
        evaluations=evaluations,
        wall_s=wall,
        sim_speed=s.duration_s / wall if wall > 0 else float("inf"),
        job_outcomes=jobs,
    )
    return out, sim


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]


@dataclass
class Comparison:
    scenario: dict[str, Any]
    outcomes: list[PolicyOutcome]
    sims: dict[str, Simulation]
    wall_s: float

    @property
    def sim_speed(self) -> float:
        """Simulated seconds per wall second, every policy's run counted."""
        simulated = self.scenario["duration_s"] * len(self.outcomes)
        return simulated / self.wall_s if self.wall_s > 0 else float("inf")

    def by_policy(self, name: str) -> PolicyOutcome:
        return next(o for o in self.outcomes if o.policy == name)

    def doc(self, *, jobs: bool = False) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "sim_speed": round(self.sim_speed, 1),
            "wall_s": round(self.wall_s, 3),
            "policies": [
                {**o.summary(), **({"jobs": [asdict(j) for j in o.job_outcomes]} if jobs else {})}
                for o in self.outcomes
            ],
        }


def compare(scenario: Scenario, policies: tuple[str, ...] | None = None) -> Comparison:
    t0 = time.perf_counter()
    outcomes, sims = [], {}
    for policy in policies or scenario.policies:
        o, sim = simulate(scenario, policy)
        outcomes.append(o)
        sims[policy] = sim
    return Comparison(describe(scenario), outcomes, sims, time.perf_counter() - t0)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
