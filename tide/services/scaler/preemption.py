"""How long a preemption's resize may take: the node's notice rules the plan.

A pure function of the notice, the clock and the job's measured checkpoint write
time (docs/preemption.md). The resize's barrier deadline is the time the notice
leaves, less a margin for the checkpoint and the leaver's exit, capped by the
policy's phase timeout. When even that leaves too little, the coordinated
checkpoint still comes first (it is the barrier's first act) and the barrier gets
all the time left: the node may then take the pod mid-barrier or mid-rendezvous,
and the job re-forms from that checkpoint having lost at most the step in flight.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

#: Assumed checkpoint write time before one was measured (a small model writes in
#: well under a second; a large one in seconds): the margin errs on the long side.
DEFAULT_CHECKPOINT_S = 5.0
#: The margin is this many checkpoint writes (one for the barrier's, one for slack)...
MARGIN_CHECKPOINTS = 2.0
#: ...and never less than this, seconds: the leaver's exit and the actuator's call.
MIN_MARGIN_S = 2.0
#: A barrier shorter than this cannot gather the members at all, seconds.
MIN_BARRIER_S = 1.0


class PlanReason(enum.Enum):
    #: No deadline was given, or it is further than the phase timeout.
    PHASE_TIMEOUT = 1
    #: The notice's deadline less the margin.
    NOTICE = 2
    #: Less time than a resize takes: checkpoint first, re-form after.
    CHECKPOINT_FIRST = 3


@dataclass(frozen=True)
class NoticePlan:
    barrier_deadline_s: float
    margin_s: float
    reason: PlanReason
    message: str


def plan_notice(
    phase_timeout_s: float,
    notice_deadline_s: float | None,
    now_s: float,
    checkpoint_s: float | None,
) -> NoticePlan:
    """The barrier deadline for a resize that must end before ``notice_deadline_s``
    (wall time; None: the notice named no deadline)."""
    ckpt = DEFAULT_CHECKPOINT_S if checkpoint_s is None or checkpoint_s <= 0 else checkpoint_s
    margin = max(MIN_MARGIN_S, MARGIN_CHECKPOINTS * ckpt)
    if notice_deadline_s is None:
        return NoticePlan(
            phase_timeout_s, margin, PlanReason.PHASE_TIMEOUT, "the notice names no deadline"
        )
    left = notice_deadline_s - now_s
    budget = left - margin
    if budget >= phase_timeout_s:
        return NoticePlan(
            phase_timeout_s,
            margin,
            PlanReason.PHASE_TIMEOUT,
            f"{left:.1f}s left: the phase timeout {phase_timeout_s:.1f}s fits",
        )
    if budget >= MIN_BARRIER_S:
        return NoticePlan(
            budget,
            margin,
            PlanReason.NOTICE,
            f"{left:.1f}s left less a {margin:.1f}s margin ({ckpt:.2f}s checkpoint)",
        )
    # All the time left, not less a checkpoint write: a barrier aborted before the
    # node goes resumes training the node then cuts short, losing every step since
    # the last periodic checkpoint; one the node cuts short loses the held step at
    # most, the members holding at the checkpoint's step (the e2e saw the former
    # with 4 s of notice and a 1 s barrier: 7 steps lost).
    return NoticePlan(
        max(MIN_BARRIER_S, left),
        margin,
        PlanReason.CHECKPOINT_FIRST,
        f"{left:.1f}s left, under a resize's {margin + MIN_BARRIER_S:.1f}s: the checkpoint"
        " first, the job re-forms after",
    )
