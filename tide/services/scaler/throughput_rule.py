"""The throughput signal: scale on the job's own samples/s instead of a GPU counter.

A job scaling on ``throughput`` grows one replica at a time while the last grow
paid (samples/s per added replica at least ``min_scale_up_efficiency`` of a
replica's throughput, the goodput guard's own bar) and shrinks back when the
last grow gave less than ``stalled_efficiency`` (the job stopped gaining). One
replica per step, because each step is the measurement of the next. The curve is
tide/services/scaler/goodput.py's ThroughputBook: what the trainers report, by size.
Before the job has reported at its current size there is nothing to decide on:
NO_SIGNAL, never a grow on an unmeasured curve. docs/policy.md "Signals".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace

from tide.services.scaler.goodput import efficiency
from tide.services.scaler.goodput_guard import goodput_evidence
from tide.services.scaler.policy_model import (
    Decision,
    JobState,
    PolicySettings,
    Reason,
    smallest_grow_gpus,
)

#: ``decide``'s no-op builder: (reason, message, recommendation, raw target, inputs).
Noop = Callable[..., Decision]


def _pct(eff: float) -> str:
    return "nan" if math.isnan(eff) else f"{100 * eff:.0f}%"


def decide_on_throughput(
    job: JobState, policy: PolicySettings, curve: Mapping[int, float], noop: Noop
) -> Decision:
    cur = job.current_replicas
    if curve.get(cur) is None:
        return noop(
            Reason.NO_SIGNAL,
            f"throughput: the job has reported no samples/s at {cur} replica(s) yet "
            "(the trainer's step reports; see docs/policy.md)",
        )
    below = [s for s in curve if s < cur]
    prev = max(below) if below else 0
    eff = efficiency(curve, prev, cur) if prev else None
    if eff is not None and eff < policy.stalled_efficiency and cur > policy.min_replicas:
        to = policy.whole_up(max(prev, policy.min_replicas, cur - policy.max_step))
        return Decision(
            job.job_id,
            Reason.THROUGHPUT_STALLED,
            f"throughput: the grow {prev} -> {cur} gave {_pct(eff)} of a replica's samples/s "
            f"per added replica ({curve[prev]:.1f} -> {curve[cur]:.1f}), below "
            f"stalled_efficiency {policy.stalled_efficiency:.2f}: shrink back {cur} -> {to}",
            cur,
            to,
            raw_target=to,
            inputs={"goodput": goodput_evidence(curve, policy, prev, eff, "stalled")},
        )
    if cur >= policy.max_replicas:
        return noop(
            Reason.AT_MAX_REPLICAS,
            f"throughput: already at max_replicas {policy.max_replicas}",
        )
    bar = policy.min_scale_up_efficiency
    if eff is not None and eff < bar:
        return noop(
            Reason.LOW_MARGINAL_THROUGHPUT,
            f"throughput: the grow {prev} -> {cur} gave {_pct(eff)} of a replica's samples/s "
            f"per added replica (min_scale_up_efficiency {bar:.2f}): holding at {cur}",
            inputs={"goodput": goodput_evidence(curve, policy, prev, eff, "refused")},
        )
    above = [s for s in curve if s > cur]
    if above:
        nxt = min(above)
        ahead = efficiency(curve, cur, nxt)
        # Measured to stall (or not to pay): growing into it again would only shrink back.
        if ahead is not None and ahead < max(bar, policy.stalled_efficiency):
            return noop(
                Reason.LOW_MARGINAL_THROUGHPUT,
                f"throughput: {cur} -> {nxt} was measured at {_pct(ahead)} of a replica's "
                f"samples/s per added replica (min_scale_up_efficiency {bar:.2f}, "
                f"stalled_efficiency {policy.stalled_efficiency:.2f}): not tried again",
                inputs={"goodput": goodput_evidence(curve, policy, nxt, ahead, "refused")},
            )
    # One step at a time: each is the measurement of the next (a whole group, if grouped).
    to = policy.whole_down(cur + policy.replica_multiple)
    why = (
        "nothing measured below"
        if eff is None
        else f"the grow {prev} -> {cur} gave {_pct(eff)} per added replica"
    )
    ev = {
        "goodput": goodput_evidence(
            curve, policy, prev, eff, "paid" if eff is not None else "unmeasured"
        )
    }
    if job.free_gpus is not None and job.free_gpus < (to - cur) * job.gpus_per_replica:
        return replace(
            noop(
                Reason.NO_CAPACITY,
                f"throughput: {why}, but {job.free_gpus} free GPU(s) < "
                f"{smallest_grow_gpus(job, policy)}",
                None,
                to,
                ev,
            ),
            wanted_replicas=to,
        )
    return Decision(
        job.job_id,
        Reason.THROUGHPUT_GAINING,
        f"throughput: {why} ({curve[cur]:.1f} samples/s at {cur}): grow {cur} -> {to}",
        cur,
        to,
        raw_target=to,
        wanted_replicas=to,
        inputs=ev,
    )
