"""A scenario: the GPU pool, its background load, the jobs, prices, pause costs and the
policies to compare, read from YAML (docs/simulate.md describes every key).

Every number has a default written once here, each with where it comes from: a
measurement of this repository (docs/trainer.md, bench/rescale), a documented
Kubernetes default (the HPA's), or a plain assumption the scenario should
state. A bad value raises ConfigError naming the key and the value.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tide.base.errors import ConfigError
from tide.services.scaler.goodput import PoolRule
from tide.services.scaler.policy import PolicySettings
from tide.services.sim.model import (
    DAY_S,
    Curve,
    Daily,
    clock,
    duration,
    integer,
    number,
    parse_curve,
    parse_daily,
)

#: A background that takes no GPU.
NOTHING = Daily(((0.0, 0.0),))

#: The policies `tide simulate` knows, in the order it reports them.
POLICIES = ("static", "hpa", "tide", "tide-fcfs")


# --- the parts of a scenario --------------------------------------------------------------------


@dataclass(frozen=True)
class Pool:
    """The shared GPU pool: on-demand nodes, and spot nodes that are reclaimed with notice."""

    nodes: int = 4
    gpus_per_node: int = 8
    spot_nodes: int = 0
    # Assumptions a scenario states: reclaims per spot node and day (Poisson), the
    # notice given (AWS gives 120 s, GCP 30 s), and how long a replacement takes.
    spot_reclaims_per_node_day: float = 0.5
    spot_notice_s: float = 120.0
    spot_replace_s: float = 600.0
    # Kubernetes' default terminationGracePeriodSeconds: the notice a preempted pod gets.
    preempt_grace_s: float = 30.0

    @property
    def gpus(self) -> int:
        return (self.nodes + self.spot_nodes) * self.gpus_per_node


@dataclass(frozen=True)
class Background:
    """GPUs other tenants take by time of day (the tide), with noise, re-drawn every step."""

    gpus: Daily = NOTHING
    noise_gpus: float = 0.0
    step_s: float = 900.0


@dataclass(frozen=True)
class Pricing:
    on_demand_gpu_hour: float = 1.0
    reserved_gpu_hour: float = 1.0
    # The static policy pays for this many GPUs around the clock (its reservation);
    # 0: it pays for the GPU-hours its jobs hold, like the elastic ones.
    static_reserved_gpus: int = 0
    # GPUs an elastic policy keeps reserved around the clock (paid at the reserved price).
    elastic_reserved_gpus: int = 0


@dataclass(frozen=True)
class Pauses:
    """What a resize costs. Defaults: bench.rescale (docs/trainer.md, "Measured": the
    MLP on 2 vCPU, medians of 3): Tide's pause 1.36 s for 2 → 4 and 0.61 s for 4 → 2;
    Paddle's way (kill and relaunch, restore the last periodic checkpoint) 4.32 s.
    ``pod_start_s`` (scheduling and image pull of a new pod) is not measured here: an
    assumption each scenario states."""

    tide_grow_s: float = 1.36
    tide_shrink_s: float = 0.61
    relaunch_s: float = 4.32
    pod_start_s: float = 30.0


@dataclass(frozen=True)
class Hpa:
    """The Kubernetes HPA path with its documented defaults (docs/simulate.md cites them):
    sync 15 s (--horizontal-pod-autoscaler-sync-period), tolerance 0.1, scale-down
    stabilization 300 s, scale-up by max(4 pods, 100 %) and scale-down by 100 % per
    15 s (pkg/apis/autoscaling/v2 defaults); DCGM exporter collecting every 30 s
    (--collect-interval); Prometheus scraping every 60 s (its default scrape_interval)."""

    target_util_pct: float = 60.0
    sync_s: float = 15.0
    tolerance: float = 0.1
    downscale_stabilization_s: float = 300.0
    upscale_stabilization_s: float = 0.0
    scale_up_pods: int = 4
    scale_up_percent: float = 100.0
    scale_down_percent: float = 100.0
    period_s: float = 15.0
    dcgm_collect_s: float = 30.0
    scrape_s: float = 60.0


@dataclass(frozen=True)
class Tide:
    """Tide's policy (PolicySettings overrides) and how the simulator runs it."""

    policy: PolicySettings = field(default_factory=PolicySettings)
    # Agents report once a second; the window gets one sample per GPU per interval.
    telemetry_interval_s: float = 1.0
    # While a job's window may tip, it is evaluated this often (the scaler: on every
    # slot the window slides by, and once a second).
    eval_step_s: float = 1.0


@dataclass(frozen=True)
class JobSpec:
    name: str
    arrive_s: float
    work_samples: float
    curve: Curve
    min_replicas: int = 1
    max_replicas: int = 8
    initial_replicas: int = 1
    static_replicas: int = 8
    gpus_per_replica: int = 1
    checkpoint_interval_s: float = 1800.0
    global_batch: int = 1024
    # GPU utilization while training: data-parallel training keeps a GPU "busy" in
    # NCCL kernels too, so it stays high whether or not another replica helps.
    busy_util_pct: float = 95.0
    # NVML GPM activity as a fraction of the utilization the GPUs show: SM activity and
    # tensor-pipe activity. None: the job's GPUs have no GPM (before Hopper), and a
    # policy scaling on it refuses (NO_SIGNAL).
    sm_active_ratio: float | None = None
    tensor_active_ratio: float | None = None
    # Samples/s the input pipeline delivers, by time of day (online training); None: unlimited.
    input_per_s: Daily | None = None


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    duration_s: float
    seed: int
    pool: Pool
    background: Background
    pricing: Pricing
    pauses: Pauses
    hpa: Hpa
    tide: Tide
    jobs: tuple[JobSpec, ...]
    policies: tuple[str, ...] = ("static", "hpa", "tide")
    # GPUs the static policy's jobs get for themselves (a reservation outside the pool);
    # 0: they share the pool and wait for room like the others.
    static_dedicated_gpus: int = 0
    variant: str = ""
    variants: tuple[str, ...] = ()


# --- loading --------------------------------------------------------------------------------------


def _set_path(doc: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``a.b.0.c`` in a nested dict/list document."""
    parts = dotted.split(".")
    cur: Any = doc
    for i, part in enumerate(parts[:-1]):
        nxt = cur[int(part)] if isinstance(cur, list) else cur.get(part)
        if nxt is None:
            if isinstance(cur, list):
                raise ConfigError(f"{dotted}: {'.'.join(parts[: i + 1])} does not exist")
            nxt = cur[part] = {}
        cur = nxt
    last = parts[-1]
    if isinstance(cur, list):
        cur[int(last)] = value
    else:
        cur[last] = value


def apply_overrides(doc: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    for k, v in overrides.items():
        try:
            _set_path(out, k, v)
        except (IndexError, ValueError, TypeError, AttributeError):
            raise ConfigError(f"override {k}={v!r}: no such key in the scenario") from None
    return out


def load(path: Path, variant: str = "", overrides: Mapping[str, Any] | None = None) -> Scenario:
    """Read a scenario file, apply a named variant and then ``overrides`` (dotted keys)."""
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"scenario {str(path)!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"scenario {str(path)!r}: not YAML ({exc})".replace("\n", " ")) from None
    return parse(doc, variant, overrides, where=str(path))


def parse(
    doc: Any,
    variant: str = "",
    overrides: Mapping[str, Any] | None = None,
    *,
    where: str = "scenario",
) -> Scenario:
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: expected a mapping at the top")
    variants = doc.get("variants") or {}
    if not isinstance(variants, dict):
        raise ConfigError(f"{where}: variants must map a name to its overrides")
    if variant:
        if variant not in variants:
            raise ConfigError(f"--variant {variant!r}: the scenario has {sorted(variants)}")
        doc = apply_overrides(doc, variants[variant].get("set", {}))
    if overrides:
        doc = apply_overrides(doc, overrides)
    known = {
        "name",
        "description",
        "duration",
        "seed",
        "pool",
        "background",
        "pricing",
        "pauses",
        "hpa",
        "tide",
        "jobs",
        "policies",
        "static_dedicated_gpus",
        "variants",
    }
    unknown = set(doc) - known
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}")
    duration_s = duration("duration", doc.get("duration", "7d"))
    if duration_s <= 0:
        raise ConfigError(f"duration={doc.get('duration')!r}: must be > 0")
    seed = integer("seed", doc.get("seed", 1))
    policies = tuple(doc.get("policies") or ("static", "hpa", "tide"))
    for p in policies:
        if p not in POLICIES:
            raise ConfigError(f"policies: unknown policy {p!r} (one of {', '.join(POLICIES)})")
    pool = _section(Pool, "pool", doc.get("pool"))
    rng = random.Random(seed)
    jobs = _jobs(doc.get("jobs"), duration_s, rng)
    static_dedicated = integer("static_dedicated_gpus", doc.get("static_dedicated_gpus", 0))
    for j in jobs:
        need = j.min_replicas * j.gpus_per_replica
        if need > pool.gpus:
            raise ConfigError(
                f"jobs: {j.name} needs {need} GPUs at min_replicas, the pool has {pool.gpus}"
            )
        if static_dedicated and j.static_replicas * j.gpus_per_replica > static_dedicated:
            raise ConfigError(
                f"jobs: {j.name}'s static_replicas need more than static_dedicated_gpus="
                f"{static_dedicated}"
            )
    return Scenario(
        name=str(doc.get("name") or "scenario"),
        description=str(doc.get("description") or ""),
        duration_s=duration_s,
        seed=seed,
        pool=pool,
        background=_background(doc.get("background")),
        pricing=_section(Pricing, "pricing", doc.get("pricing")),
        pauses=_section(Pauses, "pauses", doc.get("pauses")),
        hpa=_section(Hpa, "hpa", doc.get("hpa")),
        tide=_tide(doc.get("tide")),
        jobs=jobs,
        policies=policies,
        static_dedicated_gpus=static_dedicated,
        variant=variant,
        variants=tuple(variants),
    )


def _section(cls: Any, key: str, raw: Any) -> Any:
    """A flat section: each field a number, a duration (``*_s``) or an integer."""
    if raw is None:
        return cls()
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{key}={raw!r}: expected a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(raw) - set(fields)
    if unknown:
        raise ConfigError(f"{key}: unknown key(s) {sorted(unknown)} (known: {sorted(fields)})")
    values: dict[str, Any] = {}
    defaults = cls()
    for name, v in raw.items():
        k = f"{key}.{name}"
        if name.endswith("_s"):
            values[name] = duration(k, v)
        elif isinstance(getattr(defaults, name), int):
            values[name] = integer(k, v)
        else:
            values[name] = number(k, v)
    return cls(**values)


def _background(raw: Any) -> Background:
    if raw is None:
        return Background()
    if not isinstance(raw, Mapping):
        raise ConfigError(f"background={raw!r}: expected a mapping")
    unknown = set(raw) - {"gpus", "noise_gpus", "step"}
    if unknown:
        raise ConfigError(f"background: unknown key(s) {sorted(unknown)}")
    step = duration("background.step", raw.get("step", 900))
    if step <= 0:
        raise ConfigError(f"background.step={raw.get('step')!r}: must be > 0")
    return Background(
        gpus=parse_daily("background.gpus", raw.get("gpus", 0)),
        noise_gpus=number("background.noise_gpus", raw.get("noise_gpus", 0.0)),
        step_s=step,
    )


def _tide(raw: Any) -> Tide:
    if raw is None:
        return Tide()
    if not isinstance(raw, Mapping):
        raise ConfigError(f"tide={raw!r}: expected a mapping")
    unknown = set(raw) - {"policy", "telemetry_interval", "eval_step"}
    if unknown:
        raise ConfigError(f"tide: unknown key(s) {sorted(unknown)}")
    overrides = raw.get("policy") or {}
    if not isinstance(overrides, Mapping):
        raise ConfigError(f"tide.policy={overrides!r}: expected PolicySettings fields")
    policy = PolicySettings().with_overrides(dict(overrides))
    interval = duration("tide.telemetry_interval", raw.get("telemetry_interval", 1.0))
    step = duration("tide.eval_step", raw.get("eval_step", 1.0))
    if interval <= 0 or step <= 0:
        raise ConfigError("tide.telemetry_interval and tide.eval_step must be > 0")
    return Tide(policy, interval, step)


_JOB_KEYS = {
    "name",
    "count",
    "arrive",
    "work",
    "curve",
    "curves",
    "min_replicas",
    "max_replicas",
    "initial_replicas",
    "static_replicas",
    "gpus_per_replica",
    "checkpoint_interval",
    "global_batch",
    "busy_util_pct",
    "sm_active_ratio",
    "tensor_active_ratio",
    "input_per_s",
}


def _ratio(t: Mapping[str, Any], key: str, name: str) -> float | None:
    raw = t.get(name)
    return None if raw is None else number(f"{key}.{name}", raw, 0, 1)


def _jobs(raw: Any, duration_s: float, rng: random.Random) -> tuple[JobSpec, ...]:
    if not isinstance(raw, list) or not raw:
        raise ConfigError("jobs: expected a list of job templates")
    out: list[JobSpec] = []
    for i, t in enumerate(raw):
        key = f"jobs[{i}]"
        if not isinstance(t, Mapping):
            raise ConfigError(f"{key}={t!r}: expected a mapping")
        unknown = set(t) - _JOB_KEYS
        if unknown:
            raise ConfigError(f"{key}: unknown key(s) {sorted(unknown)}")
        out.extend(_template(key, t, duration_s, rng))
    out.sort(key=lambda j: (j.arrive_s, j.name))
    return tuple(out)


def _arrivals(
    key: str, raw: Any, count: int | None, duration_s: float, rng: random.Random
) -> list[float]:
    if raw is None:
        raw = {"at": 0}
    if not isinstance(raw, Mapping) or len(raw) != 1:
        raise ConfigError(f"{key}.arrive={raw!r}: expected one of at, daily_at, poisson_per_day")
    ((kind, v),) = raw.items()
    if kind == "at":
        times = [duration(f"{key}.arrive.at", v)] * (count or 1)
    elif kind == "daily_at":
        first = clock(f"{key}.arrive.daily_at", v)
        days = math.ceil(duration_s / DAY_S) + 1
        times = [first + d * DAY_S for d in range(days) if first + d * DAY_S < duration_s]
        if count is not None:
            times = times[:count]
    elif kind == "poisson_per_day":
        rate = number(f"{key}.arrive.poisson_per_day", v, 1e-9)
        if count is None:
            raise ConfigError(f"{key}: poisson arrivals need a count")
        t, times = 0.0, []
        for _ in range(count):
            t += rng.expovariate(rate / DAY_S)
            times.append(t % duration_s)
    else:
        raise ConfigError(f"{key}.arrive: unknown kind {kind!r} (at, daily_at, poisson_per_day)")
    return sorted(times)


def _template(
    key: str, t: Mapping[str, Any], duration_s: float, rng: random.Random
) -> list[JobSpec]:
    count = integer(f"{key}.count", t["count"], 1, 100_000) if "count" in t else None
    name = str(t.get("name") or f"job{key[5:-1]}")
    times = _arrivals(key, t.get("arrive"), count, duration_s, rng)
    curves = _curves(key, t)
    mn = integer(f"{key}.min_replicas", t.get("min_replicas", 1), 1)
    mx = integer(f"{key}.max_replicas", t.get("max_replicas", 8), mn)
    initial = integer(f"{key}.initial_replicas", t.get("initial_replicas", mn), mn, mx)
    static = integer(f"{key}.static_replicas", t.get("static_replicas", mx), 1)
    work = t.get("work")
    if not isinstance(work, Mapping) or not ({"samples"} <= set(work) or {"hours"} <= set(work)):
        raise ConfigError(f"{key}.work={work!r}: expected samples: N, or hours: H (at_replicas: R)")
    input_raw = t.get("input_per_s")
    out = []
    for n, arrive in enumerate(times):
        weights, choices = zip(*curves, strict=True)
        curve = rng.choices(choices, weights)[0]
        if "samples" in work:
            samples = number(f"{key}.work.samples", work["samples"], 1.0)
        else:
            hours = number(f"{key}.work.hours", work["hours"], 1e-6)
            spread = number(f"{key}.work.spread", work.get("spread", 0.0), 0.0, 3.0)
            if spread:
                hours *= math.exp(rng.gauss(0.0, spread))
            at = integer(f"{key}.work.at_replicas", work.get("at_replicas", initial), 1)
            samples = hours * 3600 * curve.at(at)
        out.append(
            JobSpec(
                name=f"{name}-{n}" if len(times) > 1 else name,
                arrive_s=arrive,
                work_samples=samples,
                curve=curve,
                min_replicas=mn,
                max_replicas=mx,
                initial_replicas=initial,
                static_replicas=static,
                gpus_per_replica=integer(
                    f"{key}.gpus_per_replica", t.get("gpus_per_replica", 1), 1
                ),
                checkpoint_interval_s=duration(
                    f"{key}.checkpoint_interval", t.get("checkpoint_interval", 1800)
                ),
                global_batch=integer(f"{key}.global_batch", t.get("global_batch", 1024), 1),
                busy_util_pct=number(f"{key}.busy_util_pct", t.get("busy_util_pct", 95.0), 0, 100),
                input_per_s=parse_daily(f"{key}.input_per_s", input_raw) if input_raw else None,
                sm_active_ratio=_ratio(t, key, "sm_active_ratio"),
                tensor_active_ratio=_ratio(t, key, "tensor_active_ratio"),
            )
        )
    return out


def _curves(key: str, t: Mapping[str, Any]) -> Sequence[tuple[float, Curve]]:
    if "curves" in t:
        raw = t["curves"]
        if not isinstance(raw, list) or not raw:
            raise ConfigError(f"{key}.curves: expected [{{weight: w, curve: {{...}}}}, ...]")
        out = []
        for i, c in enumerate(raw):
            if not isinstance(c, Mapping) or "curve" not in c:
                raise ConfigError(f"{key}.curves[{i}]={c!r}: expected weight and curve")
            out.append(
                (
                    number(f"{key}.curves[{i}].weight", c.get("weight", 1.0), 1e-9),
                    parse_curve(f"{key}.curves[{i}].curve", c["curve"]),
                )
            )
        return out
    return [(1.0, parse_curve(f"{key}.curve", t.get("curve", {})))]


def describe(s: Scenario) -> dict[str, Any]:
    """The scenario's parameters as the simulation used them (for reports)."""
    return {
        "name": s.name,
        "variant": s.variant or None,
        "duration_s": s.duration_s,
        "seed": s.seed,
        "pool_gpus": s.pool.gpus,
        "jobs": len(s.jobs),
        "policies": list(s.policies),
        "tide_policy": dataclasses.asdict(s.tide.policy),
        "pauses": dataclasses.asdict(s.pauses),
        "hpa": dataclasses.asdict(s.hpa),
        "pricing": dataclasses.asdict(s.pricing),
        "pool_rule": PoolRule.MARGINAL.value,
    }


__all__ = [
    "POLICIES",
    "Background",
    "Curve",
    "Daily",
    "Hpa",
    "JobSpec",
    "Pauses",
    "Pool",
    "Pricing",
    "Scenario",
    "Tide",
    "describe",
    "load",
    "parse",
]
