"""Membership: who registers, what heartbeats and acks say about a member.

Each function reads the job's state and returns the effects its input implies; a
heartbeat's progress (step, phase, rates), which is kept in memory only and learned
again after a restart, is recorded here directly.
"""

from __future__ import annotations

import uuid

from tide.services.coordinator.domain import (
    Directive,
    DirectiveKind,
    Member,
    MemberState,
    WorkerPhase,
)
from tide.services.coordinator.engine.effects import (
    AddMember,
    Effect,
    Finish,
    LeaveDrained,
    Lose,
    RecordRestored,
    Registered,
    ReportCheckpoint,
)
from tide.services.coordinator.engine.messages import AckInput, HeartbeatInput, RegisterInput
from tide.services.coordinator.engine.recovery import late_progress
from tide.services.coordinator.engine.state import JobState
from tide.services.coordinator.errors import MemberGone, StaleGeneration


def register(s: JobState, inp: RegisterInput, now: float) -> tuple[str, list[Effect]]:
    """The member of ``inp.launcher_id`` (the same one on a re-registration), and what
    follows: a launcher of a pod that is already a member replaces it."""
    m = next(
        (
            x
            for x in s.members.values()
            if x.launcher_id == inp.launcher_id and x.state != MemberState.GONE
        ),
        None,
    )
    out: list[Effect] = []
    if m is None:
        replaced = tuple(
            x.member_id
            for x in s.members.values()
            if x.pod_name == inp.pod_name and x.state != MemberState.GONE
        )
        if replaced:
            out.append(Lose(replaced, f"pod {inp.pod_name} registered again with a new launcher"))
        m = Member(
            member_id=f"{inp.pod_name}-{uuid.uuid4().hex[:8]}",
            job_id=s.job_id,
            pod_name=inp.pod_name,
            pod_index=inp.pod_index,
            pod_uid=inp.pod_uid,
            host=inp.host,
            launcher_id=inp.launcher_id,
            free_port=inp.free_port,
            state=MemberState.STANDBY,
            registered_at=now,
        )
        out.append(AddMember(m))
    out.append(Registered(m.member_id, inp.host, inp.free_port, inp.pod_uid, inp.last_generation))
    return m.member_id, out


def check_heartbeat(s: JobState, m: Member, generation: int) -> None:
    """Fencing: a heartbeat of a generation the member's launcher has left behind it.

    A launcher reports the generation it runs in. Between generations it legitimately
    reports its previous one (its RENDEZVOUS is in flight, or its last word after a loss
    arrives after its first heartbeat in the next), and a standby or a newcomer reports
    the last one it ran in. What it can no longer report is a generation before the one
    it ran in before its newest: the launcher itself said it moved on twice since."""
    floor = s.generation_before(m, m.reported_generation)
    if generation < floor:
        raise StaleGeneration(
            f"heartbeat of member {m.member_id} names generation {generation}; it has "
            f"reported generation {m.reported_generation} and was in {floor} before it"
        )


def heartbeat(
    s: JobState, inp: HeartbeatInput, now: float, mono: float
) -> tuple[list[Effect], bool]:
    """Record the heartbeat; the effects it implies, and whether a watcher should hear of
    it at once (a worker phase changed)."""
    m = s.member(inp.member_id)
    if m.state == MemberState.GONE:
        raise MemberGone(f"member {m.member_id} has left job {s.job_id}; register again")
    check_heartbeat(s, m, inp.generation)
    if inp.free_port:
        m.free_port = inp.free_port
    m.last_heartbeat_at = now
    # Never backwards: a launcher's last word about the generation it is leaving can
    # arrive after its first heartbeat in the next one.
    m.reported_generation = max(m.reported_generation, inp.generation)
    out: list[Effect] = []
    # Watchers (the scaler) must see a leave request at once: it starts a preemption.
    changed = inp.leave_requested and not m.leave_requested
    m.leave_requested = m.leave_requested or inp.leave_requested
    if inp.last_checkpoint_step and inp.last_checkpoint_step >= m.durable_step:
        # Whatever its generation: rank 0 of an earlier one still wrote that checkpoint.
        m.durable_step = inp.last_checkpoint_step
        m.durable_lag_s = inp.last_checkpoint_lag_s
        m.durable_at = inp.last_checkpoint_at or m.durable_at
    if inp.leave_requested and inp.leave_deadline_s is not None:
        m.leave_deadline_s = inp.leave_deadline_s
    if m.rank is not None and inp.generation == s.job.generation > 0:
        if inp.phase == WorkerPhase.RUNNING:
            # Only a training worker's steps are progress: a starting one reports where it
            # will restore (or, from older launchers, 0).
            m.steps_per_s = m.rate.observe(inp.generation, inp.step, mono) or m.steps_per_s
        prev_phase = m.phase
        m.phase = inp.phase
        m.step = inp.step
        m.epoch = inp.epoch
        m.samples_consumed = inp.samples_consumed
        m.samples_per_s = inp.samples_per_s
        m.first_step_at = inp.first_step_at
        m.startup = inp.startup
        # Before any loss handling: a recovery this heartbeat triggers must name the
        # checkpoint it reports. Only a step newer than every good one counts, so a
        # heartbeat repeating it costs nothing.
        if inp.last_checkpoint_step > s.last_good_step():
            out.append(
                ReportCheckpoint(
                    m.member_id,
                    inp.last_checkpoint_step,
                    inp.last_checkpoint_digest,
                    inp.generation,
                )
            )
        if inp.phase == WorkerPhase.FAILED and inp.worker_exit is not None:
            m.worker_exit = inp.worker_exit
        if inp.phase == WorkerPhase.FAILED and prev_phase != WorkerPhase.FAILED:
            out.append(Lose((m.member_id,), _failed_reason(m), worker_failed=True))
        elif inp.phase == WorkerPhase.IDLE and m.state == MemberState.ACTIVE:
            # The worker ran the job's budget to its end and exited 0: not a loss.
            out.append(Finish(m.member_id))
        else:
            changed = changed or prev_phase != inp.phase
    elif m.state == MemberState.STANDBY:
        m.phase = inp.phase
    elif 0 < inp.generation < s.job.generation:
        more = late_progress(s, m.member_id, inp.generation, inp.step)
        if more is not None:
            out.append(more)
    m.last_seen_mono = mono
    return out, changed


def _failed_reason(m: Member) -> str:
    how = m.worker_exit.cause if m.worker_exit is not None else "failed"
    return f"the worker of {m.member_id} {how}"


def on_ack(s: JobState, m: Member, d: Directive, inp: AckInput) -> list[Effect]:
    """What an ack says about the member itself, whatever the resize's phase."""
    if d.kind == DirectiveKind.RENDEZVOUS:
        if inp.ok:
            if m.phase not in (WorkerPhase.RUNNING, WorkerPhase.FAILED):
                m.phase = WorkerPhase.STARTING
            # What the new workers restored counts the lost steps; a launcher that does not
            # say (older than the field) restored the step named, as it was told.
            named = d.rendezvous.restore_step if d.rendezvous is not None else 0
            restored = named if inp.restored_step is None else inp.restored_step
            return [RecordRestored(d.generation, m.member_id, restored)]
        # A worker that cannot start would fail again on the next attempt; the member
        # leaves and may come back through the scale-up path.
        reason = f"{m.member_id} could not start in generation {d.generation}: {inp.message}"
        return [Lose((m.member_id,), reason)]
    if d.kind in (DirectiveKind.DRAIN, DirectiveKind.STOP):
        return [LeaveDrained(m.member_id)]
    return []
