"""`tide whatif`: a job's recorded history replayed through the real window and policy
under another policy, on a simulated clock.

What is replayed: each second of the job's GPU utilization (the store keeps
``utilization_seconds`` for ``utilization_detail_retention_days``; older minutes
are spread evenly over their seconds), fed into a ``windows.JobWindow`` as the
scaler's ingestion would, and ``policy.decide`` every second at the end of that
second, with the same JobState and History the scaler builds (cooldown and
reversal from the replay's own resizes, stabilization from its own
recommendations, the goodput guard from the throughput evidence the job's real
decisions recorded, free GPUs as the real decisions recorded them).

What cannot be replayed is assumed, and said in the output: when the replay
runs a job at another size than it really ran, its GPUs show either the same
total work spread over its GPUs (``proportional``, the default: utilization ×
real replicas / replayed replicas, capped at 100 %, the proportional rule's own
assumption) or the same utilization (``same``: a compute-bound job keeps its GPUs
as busy at any size); a resize the job really made takes as long as it really
took (and ends as it really ended: COMPLETED or ABORTED); one it never made
takes the median of its real resizes that way (30 s if none). Decisions no
policy made (manual, job start, node notice) happen in the replay as they
happened.

Under the policy the job really ran with, the replay is its self-check: the
same inputs through the same code must give the same decisions.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tide.services.scaler import policy as pol
from tide.services.scaler.windows import JobWindow

#: A resize the job never really made takes this long when it made none that way.
DEFAULT_RESIZE_S = 30.0
#: The scaler's staleness limit (IngestSettings.stale_after_s): seconds without a sample
#: after which a GPU no longer counts as covered.
STALE_AFTER_S = 10.0
#: How utilization at another size is derived from the recorded one.
LOAD_MODELS = ("proportional", "same")
#: Policy reasons, the ones the replay re-derives; the others are replayed as recorded.
POLICY_REASONS = frozenset(
    {"SUSTAINED_HIGH_UTILIZATION", "SUSTAINED_LOW_UTILIZATION", "SLOWER_AFTER_SCALE_UP"}
)


@dataclass(frozen=True)
class Recorded:
    """A decision of the job as the store has it."""

    id: int
    created_s: float
    ended_s: float | None
    from_replicas: int
    to_replicas: int
    reason: str
    trigger: str
    state: str
    message: str = ""
    free_gpus: int | None = None
    throughput: tuple[tuple[int, float], ...] | None = None

    @property
    def by_policy(self) -> bool:
        return self.trigger == "POLICY" and self.reason in POLICY_REASONS

    @property
    def direction(self) -> int:
        return (self.to_replicas > self.from_replicas) - (self.to_replicas < self.from_replicas)


@dataclass(frozen=True)
class Second:
    """One second (or a longer stretch, from minutes without detail) of utilization."""

    t_s: float
    mean_pct: float
    samples: float
    length_s: float = 1.0


@dataclass(frozen=True)
class JobHistory:
    job_id: str
    gpus_per_replica: int
    start_s: float
    end_s: float
    replicas_at_start: int
    seconds: tuple[Second, ...]
    decisions: tuple[Recorded, ...]  # oldest first, including some before start_s
    # Seconds of the range covered by per-second detail (the rest came from minutes).
    detail_s: float = 0.0

    @property
    def data_end_s(self) -> float:
        """GPU-hours are counted up to the last recorded second: a job that stopped
        reporting (ended, or its scaler went away) holds nothing anyone measured."""
        if not self.seconds:
            return self.start_s
        last = self.seconds[-1]
        return min(self.end_s, last.t_s + last.length_s)


@dataclass
class Replayed:
    at_s: float
    from_replicas: int
    to_replicas: int
    reason: str
    message: str
    ended_s: float
    state: str = "COMPLETED"
    # The real decision it stands for (same sizes and reason, close in time), if any.
    matches: int | None = None


@dataclass
class ReplayResult:
    policy: pol.PolicySettings
    decisions: list[Replayed] = field(default_factory=list)
    replicas: list[tuple[float, int]] = field(default_factory=list)
    gpu_hours: float = 0.0
    evaluations: int = 0
    step_s: float = 1.0
    load_model: str = "proportional"
    unmatched_real: list[int] = field(default_factory=list)
    extra: int = 0

    @property
    def exact(self) -> bool:
        return not self.unmatched_real and self.extra == 0


def real_replicas(h: JobHistory) -> list[tuple[float, int]]:
    """The job's replica count over the range, from its completed decisions."""
    out = [(h.start_s, h.replicas_at_start)]
    for d in h.decisions:
        if d.state == "COMPLETED" and d.ended_s is not None and h.start_s < d.ended_s < h.end_s:
            out.append((d.ended_s, d.to_replicas))
    return out


def gpu_hours(steps: Sequence[tuple[float, int]], end_s: float, gpr: int) -> float:
    total = 0.0
    for (t0, n), (t1, _) in zip(steps, [*steps[1:], (end_s, 0)], strict=True):
        total += max(0.0, min(t1, end_s) - t0) * n * gpr
    return total / 3600.0


def _at(steps: Sequence[tuple[float, int]], t: float) -> int:
    n = steps[0][1]
    for s, v in steps:
        if s > t:
            break
        n = v
    return n


def _durations(h: JobHistory) -> dict[int, float]:
    """Median real resize duration per direction."""
    out: dict[int, float] = {}
    for direction in (1, -1):
        ds = [
            d.ended_s - d.created_s
            for d in h.decisions
            if d.direction == direction and d.ended_s is not None and d.state == "COMPLETED"
        ]
        out[direction] = statistics.median(ds) if ds else DEFAULT_RESIZE_S
    return out


def replay(
    h: JobHistory,
    policy: pol.PolicySettings,
    *,
    step_s: float = 1.0,
    tolerance_s: float | None = None,
    load_model: str = "proportional",
) -> ReplayResult:
    """Replay ``h`` under ``policy``; see the module docstring for what is assumed."""
    if load_model not in LOAD_MODELS:
        raise ValueError(load_model)
    p = policy
    gpr = h.gpus_per_replica
    res = ReplayResult(p, step_s=step_s, load_model=load_model)
    spread = load_model == "proportional"
    tol = tolerance_s if tolerance_s is not None else step_s + 1.0
    real = real_replicas(h)
    durations = _durations(h)
    window = JobWindow(p.bucket_s, p.buckets)
    before = [d for d in h.decisions if d.ended_s is not None and d.ended_s <= h.start_s]
    last = next((d for d in reversed(before) if d.state == "COMPLETED"), None)
    last_any = before[-1] if before else None
    last_end = last_any.ended_s if last_any is not None else None
    last_dir = last.direction if last is not None else 0
    last_from = last.from_replicas if last is not None else 0
    replicas = h.replicas_at_start
    res.replicas.append((h.start_s, replicas))
    recs: deque[tuple[float, int]] = deque()
    external = [d for d in h.decisions if not d.by_policy and d.created_s >= h.start_s]
    policy_made = [d for d in h.decisions if d.by_policy and h.start_s <= d.created_s < h.end_s]
    evidence = [d for d in h.decisions if d.throughput is not None]
    frees = [d for d in h.decisions if d.free_gpus is not None and d.free_gpus >= 0]
    active: Replayed | None = None
    ext_i = 0
    lookback = p.sustain_s + 2 * p.bucket_s + p.scale_down_stabilization_s
    hot_until = -math.inf
    last_sample = -math.inf
    next_eval = h.start_s
    used_real: set[int] = set()

    def finish(t: float) -> None:
        nonlocal active, replicas, last_end, last_dir, last_from
        assert active is not None
        if active.state == "COMPLETED":
            last_dir = (active.to_replicas > active.from_replicas) - (
                active.to_replicas < active.from_replicas
            )
            last_from = active.from_replicas
            replicas = active.to_replicas
            res.replicas.append((t, replicas))
        last_end = t
        recs.clear()
        active = None

    for sec in h.seconds:
        t_end = sec.t_s + sec.length_s
        # What ended or happened before this second's end.
        while True:
            nxt_ext = external[ext_i] if ext_i < len(external) else None
            if (
                active is not None
                and active.ended_s <= t_end
                and (nxt_ext is None or active.ended_s <= nxt_ext.created_s)
            ):
                finish(active.ended_s)
                continue
            if nxt_ext is not None and nxt_ext.created_s <= t_end and active is None:
                ext_i += 1
                end = nxt_ext.ended_s if nxt_ext.ended_s is not None else nxt_ext.created_s
                active = Replayed(
                    nxt_ext.created_s,
                    replicas,
                    nxt_ext.to_replicas,
                    nxt_ext.reason,
                    nxt_ext.message,
                    end,
                    nxt_ext.state,
                    nxt_ext.id,
                )
                res.decisions.append(active)
                continue
            break
        # The second's samples, as the replayed size's GPUs would show the same work.
        real_n = _at(real, sec.t_s)
        util = sec.mean_pct
        if spread and real_n and replicas and real_n != replicas:
            util = min(100.0, util * real_n / replicas)
        if sec.samples > 0:
            w_n = max(1, round(sec.samples / sec.length_s))
            for k in range(max(1, int(sec.length_s))):
                ts = sec.t_s + k
                window.add(window.slot_of(ts), util * w_n, w_n)
            last_sample = t_end
            if util > p.scale_up_utilization_pct or util < p.scale_down_utilization_pct:
                hot_until = t_end + lookback
        t = t_end - 1e-3
        if t < next_eval or t >= h.end_s:
            continue
        if t > hot_until and active is None:
            continue  # nothing outside the band lately: no resize can come of it
        next_eval = t + step_s - 1e-6
        fresh = replicas * gpr if t - last_sample <= STALE_AFTER_S else 0
        curve = next((d.throughput for d in reversed(evidence) if d.created_s <= t), None) or ()
        free_rec = next((d.free_gpus for d in reversed(frees) if d.created_s <= t), None)
        free = None if free_rec is None else max(0, free_rec + (real_n - replicas) * gpr)
        state = pol.JobState(
            h.job_id, replicas, gpr, resize_in_progress=active is not None, free_gpus=free
        )
        view = window.view(t, p.buckets, replicas * gpr, fresh)
        hist = pol.History(last_end, last_dir, tuple(recs), last_from, curve)
        d = pol.decide(state, view, p, hist, t)
        res.evaluations += 1
        if d.recommendation is not None:
            recs.append((t, d.recommendation))
            while recs and recs[0][0] < t - p.scale_down_stabilization_s:
                recs.popleft()
        if not d.resize:
            continue
        match = _match(policy_made, used_real, d, t, tol)
        if match is not None:
            used_real.add(match.id)
            ended = match.ended_s if match.ended_s is not None else t
            active = Replayed(
                t,
                d.from_replicas,
                d.to_replicas,
                d.reason.name,
                d.message,
                ended + (t - match.created_s),
                match.state,
                match.id,
            )
        else:
            active = Replayed(
                t,
                d.from_replicas,
                d.to_replicas,
                d.reason.name,
                d.message,
                t + durations[d.direction],
            )
            res.extra += 1
        res.decisions.append(active)
    if active is not None and active.ended_s < h.end_s:
        finish(active.ended_s)
    res.unmatched_real = [d.id for d in policy_made if d.id not in used_real]
    res.gpu_hours = gpu_hours(res.replicas, h.data_end_s, gpr)
    return res


def _match(
    real: Sequence[Recorded], used: set[int], d: pol.Decision, t: float, tol: float
) -> Recorded | None:
    for r in real:
        if (
            r.id not in used
            and abs(r.created_s - t) <= tol
            and (r.from_replicas, r.to_replicas, r.reason)
            == (d.from_replicas, d.to_replicas, d.reason.name)
        ):
            return r
    return None


def summary(h: JobHistory, runs: Sequence[tuple[str, ReplayResult]]) -> dict[str, Any]:
    """The real history and each replay, as one JSON-ready document."""
    real = real_replicas(h)
    recorded = [d for d in h.decisions if h.start_s <= d.created_s < h.end_s]
    return {
        "job_id": h.job_id,
        "since_s": h.start_s,
        "until_s": h.end_s,
        "per_second_detail_s": h.detail_s,
        "real": {
            "gpu_hours": gpu_hours(real, h.data_end_s, h.gpus_per_replica),
            "decisions": [
                {
                    "id": d.id,
                    "at_s": d.created_s,
                    "from_replicas": d.from_replicas,
                    "to_replicas": d.to_replicas,
                    "reason": d.reason,
                    "state": d.state,
                }
                for d in recorded
            ],
        },
        "replays": [
            {
                "name": name,
                "policy": {k: getattr(r.policy, k) for k in r.policy.__dataclass_fields__},
                "gpu_hours": r.gpu_hours,
                "evaluations": r.evaluations,
                "step_s": r.step_s,
                "load_model": r.load_model,
                "reproduces_recorded": r.exact,
                "recorded_not_reproduced": r.unmatched_real,
                "decisions_not_recorded": r.extra,
                "decisions": [
                    {
                        "at_s": x.at_s,
                        "from_replicas": x.from_replicas,
                        "to_replicas": x.to_replicas,
                        "reason": x.reason,
                        "state": x.state,
                        "recorded_id": x.matches,
                        "message": x.message,
                    }
                    for x in r.decisions
                ],
            }
            for name, r in runs
        ],
    }
