"""The goodput guard of the utilization signals: a grow must pay in samples/s, not only
in busy GPUs (NCCL kernels keep a GPU "busy" while it waits). Two rules of
:func:`tide.services.scaler.policy.decide`, in docs/policy.md's order: the revert of a grow that
made training slower, and the cap on a grow towards a size measured not to pay. Its own
module because these rules change with the throughput book (tide/services/scaler/goodput.py),
not with the window's thresholds; the throughput signal shares the evidence it stores.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tide.services.scaler.goodput import efficiency
from tide.services.scaler.policy_model import (
    Decision,
    History,
    JobState,
    PolicySettings,
    Reason,
    fmt,
)


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


def revert_if_slower(
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
    to = policy.whole_up(max(frm, policy.min_replicas))
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


def guard_grow(
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
                f"the grow {a} -> {cur} gave {fmt(100 * eff)}% of a replica's throughput per "
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
    half = policy.whole_down(cur + (s1 - cur) // 2)
    why = (
        f"{cur} -> {s1} gave {fmt(100 * eff)}% of a replica's throughput per added replica "
        f"({curve[cur]:.1f} -> {curve[s1]:.1f} samples/s; min_scale_up_efficiency "
        f"{policy.min_scale_up_efficiency:.2f})"
    )
    if half <= cur:
        ev = goodput_evidence(curve, policy, s1, eff, "refused")
        return None, {"evidence": ev, "note": f"the last {why}: not tried again"}
    ev = goodput_evidence(curve, policy, s1, eff, "halved")
    return half, {"evidence": ev, "note": f"halved below {s1}: {why}"}
