"""The scaling policy: a pure function from a job's situation to a decision.

No I/O and no clock reads: everything the policy looks at is an argument, so
the same inputs always give the same answer and `tide explain` can replay it.
docs/policy.md spells out every rule, its order and the defaults.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from services.scaler.goodput import efficiency
from tidebase.errors import ConfigError, FailedPrecondition, InvalidArgument


class Reason(enum.Enum):
    """Why the policy did (or did not) resize. Values equal tide.v1.DecisionReason."""

    SUSTAINED_HIGH_UTILIZATION = 1
    SUSTAINED_LOW_UTILIZATION = 2
    NODE_TERMINATION = 3
    MANUAL = 4
    MEMBER_LOST = 5
    JOB_STARTED = 6
    SLOWER_AFTER_SCALE_UP = 7
    RECONCILE = 8
    WITHIN_BAND = 20
    NOT_SUSTAINED = 21
    COOLDOWN = 22
    INSUFFICIENT_COVERAGE = 23
    STALE_DATA = 24
    AT_MAX_REPLICAS = 25
    AT_MIN_REPLICAS = 26
    NO_CAPACITY = 27
    PAUSED = 28
    RESIZE_IN_PROGRESS = 29
    STABILIZING = 30
    LOW_MARGINAL_THROUGHPUT = 31
    POOL_CONTENDED = 32

    @property
    def resizes(self) -> bool:
        return self.value < 20


class Trigger(enum.Enum):
    """What started a decision. Values equal tide.v1.DecisionTrigger."""

    POLICY = 1
    MANUAL = 2
    EMERGENCY = 3
    RECONCILE = 4


@dataclass(frozen=True)
class PolicySettings:
    """Effective policy of one job. Each default is written here only (ScalerSettings
    takes them as its flags' defaults); docs/policy.md lists them."""

    scale_up_utilization_pct: float = 80.0
    scale_down_utilization_pct: float = 40.0
    sustain_s: float = 300.0
    bucket_s: float = 30.0
    cooldown_s: float = 300.0
    phase_timeout_s: float = 60.0
    min_replicas: int = 2
    max_replicas: int = 8
    min_coverage: float = 0.8
    # HPA's default scale-up policy allows +4 pods per period; the same cap here.
    max_step: int = 4
    scale_down_stabilization_s: float = 60.0
    # Between the two thresholds, so a resize lands the job inside the band
    # instead of across the opposite threshold (the root of flapping).
    target_utilization_pct: float = 60.0
    # The goodput guard: a scale-up must give, per added replica, at least this
    # fraction of the throughput per replica the job had (0 turns the guard off).
    # GPU utilization cannot tell: NCCL kernels keep a GPU "busy" while it waits.
    min_scale_up_efficiency: float = 0.5

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"policy.{name}={getattr(self, name)!r}: {why}")

        for name in (
            "scale_up_utilization_pct",
            "scale_down_utilization_pct",
            "target_utilization_pct",
        ):
            v = getattr(self, name)
            if not (0.0 <= v <= 100.0):
                raise bad(name, "must be a percentage 0..100")
        if not self.scale_down_utilization_pct < self.scale_up_utilization_pct:
            raise bad("scale_down_utilization_pct", "must be below scale_up_utilization_pct")
        if (
            not (
                self.scale_down_utilization_pct
                <= self.target_utilization_pct
                <= self.scale_up_utilization_pct
            )
            or self.target_utilization_pct <= 0
        ):
            raise bad("target_utilization_pct", "must lie within the scale-down..scale-up band")
        if not (self.bucket_s > 0 and math.isfinite(self.bucket_s)):
            raise bad("bucket_s", "must be > 0")
        if not (self.sustain_s > 0 and math.isfinite(self.sustain_s)):
            raise bad("sustain_s", "must be > 0")
        n = self.sustain_s / self.bucket_s
        if abs(n - round(n)) > 1e-9 or round(n) < 1:
            raise bad("sustain_s", f"must be a positive multiple of bucket_s={self.bucket_s}")
        if round(n) > 10_000:
            raise bad("sustain_s", "needs more than 10000 buckets; raise bucket_s")
        for name in ("cooldown_s", "scale_down_stabilization_s"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise bad(name, "must be >= 0")
        if not (self.phase_timeout_s > 0 and math.isfinite(self.phase_timeout_s)):
            raise bad("phase_timeout_s", "must be > 0")
        if self.min_replicas < 1:
            raise bad("min_replicas", "must be >= 1")
        if self.max_replicas < self.min_replicas:
            raise bad("max_replicas", f"must be >= min_replicas={self.min_replicas}")
        if not (0.0 <= self.min_coverage <= 1.0):
            raise bad("min_coverage", "must be a fraction 0..1")
        if not (0.0 <= self.min_scale_up_efficiency <= 1.0):
            raise bad("min_scale_up_efficiency", "must be a fraction 0..1")
        if self.max_step < 1:
            raise bad("max_step", "must be >= 1")

    @property
    def buckets(self) -> int:
        """Buckets in the sustain window."""
        return round(self.sustain_s / self.bucket_s)

    def with_overrides(self, overrides: dict[str, Any]) -> PolicySettings:
        """These settings with the given fields replaced (unknown names are an error)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"policy: unknown field(s) {unknown}")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class WindowView:
    """What the policy sees of a job's utilization window.

    ``bucket_means`` are the complete buckets ending at ``end_s`` (oldest
    first), NaN where a bucket had no sample; ``end_s`` is a bucket boundary.
    """

    bucket_s: float
    end_s: float
    bucket_means: tuple[float, ...]
    gpus_expected: int
    gpus_fresh: int

    @property
    def coverage(self) -> float:
        if self.gpus_expected <= 0:
            return 0.0
        return min(1.0, self.gpus_fresh / self.gpus_expected)

    def bucket_start(self, i: int) -> float:
        """Start time of bucket ``i`` of ``bucket_means``."""
        return self.end_s - (len(self.bucket_means) - i) * self.bucket_s

    @property
    def mean_pct(self) -> float:
        vals = [m for m in self.bucket_means if not math.isnan(m)]
        return sum(vals) / len(vals) if vals else math.nan


@dataclass(frozen=True)
class JobState:
    """The job as the policy needs it."""

    job_id: str
    current_replicas: int
    gpus_per_replica: int = 1
    paused: bool = False
    resize_in_progress: bool = False
    # GPUs free in the cluster; None when the actuator cannot tell.
    free_gpus: int | None = None
    # Replicas on nodes that announced termination, with the earliest deadline.
    terminating_replicas: int = 0
    terminating_node: str = ""
    terminating_deadline_s: float | None = None
    # Those pods (uids or names, as the agents reported them).
    terminating_pods: frozenset[str] = frozenset()
    # The decision in flight (0: none) and, when it is a preemption, the pods it drains.
    in_flight_decision: int = 0
    in_flight_leaving: frozenset[str] | None = None


@dataclass(frozen=True)
class History:
    """What happened before: the last resize, the recent recommendations and the
    training throughput measured at each size."""

    last_resize_end_s: float | None = None
    # +1 grow, -1 shrink, 0 none.
    last_direction: int = 0
    # (time, replicas) recommended by earlier evaluations, for stabilization.
    recommendations: tuple[tuple[float, int], ...] = ()
    # Replicas before the last completed resize; 0 when unknown.
    last_from_replicas: int = 0
    # (replicas, samples/s) measured at each size the job ran at (services/scaler/goodput.py).
    throughput: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Decision:
    """The outcome of one evaluation. Persist it only when ``resize`` is true."""

    job_id: str
    reason: Reason
    message: str
    from_replicas: int
    to_replicas: int
    trigger: Trigger = Trigger.POLICY
    # What the proportional rule asked for before clamping; 0 when not computed.
    raw_target: int = 0
    # The clamped proportional answer, recorded by the caller for stabilization.
    recommendation: int | None = None
    # What a grow asked for before the free-GPU cap (the pool step shares GPUs by it).
    wanted_replicas: int = 0
    # Evidence beyond the window and the policy (goodput, pool), stored with the decision.
    inputs: dict[str, Any] = field(default_factory=dict)
    # A preemption that must first abort this decision in flight (0: none); the
    # caller aborts it and evaluates again once it is final.
    supersedes: int = 0

    @property
    def resize(self) -> bool:
        return self.reason.resizes and self.to_replicas != self.from_replicas

    @property
    def direction(self) -> int:
        return (self.to_replicas > self.from_replicas) - (self.to_replicas < self.from_replicas)


def proportional(current: int, util_pct: float, target_pct: float) -> int:
    """ceil(current × util / target), the HPA rule."""
    # A tiny epsilon keeps 4 × 60 / 60 at 4 despite binary floating point.
    return max(1, math.ceil(current * util_pct / target_pct - 1e-9))


def _fmt(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.1f}"


def sustained(window: WindowView, policy: PolicySettings) -> int:
    """+1 when every bucket of the sustain window is above ``scale_up``, -1 when every
    one is below ``scale_down``, else 0 (also for a short window or an empty bucket).
    The scaler asks this of every slot a job's window slides by, and evaluates the
    job when it is not 0 (``decide`` has the final word)."""
    n = policy.buckets
    if window.bucket_s != policy.bucket_s or len(window.bucket_means) < n:
        return 0
    means = window.bucket_means[-n:]
    # NaN compares false both ways: an empty bucket is never "above" nor "below".
    if all(m > policy.scale_up_utilization_pct for m in means):
        return 1
    if all(m < policy.scale_down_utilization_pct for m in means):
        return -1
    return 0


def goodput_evidence(
    curve: Mapping[int, float],
    policy: PolicySettings,
    compared: int,
    eff: float | None,
    verdict: str,
) -> dict[str, Any]:
    """What the goodput guard saw, stored in the decision's inputs for `tide explain`."""
    return {
        "throughput_by_replicas": {str(r): v for r, v in sorted(curve.items())},
        "compared_replicas": compared,
        "efficiency": eff,
        "min_scale_up_efficiency": policy.min_scale_up_efficiency,
        "verdict": verdict,
    }


def decide(
    job: JobState,
    window: WindowView,
    policy: PolicySettings,
    history: History,
    now: float,
) -> Decision:
    """Evaluate ``job`` at time ``now``; see docs/policy.md for the rule order."""
    cur = job.current_replicas

    def noop(
        reason: Reason,
        message: str,
        rec: int | None = None,
        raw: int = 0,
        inputs: dict[str, Any] | None = None,
    ) -> Decision:
        return Decision(
            job.job_id,
            reason,
            message,
            cur,
            cur,
            raw_target=raw,
            recommendation=rec,
            inputs=inputs or {},
        )

    if job.terminating_replicas > 0:
        # The node goes whatever we do; a coordinated checkpoint beats lost work,
        # so neither cooldown, pause nor min_replicas holds this back (floor 1).
        to = max(1, cur - job.terminating_replicas)
        message = (
            f"node {job.terminating_node or '?'} is terminating with "
            f"{job.terminating_replicas} replica(s) of the job: shrink {cur} -> {to}"
        )
        if to < cur and not job.resize_in_progress:
            return Decision(
                job.job_id,
                Reason.NODE_TERMINATION,
                message,
                cur,
                to,
                trigger=Trigger.EMERGENCY,
                raw_target=to,
            )
        covered = job.in_flight_leaving is not None and job.terminating_pods <= (
            job.in_flight_leaving
        )
        if to < cur and job.in_flight_decision and not covered:
            # A grow or shrink in flight (or a preemption of fewer pods) would hold the
            # leave back past the node's deadline: it is aborted, and the leave that
            # follows names every noticed pod at once (two nodes' notices, one leave).
            return Decision(
                job.job_id,
                Reason.NODE_TERMINATION,
                f"{message}, after aborting decision {job.in_flight_decision} in flight",
                cur,
                to,
                trigger=Trigger.EMERGENCY,
                raw_target=to,
                supersedes=job.in_flight_decision,
            )
    if job.resize_in_progress:
        return noop(Reason.RESIZE_IN_PROGRESS, "another decision of this job is not final yet")
    if job.paused:
        return noop(Reason.PAUSED, "autoscaling is paused for this job")
    if history.last_resize_end_s is not None:
        left = history.last_resize_end_s + policy.cooldown_s - now
        if left > 0:
            return noop(
                Reason.COOLDOWN,
                f"last resize ended {now - history.last_resize_end_s:.0f}s ago; "
                f"cooldown {policy.cooldown_s:.0f}s ({left:.0f}s left)",
            )
    curve = dict(history.throughput)
    reverted = _revert_if_slower(job, policy, history, curve)
    if reverted is not None:
        return reverted
    if window.gpus_fresh <= 0:
        return noop(
            Reason.STALE_DATA,
            f"no fresh sample from any of the job's {window.gpus_expected} GPU(s)",
        )
    cov = window.coverage
    if cov < policy.min_coverage:
        return noop(
            Reason.INSUFFICIENT_COVERAGE,
            f"coverage {cov:.2f} ({window.gpus_fresh}/{window.gpus_expected} GPUs fresh) "
            f"< min_coverage {policy.min_coverage:.2f}",
        )

    n = policy.buckets
    means = window.bucket_means[-n:] if window.bucket_s == policy.bucket_s else ()
    valid = [m for m in means if not math.isnan(m)]
    latest = valid[-1] if valid else math.nan
    rec = None
    raw = 0
    if valid:
        mean = sum(valid) / len(valid)
        raw = proportional(cur, mean, policy.target_utilization_pct)
        rec = min(policy.max_replicas, max(policy.min_replicas, raw))
    if len(means) < n or len(valid) < n:
        return noop(
            Reason.NOT_SUSTAINED,
            f"{len(valid)} of {n} buckets of {policy.bucket_s:.0f}s have samples",
            rec,
            raw,
        )
    direction = sustained(window, policy)
    high, low = direction > 0, direction < 0
    if high or low:
        # Samples from before the last resize describe another world size; a
        # reversal also waits out the cooldown so it never chases the transient.
        start = window.bucket_start(len(window.bucket_means) - n)
        if history.last_resize_end_s is not None:
            since = history.last_resize_end_s
            if history.last_direction == -direction:
                since += policy.cooldown_s
            if start < since - 1e-9:
                return noop(
                    Reason.NOT_SUSTAINED,
                    f"the {policy.sustain_s:.0f}s window starts before the last resize "
                    f"(or its cooldown, for a reversal) at {since:.0f}",
                    rec,
                    raw,
                )
    mean = sum(means) / n
    band = f"{policy.scale_down_utilization_pct:.0f}..{policy.scale_up_utilization_pct:.0f}%"
    if not high and not low:
        if latest > policy.scale_up_utilization_pct or latest < policy.scale_down_utilization_pct:
            return noop(
                Reason.NOT_SUSTAINED,
                f"latest bucket {_fmt(latest)}% is outside {band} but not every bucket of "
                f"the {policy.sustain_s:.0f}s window is (min {_fmt(min(means))}, "
                f"max {_fmt(max(means))})",
                rec,
                raw,
            )
        return noop(Reason.WITHIN_BAND, f"mean {_fmt(mean)}% is within {band}", rec, raw)

    raw = proportional(cur, mean, policy.target_utilization_pct)
    if high:
        if cur >= policy.max_replicas:
            return noop(
                Reason.AT_MAX_REPLICAS,
                f"every bucket above {policy.scale_up_utilization_pct:.0f}% "
                f"(mean {_fmt(mean)}%) but already at max_replicas {policy.max_replicas}",
                rec,
                raw,
            )
        to = min(max(raw, cur + 1), policy.max_replicas, cur + policy.max_step)
        guard, goodput = _guard_grow(cur, to, curve, policy)
        if guard is None:
            return noop(
                Reason.LOW_MARGINAL_THROUGHPUT,
                f"every bucket above {policy.scale_up_utilization_pct:.0f}% "
                f"(mean {_fmt(mean)}%) but {goodput['note']}",
                rec,
                raw,
                {"goodput": goodput["evidence"]},
            )
        cap_note = goodput.get("note", "")
        cap_note = f", {cap_note}" if cap_note and guard < to else ""
        to = wanted = guard
        extra = {"goodput": goodput["evidence"]} if goodput else {}
        if job.free_gpus is not None:
            room = job.free_gpus // max(1, job.gpus_per_replica)
            if room <= 0:
                return replace(
                    noop(
                        Reason.NO_CAPACITY,
                        f"every bucket above {policy.scale_up_utilization_pct:.0f}% "
                        f"(mean {_fmt(mean)}%) but {job.free_gpus} free GPU(s) < "
                        f"{job.gpus_per_replica} per replica",
                        rec,
                        raw,
                        extra,
                    ),
                    wanted_replicas=wanted,
                )
            if cur + room < to:
                to = cur + room
                cap_note += f", capped by {job.free_gpus} free GPU(s)"
        return Decision(
            job.job_id,
            Reason.SUSTAINED_HIGH_UTILIZATION,
            f"every {policy.bucket_s:.0f}s bucket of the last {policy.sustain_s:.0f}s above "
            f"{policy.scale_up_utilization_pct:.0f}% (mean {_fmt(mean)}%, min "
            f"{_fmt(min(means))}%): ceil({cur} x {_fmt(mean)} / "
            f"{policy.target_utilization_pct:.0f}) = {raw}, grow {cur} -> {to}{cap_note}",
            cur,
            to,
            raw_target=raw,
            recommendation=rec,
            wanted_replicas=wanted,
            inputs=extra,
        )

    if cov < 1.0:
        return noop(
            Reason.INSUFFICIENT_COVERAGE,
            f"every bucket below {policy.scale_down_utilization_pct:.0f}% but only "
            f"{window.gpus_fresh}/{window.gpus_expected} GPUs are fresh; partial data "
            "never scales down",
            rec,
            raw,
        )
    if cur <= policy.min_replicas:
        return noop(
            Reason.AT_MIN_REPLICAS,
            f"every bucket below {policy.scale_down_utilization_pct:.0f}% "
            f"(mean {_fmt(mean)}%) but already at min_replicas {policy.min_replicas}",
            rec,
            raw,
        )
    to = max(min(raw, cur - 1), policy.min_replicas, cur - policy.max_step)
    recent = [
        r for t, r in history.recommendations if now - policy.scale_down_stabilization_s <= t <= now
    ]
    stab = max(recent, default=to)
    if stab > to:
        to = min(cur, stab)
    if to >= cur:
        return noop(
            Reason.STABILIZING,
            f"every bucket below {policy.scale_down_utilization_pct:.0f}% but the highest "
            f"recommendation of the last {policy.scale_down_stabilization_s:.0f}s is {stab}",
            rec,
            raw,
        )
    return Decision(
        job.job_id,
        Reason.SUSTAINED_LOW_UTILIZATION,
        f"every {policy.bucket_s:.0f}s bucket of the last {policy.sustain_s:.0f}s below "
        f"{policy.scale_down_utilization_pct:.0f}% (mean {_fmt(mean)}%, max "
        f"{_fmt(max(means))}%): ceil({cur} x {_fmt(mean)} / "
        f"{policy.target_utilization_pct:.0f}) = {raw}, shrink {cur} -> {to}",
        cur,
        to,
        raw_target=raw,
        recommendation=rec,
    )


def _revert_if_slower(
    job: JobState, policy: PolicySettings, history: History, curve: Mapping[int, float]
) -> Decision | None:
    """The goodput guard's revert: the last resize grew the job and it trains slower."""
    cur = job.current_replicas
    frm = history.last_from_replicas
    if policy.min_scale_up_efficiency <= 0 or history.last_direction <= 0 or not 0 < frm < cur:
        return None
    eff = efficiency(curve, frm, cur)
    if eff is None or eff >= 0:
        return None
    to = max(frm, policy.min_replicas)
    if to >= cur:
        return None
    return Decision(
        job.job_id,
        Reason.SLOWER_AFTER_SCALE_UP,
        f"the grow {frm} -> {cur} made training slower ({curve[frm]:.1f} -> "
        f"{curve[cur]:.1f} samples/s): shrink back {cur} -> {to}",
        cur,
        to,
        raw_target=to,
        inputs={"goodput": goodput_evidence(curve, policy, frm, eff, "reverted")},
    )


def _guard_grow(
    cur: int, to: int, curve: Mapping[int, float], policy: PolicySettings
) -> tuple[int | None, dict[str, Any]]:
    """The goodput guard on a grow ``cur -> to``: the size it may grow to (None: not at
    all) and its evidence. A size above ``cur`` already measured with too little gain
    per added replica is not tried again; the grow is halved below it instead (a
    bisection towards the job's best size), and refused when nothing is left."""
    if policy.min_scale_up_efficiency <= 0 or cur not in curve:
        return to, {}
    above = sorted(s for s in curve if s > cur)
    below = sorted(s for s in curve if s < cur)
    if (not above or above[0] > to) and below:
        # Nothing measured above: the step that brought the job here predicts the next
        # one (gains shrink as a job grows); if it did not pay, growing on is not tried.
        a = below[-1]
        eff = efficiency(curve, a, cur)
        if eff is not None and eff < policy.min_scale_up_efficiency:
            ev = goodput_evidence(curve, policy, a, eff, "refused")
            why = (
                f"the grow {a} -> {cur} gave {_fmt(100 * eff)}% of a replica's throughput per "
                f"added replica ({curve[a]:.1f} -> {curve[cur]:.1f} samples/s; "
                f"min_scale_up_efficiency {policy.min_scale_up_efficiency:.2f})"
            )
            return None, {"evidence": ev, "note": f"{why}: growing on is not tried"}
    if not above or above[0] > to:
        return to, {"evidence": goodput_evidence(curve, policy, 0, None, "unmeasured")}
    s1 = above[0]
    eff = efficiency(curve, cur, s1)
    if eff is None or eff >= policy.min_scale_up_efficiency:
        return to, {"evidence": goodput_evidence(curve, policy, s1, eff, "paid")}
    half = cur + (s1 - cur) // 2
    why = (
        f"{cur} -> {s1} gave {_fmt(100 * eff)}% of a replica's throughput per added replica "
        f"({curve[cur]:.1f} -> {curve[s1]:.1f} samples/s; min_scale_up_efficiency "
        f"{policy.min_scale_up_efficiency:.2f})"
    )
    if half <= cur:
        ev = goodput_evidence(curve, policy, s1, eff, "refused")
        return None, {"evidence": ev, "note": f"the last {why}: not tried again"}
    ev = goodput_evidence(curve, policy, s1, eff, "halved")
    return half, {"evidence": ev, "note": f"halved below {s1}: {why}"}


def manual(job: JobState, policy: PolicySettings, replicas: int, why: str) -> Decision:
    """A resize an operator asked for, checked against the job's bounds."""
    if not why.strip():
        raise InvalidArgument("reason is required for a manual resize")
    if not (policy.min_replicas <= replicas <= policy.max_replicas):
        raise InvalidArgument(
            f"replicas={replicas} is outside the job's bounds "
            f"{policy.min_replicas}..{policy.max_replicas}"
        )
    if job.resize_in_progress:
        raise FailedPrecondition(f"job {job.job_id} has a decision that is not final yet")
    if replicas == job.current_replicas:
        raise FailedPrecondition(f"job {job.job_id} already runs {replicas} replica(s)")
    return Decision(
        job.job_id,
        Reason.MANUAL,
        why,
        job.current_replicas,
        replicas,
        trigger=Trigger.MANUAL,
        raw_target=replicas,
    )
