"""Recovery: re-forming a generation after an unplanned loss, the silences and
overdue acks that declare a member lost, and what a restart resets.

Pure rules over :class:`JobState`; they return effects, the outbox performs them.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.coordinator.domain import DirectiveKind, Member, MemberState, WorkerPhase
from services.coordinator.engine.effects import (
    AddLostSteps,
    ClearRanks,
    Effect,
    OpenGeneration,
)
from services.coordinator.engine.state import JobState
from services.coordinator.settings import Tuning


@dataclass(frozen=True)
class RecoveryPlan:
    effects: list[Effect]
    broken_generation: int
    survivors: int
    restore_step: int
    lost_steps: int
    reached_step: int


def plan_recovery(s: JobState, tuning: Tuning, reason: str) -> RecoveryPlan:
    """g+1 of the survivors from the newest good checkpoint; the steps past it are lost.

    Rank 0 reports every checkpoint it writes (periodic ones included), so the newest
    good one the coordinator knows is the one the survivors restore: named exactly."""
    g = s.job.generation
    reached = max((m.step for m in s.members.values() if m.reported_generation == g), default=0)
    survivors = s.actives()
    known = s.last_good_step()
    lost_steps = max(0, reached - known)
    effects: list[Effect]
    if not survivors:
        # The next Resize forms a new generation, like the first one.
        effects = [ClearRanks()]
    else:
        effects = [
            OpenGeneration(
                tuple(m.member_id for m in survivors),
                known,
                reason=f"recovery: {reason}",
                deadline_s=tuning.heartbeat_timeout_s,
            ),
            AddLostSteps(g + 1, lost_steps),
        ]
    return RecoveryPlan(effects, g, len(survivors), known, lost_steps, reached)


def late_progress(s: JobState, member_id: str, generation: int, step: int) -> AddLostSteps | None:
    """The last word of a generation a loss broke: a survivor's launcher reports the step
    its worker had reached when the RENDEZVOUS of the recovery arrived. Its heartbeats
    before the loss can lag a step behind the peer that died, so the lost steps of the
    recovery are raised to what it reports."""
    gen = s.generations.get(generation + 1)
    if gen is None or gen.decision_id is not None:
        return None
    reached = gen.restore_step + gen.lost_steps
    if step <= reached:
        return None
    return AddLostSteps(gen.generation, step - reached, last_word_of=member_id)


def silent(s: JobState, mono: float, tuning: Tuning) -> list[Member]:
    return [
        m
        for m in s.members.values()
        if m.state != MemberState.GONE and mono - m.last_seen_mono > tuning.heartbeat_timeout_s
    ]


def overdue_drains(s: JobState, now: float) -> list[str]:
    """Leavers whose DRAIN deadline passed: they leave without a loss."""
    return [
        d.member_id
        for d in s.directives.values()
        if d.pending and d.kind == DirectiveKind.DRAIN and _late(d.deadline_at, now)
    ]


def overdue(s: JobState, now: float) -> tuple[str, ...]:
    """Members with a directive not acked by its deadline: lost."""
    ids = [d.member_id for d in s.directives.values() if d.pending and _late(d.deadline_at, now)]
    return tuple(dict.fromkeys(ids))


def _late(deadline_at: float | None, now: float) -> bool:
    return deadline_at is not None and now > deadline_at


def forget_liveness(s: JobState, mono: float) -> None:
    """After a restart nobody has been heard: every member gets a full heartbeat timeout
    to come back, and what heartbeats reported (in memory only) is learned again."""
    for m in s.members.values():
        m.last_seen_mono = mono
        m.phase = WorkerPhase.UNSPECIFIED
