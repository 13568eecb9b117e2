"""The policy's inputs and outputs: the settings, what it sees of a job (its state,
window and history) and the decision it gives. tide/services/scaler/policy.py is the
rules over them; ``policy`` re-exports every name here.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from tide.base.errors import ConfigError


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
    THROUGHPUT_GAINING = 9
    THROUGHPUT_STALLED = 10
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
    NO_SIGNAL = 33

    @property
    def resizes(self) -> bool:
        return self.value < 20

    @property
    def grows(self) -> bool:
        """A grow the policy asked for on the job's signal (the pool shares free GPUs
        among these)."""
        return self in _GROWS


_GROWS = frozenset({Reason.SUSTAINED_HIGH_UTILIZATION, Reason.THROUGHPUT_GAINING})


class Signal(enum.Enum):
    """What a job scales on (docs/policy.md "Signals")."""

    #: NVML's GPU utilization: some kernel ran during the sample period.
    UTILIZATION = "utilization"
    #: NVML GPM SM activity: the fraction of time warps were resident on the SMs.
    SM_ACTIVE = "sm_active"
    #: NVML GPM tensor activity: the fraction of cycles a tensor pipe was busy.
    TENSOR_ACTIVE = "tensor_active"
    #: The job's own samples/s by replica count (tide/services/scaler/goodput.py).
    THROUGHPUT = "throughput"

    @property
    def gpm(self) -> bool:
        """Measured by NVML GPM, which only some GPUs have."""
        return self in (Signal.SM_ACTIVE, Signal.TENSOR_ACTIVE)


#: The signals whose windows hold a percentage per bucket, and the prefix of their
#: settings' names (scale_up_<prefix>_pct, scale_down_<prefix>_pct, target_<prefix>_pct).
PERCENT_SIGNALS = (Signal.UTILIZATION, Signal.SM_ACTIVE, Signal.TENSOR_ACTIVE)


class Trigger(enum.Enum):
    """What started a decision. Values equal tide.v1.DecisionTrigger."""

    POLICY = 1
    MANUAL = 2
    EMERGENCY = 3
    RECONCILE = 4


@dataclass(frozen=True)
class PolicySettings:
    """Effective policy of one job. Each default is written here only (ScalerSettings
    holds the scaler's default policy as one grouped setting: each field a flag of its
    own); docs/policy.md lists them."""

    scale_up_utilization_pct: float = field(default=80.0, metadata={"help": "see docs/policy.md"})
    scale_down_utilization_pct: float = 40.0
    sustain_s: float = 300.0
    bucket_s: float = 30.0
    cooldown_s: float = 300.0
    phase_timeout_s: float = field(default=60.0, metadata={"help": "each resize phase's deadline"})
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
    min_scale_up_efficiency: float = field(
        default=0.5, metadata={"help": "the goodput guard (0 turns it off)"}
    )
    signal: str = field(
        default=Signal.UTILIZATION.value,
        metadata={
            "help": "what the job scales on: utilization, sm_active, tensor_active, "
            "throughput (docs/policy.md)"
        },
    )
    # NVIDIA's guidance on DCGM's SM activity: >= 80 % is needed for the GPU to be
    # used well, < 50 % likely means it is not (docs/policy.md "Signals").
    scale_up_sm_active_pct: float = 80.0
    scale_down_sm_active_pct: float = 50.0
    target_sm_active_pct: float = 65.0
    # Tensor-pipe activity of dense mixed-precision training sits well below its SM
    # activity; Tide's defaults, to calibrate with `tide simulate` (docs/policy.md).
    scale_up_tensor_active_pct: float = 60.0
    scale_down_tensor_active_pct: float = 25.0
    target_tensor_active_pct: float = 40.0
    # The throughput signal shrinks back when the last grow gave less than this per
    # added replica, as a fraction of a replica's throughput (it stopped gaining).
    stalled_efficiency: float = 0.1
    # Replicas move in whole groups of this many: the pods one model-parallel group of
    # the job spans (docs/sharded.md "Layouts"); 1 where each pod holds whole groups.
    replica_multiple: int = field(
        default=1, metadata={"help": "replicas move in groups of this many (docs/sharded.md)"}
    )

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"policy.{name}={getattr(self, name)!r}: {why}")

        if self.signal not in {x.value for x in Signal}:
            raise bad("signal", f"must be one of {', '.join(x.value for x in Signal)}")
        for sig in PERCENT_SIGNALS:
            up, down, target = (
                f"{k}_{sig.value}_pct" for k in ("scale_up", "scale_down", "target")
            )
            for name in (up, down, target):
                v = getattr(self, name)
                if not (0.0 <= v <= 100.0):
                    raise bad(name, "must be a percentage 0..100")
            if not getattr(self, down) < getattr(self, up):
                raise bad(down, f"must be below {up}")
            t = getattr(self, target)
            if not (getattr(self, down) <= t <= getattr(self, up)) or t <= 0:
                raise bad(target, "must lie within the scale-down..scale-up band")
        if not (0.0 <= self.stalled_efficiency <= 1.0):
            raise bad("stalled_efficiency", "must be a fraction 0..1")
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
        m = self.replica_multiple
        if m < 1:
            raise bad("replica_multiple", "must be >= 1")
        for name in ("min_replicas", "max_replicas", "max_step"):
            if getattr(self, name) % m:
                raise bad(name, f"must be a multiple of replica_multiple={m}")

    @property
    def scaled_on(self) -> Signal:
        return Signal(self.signal)

    @property
    def band(self) -> tuple[float, float, float]:
        """(scale_down, target, scale_up) percent of the job's signal; the utilization
        band for the throughput signal, whose window still shows utilization."""
        sig = self.scaled_on
        key = sig.value if sig in PERCENT_SIGNALS else Signal.UTILIZATION.value
        return (
            getattr(self, f"scale_down_{key}_pct"),
            getattr(self, f"target_{key}_pct"),
            getattr(self, f"scale_up_{key}_pct"),
        )

    def whole_down(self, replicas: int) -> int:
        """``replicas`` rounded down to whole groups (``replica_multiple``)."""
        return replicas - replicas % self.replica_multiple

    def whole_up(self, replicas: int) -> int:
        """``replicas`` rounded up to whole groups (``replica_multiple``)."""
        return -(-replicas // self.replica_multiple) * self.replica_multiple

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
    """What the policy sees of a job's window of its signal (utilization, SM or tensor
    activity; utilization for the throughput signal).

    ``bucket_means`` are the complete buckets ending at ``end_s`` (oldest
    first), NaN where a bucket had no sample (or, for a GPM signal, no sample with
    it); ``end_s`` is a bucket boundary.
    """

    bucket_s: float
    end_s: float
    bucket_means: tuple[float, ...]
    gpus_expected: int
    gpus_fresh: int
    #: The same buckets' means of SM and tensor activity over the samples that carried
    #: NVML GPM, NaN where none did; () when the window keeps none (all NaN).
    sm_active_means: tuple[float, ...] = ()
    tensor_active_means: tuple[float, ...] = ()
    #: Per bucket, the fraction of its samples that carried GPM (NaN: no sample). A
    #: GPU that cannot measure it lowers it: the policy refuses (NO_SIGNAL) rather
    #: than read a missing figure as zero.
    gpm_fractions: tuple[float, ...] = ()

    @property
    def coverage(self) -> float:
        if self.gpus_expected <= 0:
            return 0.0
        return min(1.0, self.gpus_fresh / self.gpus_expected)

    def bucket_start(self, i: int) -> float:
        """Start time of bucket ``i`` of ``bucket_means``."""
        return self.end_s - (len(self.bucket_means) - i) * self.bucket_s

    def means_of(self, signal: Signal) -> tuple[float, ...]:
        """The buckets' means of ``signal`` (utilization for the throughput signal)."""
        if signal is Signal.SM_ACTIVE:
            got = self.sm_active_means
        elif signal is Signal.TENSOR_ACTIVE:
            got = self.tensor_active_means
        else:
            return self.bucket_means
        return got or (math.nan,) * len(self.bucket_means)

    def unmeasured(self, n: int, min_fraction: float) -> int:
        """Of the last ``n`` buckets with samples, those in which fewer than
        ``min_fraction`` of the samples carried GPM."""
        fr = (
            self.gpm_fractions[-n:]
            if self.gpm_fractions
            else (0.0,) * min(n, len(self.bucket_means))
        )
        means = self.bucket_means[-n:]
        return sum(1 for f, m in zip(fr, means, strict=False) if m == m and not f >= min_fraction)

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


def fmt(x: float) -> str:
    """A figure as the policy's messages print it (NaN: an empty bucket)."""
    return "nan" if math.isnan(x) else f"{x:.1f}"


def smallest_grow_gpus(job: JobState, policy: PolicySettings) -> str:
    """The GPUs the smallest grow needs, as a NO_CAPACITY message says it."""
    if policy.replica_multiple == 1:
        return f"{job.gpus_per_replica} per replica"
    step = policy.whole_up(job.current_replicas + 1) - job.current_replicas
    return f"{step * job.gpus_per_replica} for a whole group of {policy.replica_multiple} replicas"


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
    # (replicas, samples/s) measured at each size the job ran at (tide/services/scaler/goodput.py).
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
