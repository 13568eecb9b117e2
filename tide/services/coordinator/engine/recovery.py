"""Recovery: re-forming a generation after an unplanned loss, the silences and
overdue acks that declare a member lost, and what a restart resets.

Pure rules over :class:`JobState`; they return effects, the outbox performs them.
"""

from __future__ import annotations

from dataclasses import dataclass

from tide.services.coordinator.domain import DirectiveKind, Member, MemberState, WorkerPhase
from tide.services.coordinator.engine.effects import (
    ClearRanks,
    Effect,
    FailJob,
    OpenGeneration,
    RecordReached,
)
from tide.services.coordinator.engine.state import JobState
from tide.services.coordinator.settings import Tuning


@dataclass(frozen=True)
class RecoveryPlan:
    effects: list[Effect]
    broken_generation: int
    survivors: int
    restore_step: int
    reached_step: int
    # This re-form's number in a row (1: the first since a healthy run), and how late its
    # workers start.
    restarts: int = 0
    start_delay_s: float = 0.0


def restart_streak(s: JobState, tuning: Tuning, now: float) -> int:
    """Re-forms in a row: the recovery generations that end the job's history, each of
    which broke (or, the current one, is) younger than ``restart_reset_after_s``. A
    generation a resize formed ends the streak: its start is not a restart."""
    n, end = 0, now
    for g in range(s.job.generation, 0, -1):
        gen = s.generations.get(g)
        if gen is None or gen.decision_id is not None:
            break
        if end - gen.created_at >= tuning.restart_reset_after_s:
            break
        n, end = n + 1, gen.created_at
    return n


def plan_recovery(s: JobState, tuning: Tuning, reason: str, now: float) -> RecoveryPlan:
    """g+1 of the survivors, named the newest good checkpoint the coordinator knows; or,
    with the restart budget spent, the job's failure.

    What the survivors actually restore may be newer (a periodic checkpoint not yet
    reported): the lost steps are counted when they report it (their RENDEZVOUS acks),
    from the step g reached, recorded here. A generation that broke young counts as one
    more re-form in a row, and its successor's workers start later each time (the
    backoff); past ``restart_budget`` nothing re-forms."""
    g = s.job.generation
    reached = max((m.step for m in s.members.values() if m.reported_generation == g), default=0)
    survivors = s.actives()
    known = s.last_good_step()
    if s.job.failure:
        return RecoveryPlan([], g, len(survivors), known, reached)
    if not survivors:
        # The next Resize forms a new generation, like the first one.
        return RecoveryPlan([ClearRanks()], g, 0, known, reached)
    restarts = restart_streak(s, tuning, now) + 1
    if restarts > tuning.restart_budget:
        failure = crash_loop_failure(s, tuning, restarts - 1, reason)
        return RecoveryPlan([FailJob(failure)], g, len(survivors), known, reached)
    delay = tuning.restart_delay_s(restarts)
    effects: list[Effect] = [
        OpenGeneration(
            tuple(m.member_id for m in survivors),
            known,
            reason=f"recovery: {reason}",
            # The backoff is the workers' to wait, inside the ack deadline.
            deadline_s=tuning.heartbeat_timeout_s + delay,
            start_delay_s=delay,
        ),
        RecordReached(g + 1, reached),
    ]
    return RecoveryPlan(effects, g, len(survivors), known, reached, restarts, delay)


def crash_loop_failure(s: JobState, tuning: Tuning, restarts: int, reason: str) -> str:
    """Why the job fails: the streak, the last loss, and the last worker's end in its
    own words (exit cause and log tail), as `tide jobs` and the job's status show it."""
    g = s.job.generation
    head = (
        f"restart budget spent: generation {g} broke after {restarts} re-form(s) in a row, "
        f"each within {tuning.restart_reset_after_s:.0f} s (restart_budget "
        f"{tuning.restart_budget})"
    )
    exits = [m for m in s.members.values() if m.worker_exit and m.reported_generation == g]
    if not exits:
        return f"{head}; last loss: {reason}"
    m = max(exits, key=lambda x: x.last_heartbeat_at)
    assert m.worker_exit is not None
    tail = m.worker_exit.log_tail.rstrip()
    out = f"{head}; the worker of {m.member_id} (pod {m.pod_name}) {m.worker_exit.cause}"
    return f"{out}; its log ends:\n{tail}" if tail else out


def late_progress(s: JobState, member_id: str, generation: int, step: int) -> RecordReached | None:
    """The last word of a generation a loss broke: a survivor's launcher reports the step
    its worker had reached when the RENDEZVOUS of the recovery arrived. Its heartbeats
    before the loss can lag a step behind the peer that died, so the step the recovery
    counts its lost steps from is raised to what it reports."""
    gen = s.generations.get(generation + 1)
    if gen is None or gen.decision_id is not None or step <= gen.reached_step:
        return None
    return RecordReached(gen.generation, step, last_word_of=member_id)


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


def credit_silence(s: JobState, seconds: float, mono: float) -> None:
    """An operation held the engine for ``seconds`` (a commit that waited for the store):
    heartbeats queued behind it were not heard, and those whose deadline passed never
    will be. That silence is the coordinator's, not the members': each member's last
    sighting moves by it, never past now."""
    for m in s.members.values():
        if m.state != MemberState.GONE:
            m.last_seen_mono = min(mono, m.last_seen_mono + seconds)


def forget_liveness(s: JobState, mono: float) -> None:
    """After a restart nobody has been heard: every member gets a full heartbeat timeout
    to come back, and what heartbeats reported (in memory only) is learned again."""
    for m in s.members.values():
        m.last_seen_mono = mono
        m.phase = WorkerPhase.UNSPECIFIED
