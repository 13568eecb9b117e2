"""The scaling policy: a pure function from a job's situation to a decision.

No I/O and no clock reads: everything the policy looks at is an argument, so
the same inputs always give the same answer and `tide explain` can replay it.
docs/policy.md spells out every rule, its order and the defaults.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from tide.base.errors import FailedPrecondition, InvalidArgument
from tide.services.scaler.goodput_guard import goodput_evidence, guard_grow, revert_if_slower
from tide.services.scaler.policy_model import (
    Decision,
    History,
    JobState,
    PolicySettings,
    Reason,
    Signal,
    Trigger,
    WindowView,
    fmt,
    smallest_grow_gpus,
)
from tide.services.scaler.throughput_rule import decide_on_throughput

__all__ = [
    "Decision",
    "History",
    "JobState",
    "PolicySettings",
    "Reason",
    "Signal",
    "Trigger",
    "WindowView",
    "answer_holds_until",
    "decide",
    "goodput_evidence",
    "inputs_key",
    "manual",
    "proportional",
    "signal_evidence",
    "sustained",
]


def proportional(current: int, util_pct: float, target_pct: float) -> int:
    """ceil(current × util / target), the HPA rule."""
    # A tiny epsilon keeps 4 × 60 / 60 at 4 despite binary floating point.
    return max(1, math.ceil(current * util_pct / target_pct - 1e-9))


def _groups_note(policy: PolicySettings, asked: int, to: int) -> str:
    """What a decision's message says when whole groups moved its target."""
    if asked == to or policy.replica_multiple == 1:
        return ""
    return f" (not {asked}: replicas move in whole groups of {policy.replica_multiple})"


def sustained(window: WindowView, policy: PolicySettings) -> int:
    """+1 when every bucket of the sustain window is above ``scale_up``, -1 when every
    one is below ``scale_down``, else 0 (also for a short window or an empty bucket).
    The scaler asks this of every slot a job's window slides by, and evaluates the
    job when it is not 0 (``decide`` has the final word)."""
    n = policy.buckets
    sig = policy.scaled_on
    if window.bucket_s != policy.bucket_s or len(window.bucket_means) < n:
        return 0
    if sig is Signal.THROUGHPUT:
        return 0  # not a window's condition: the tick evaluates the job
    means = window.means_of(sig)[-n:]
    down, _, up = policy.band
    # NaN compares false both ways: an empty bucket is never "above" nor "below".
    if all(m > up for m in means):
        return 1
    if all(m < down for m in means):
        return -1
    return 0


def signal_evidence(window: WindowView, policy: PolicySettings) -> dict[str, Any]:
    """What the job scaled on, over which window, stored in a decision's inputs for
    `tide explain` (null for an empty bucket, as JSON has no NaN)."""
    sig = policy.scaled_on
    n = policy.buckets

    def clean(xs: tuple[float, ...]) -> list[float | None]:
        return [None if x != x else x for x in xs[-n:]]

    out: dict[str, Any] = {
        "name": sig.value,
        "bucket_s": window.bucket_s,
        "sustain_s": policy.sustain_s,
        "end_s": window.end_s,
    }
    if sig is Signal.THROUGHPUT:
        out["window"] = "the samples/s the job reported at each size (goodput)"
        return out
    down, target, up = policy.band
    out.update(
        bucket_means_pct=clean(window.means_of(sig)),
        scale_up_pct=up,
        scale_down_pct=down,
        target_pct=target,
    )
    if sig.gpm:
        out["gpm_fractions"] = clean(window.gpm_fractions)
    return out


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
        # A group a leaving pod breaks cannot train: its other pods leave with it.
        to = max(policy.replica_multiple, policy.whole_down(cur - job.terminating_replicas))
        message = (
            f"node {job.terminating_node or '?'} is terminating with "
            f"{job.terminating_replicas} replica(s) of the job: shrink {cur} -> {to}"
            f"{_groups_note(policy, cur - job.terminating_replicas, to)}"
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
    reverted = revert_if_slower(job, policy, history, curve)
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
    sig = policy.scaled_on
    if sig is Signal.THROUGHPUT:
        return decide_on_throughput(job, policy, curve, noop)
    if sig.gpm and window.bucket_s == policy.bucket_s:
        missing = window.unmeasured(n, policy.min_coverage)
        if missing:
            return noop(
                Reason.NO_SIGNAL,
                f"{sig.value} is not measured for the job's GPUs in {missing} of the last "
                f"{n} buckets (fewer than {policy.min_coverage:.2f} of the samples carried "
                "NVML GPM: a GPU before Hopper, or an old driver or agent); a missing "
                "reading is not taken as zero",
                inputs={"signal": signal_evidence(window, policy)},
            )
    down, target, up = policy.band
    all_means = window.means_of(sig)
    means = all_means[-n:] if window.bucket_s == policy.bucket_s else ()
    valid = [m for m in means if not math.isnan(m)]
    latest = valid[-1] if valid else math.nan
    rec = None
    raw = 0
    if valid:
        mean = sum(valid) / len(valid)
        raw = proportional(cur, mean, target)
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
        since = _window_must_start_after(window, policy, history)
        if since is not None and start < since - 1e-9:
            return noop(
                Reason.NOT_SUSTAINED,
                f"the {policy.sustain_s:.0f}s window starts before the last resize "
                f"(or its cooldown, for a reversal) at {since:.0f}",
                rec,
                raw,
            )
    mean = sum(means) / n
    band = f"{down:.0f}..{up:.0f}% {sig.value}"
    if not high and not low:
        if latest > up or latest < down:
            return noop(
                Reason.NOT_SUSTAINED,
                f"latest bucket {fmt(latest)}% is outside {band} but not every bucket of "
                f"the {policy.sustain_s:.0f}s window is (min {fmt(min(means))}, "
                f"max {fmt(max(means))})",
                rec,
                raw,
            )
        return noop(Reason.WITHIN_BAND, f"mean {fmt(mean)}% is within {band}", rec, raw)

    raw = proportional(cur, mean, target)
    if high:
        if cur >= policy.max_replicas:
            return noop(
                Reason.AT_MAX_REPLICAS,
                f"every bucket above {up:.0f}% {sig.value} "
                f"(mean {fmt(mean)}%) but already at max_replicas {policy.max_replicas}",
                rec,
                raw,
            )
        asked = min(max(raw, cur + policy.replica_multiple), policy.max_replicas)
        to = policy.whole_down(min(asked, cur + policy.max_step))
        guard, goodput = guard_grow(cur, to, curve, policy)
        if guard is None:
            return noop(
                Reason.LOW_MARGINAL_THROUGHPUT,
                f"every bucket above {up:.0f}% {sig.value} "
                f"(mean {fmt(mean)}%) but {goodput['note']}",
                rec,
                raw,
                {"goodput": goodput["evidence"]},
            )
        cap_note = goodput.get("note", "")
        cap_note = f", {cap_note}" if cap_note and guard < to else ""
        cap_note += _groups_note(policy, asked, to) if guard == to else ""
        to = wanted = guard
        extra = {"goodput": goodput["evidence"]} if goodput else {}
        if job.free_gpus is not None:
            fits = policy.whole_down(cur + job.free_gpus // max(1, job.gpus_per_replica))
            if fits <= cur:
                return replace(
                    noop(
                        Reason.NO_CAPACITY,
                        f"every bucket above {up:.0f}% {sig.value} "
                        f"(mean {fmt(mean)}%) but {job.free_gpus} free GPU(s) < "
                        f"{smallest_grow_gpus(job, policy)}",
                        rec,
                        raw,
                        extra,
                    ),
                    wanted_replicas=wanted,
                )
            if fits < to:
                to = fits
                cap_note += f", capped by {job.free_gpus} free GPU(s)"
        return Decision(
            job.job_id,
            Reason.SUSTAINED_HIGH_UTILIZATION,
            f"every {policy.bucket_s:.0f}s bucket of the last {policy.sustain_s:.0f}s above "
            f"{up:.0f}% {sig.value} (mean {fmt(mean)}%, min "
            f"{fmt(min(means))}%): ceil({cur} x {fmt(mean)} / "
            f"{target:.0f}) = {raw}, grow {cur} -> {to}{cap_note}",
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
            f"every bucket below {down:.0f}% {sig.value} but only "
            f"{window.gpus_fresh}/{window.gpus_expected} GPUs are fresh; partial data "
            "never scales down",
            rec,
            raw,
        )
    if cur <= policy.min_replicas:
        return noop(
            Reason.AT_MIN_REPLICAS,
            f"every bucket below {down:.0f}% {sig.value} "
            f"(mean {fmt(mean)}%) but already at min_replicas {policy.min_replicas}",
            rec,
            raw,
        )
    asked = max(min(raw, cur - policy.replica_multiple), policy.min_replicas)
    to = policy.whole_up(max(asked, cur - policy.max_step))
    recent = [
        r for t, r in history.recommendations if now - policy.scale_down_stabilization_s <= t <= now
    ]
    stab = max(recent, default=to)
    if stab > to:
        to = asked = min(cur, policy.whole_up(stab))
    if to >= cur:
        return noop(
            Reason.STABILIZING,
            f"every bucket below {down:.0f}% {sig.value} but the highest "
            f"recommendation of the last {policy.scale_down_stabilization_s:.0f}s is {stab}",
            rec,
            raw,
        )
    return Decision(
        job.job_id,
        Reason.SUSTAINED_LOW_UTILIZATION,
        f"every {policy.bucket_s:.0f}s bucket of the last {policy.sustain_s:.0f}s below "
        f"{down:.0f}% {sig.value} (mean {fmt(mean)}%, max "
        f"{fmt(max(means))}%): ceil({cur} x {fmt(mean)} / "
        f"{target:.0f}) = {raw}, shrink {cur} -> {to}{_groups_note(policy, asked, to)}",
        cur,
        to,
        raw_target=raw,
        recommendation=rec,
    )


#: Answers whose message renders the time (the cooldown's seconds left): never given
#: twice word for word.
_TIME_IN_MESSAGE = frozenset({Reason.COOLDOWN})
#: Answers that read the free GPUs (a grow, or none for want of room), left out of
#: :func:`inputs_key` because they change with every grow and shrink in the cluster.
_READS_FREE_GPUS = frozenset(
    {Reason.SUSTAINED_HIGH_UTILIZATION, Reason.THROUGHPUT_GAINING, Reason.NO_CAPACITY}
)
#: Answers that read the recommendations of the stabilization window, left out of
#: :func:`inputs_key` because every evaluation adds one.
_READS_RECOMMENDATIONS = frozenset({Reason.STABILIZING, Reason.SUSTAINED_LOW_UTILIZATION})


def answer_holds_until(
    d: Decision,
    job: JobState,
    window: WindowView,
    policy: PolicySettings,
    history: History,
    now: float,
    *,
    exact: bool = True,
) -> float:
    """Until when :func:`decide` gives ``d`` (its answer at ``now``) again while the
    inputs of :func:`inputs_key` hold and only the time passes (the window sliding on
    with the same bucket means): ``now`` when it must be asked anew every time,
    math.inf when only new inputs change it. The answer cache of the scaler and the
    simulator's next evaluation both ask this; every rule of ``decide`` that reads the
    time is answered for here (tests/scaler/test_policy_timing.py fails otherwise).

    ``exact``: the same decision word for word (the cache gives it again); otherwise
    the same outcome, the message aside (the cooldown's message counts its seconds)."""
    if d.resize or d.supersedes or d.reason in _READS_FREE_GPUS:
        return now
    if d.reason in _READS_RECOMMENDATIONS:
        # The stabilization window slides over them, and each evaluation adds one.
        return now
    if d.reason is Reason.COOLDOWN:
        if exact and d.reason in _TIME_IN_MESSAGE:
            return now
        assert history.last_resize_end_s is not None
        return history.last_resize_end_s + policy.cooldown_s
    since = _window_must_start_after(window, policy, history)
    if d.reason is Reason.NOT_SUSTAINED and since is not None:
        # The sustain window starts before the last resize (or its cooldown) and slides
        # towards it: by the time, and by up to one bucket more as its end snaps to the
        # next bucket boundary.
        start = window.bucket_start(len(window.bucket_means) - policy.buckets)
        return max(now, now + (since - 1e-9 - start) - window.bucket_s)
    return math.inf


def _window_must_start_after(
    window: WindowView, policy: PolicySettings, history: History
) -> float | None:
    """When the sustain window must start for its condition to count (after the last
    resize, or its cooldown for a reversal); None when no resize bounds it."""
    if history.last_resize_end_s is None:
        return None
    direction = sustained(window, policy)
    if direction == 0:
        return None
    since = history.last_resize_end_s
    if history.last_direction == -direction:
        since += policy.cooldown_s
    return since


def inputs_key(
    job: JobState, window: WindowView, policy: PolicySettings, history: History
) -> tuple[Any, ...]:
    """What ``decide`` reads, less the time and what moves with it: the window's end,
    the recommendations and the free GPUs (:func:`answer_holds_until` says which
    answers read those). NaN (an empty bucket) is None, so that equal windows compare
    equal."""
    return (
        job.job_id,
        job.current_replicas,
        job.gpus_per_replica,
        job.paused,
        job.resize_in_progress,
        job.terminating_replicas,
        job.terminating_node,
        job.terminating_deadline_s,
        job.terminating_pods,
        job.in_flight_decision,
        job.in_flight_leaving,
        window.bucket_s,
        tuple(None if m != m else m for m in window.means_of(policy.scaled_on)),
        tuple(None if f != f else f for f in window.gpm_fractions),
        window.gpus_expected,
        window.gpus_fresh,
        policy,
        history.last_resize_end_s,
        history.last_direction,
        history.last_from_replicas,
        history.throughput,
    )


def manual(job: JobState, policy: PolicySettings, replicas: int, why: str) -> Decision:
    """A resize an operator asked for, checked against the job's bounds."""
    if not why.strip():
        raise InvalidArgument("reason is required for a manual resize")
    if not (policy.min_replicas <= replicas <= policy.max_replicas):
        raise InvalidArgument(
            f"replicas={replicas} is outside the job's bounds "
            f"{policy.min_replicas}..{policy.max_replicas}"
        )
    if replicas % policy.replica_multiple:
        raise InvalidArgument(
            f"replicas={replicas} is not a multiple of the job's replica_multiple "
            f"{policy.replica_multiple} (the pods of one model-parallel group)"
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
