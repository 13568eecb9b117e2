"""Read-only views of a job for the scaler and the CLI: ResizeProgress and JobStatus."""

from __future__ import annotations

from tide.services.coordinator.domain import Member, MemberState, Resize, WorkerPhase
from tide.services.coordinator.engine.messages import JobView, MemberView, ResizeView
from tide.services.coordinator.engine.recovery import restart_streak
from tide.services.coordinator.engine.state import JobState
from tide.services.coordinator.errors import UnknownResize
from tide.services.coordinator.settings import Tuning


def resize_view(s: JobState, decision_id: int) -> ResizeView:
    r = s.resizes.get(decision_id)
    if r is None:
        raise UnknownResize(f"no resize {decision_id} in job {s.job_id}")
    return _resize_view(s, r)


def _resize_view(s: JobState, r: Resize) -> ResizeView:
    g = r.to_generation or r.from_generation
    gen = s.generations.get(g)
    # A resize that ended in a recovery's generation reports that recovery's lost steps.
    lost = gen.lost_steps if gen is not None and gen.decision_id != r.decision_id else 0
    return ResizeView(
        decision_id=r.decision_id,
        phase=r.phase,
        generation=g,
        world_size=gen.world_size if gen is not None else 0,
        checkpoint_step=r.checkpoint_step,
        pause_s=r.pause_s,
        breakdown=r.breakdown,
        lost_steps=lost,
        message=r.message,
    )


def job_view(s: JobState, tuning: Tuning, now: float) -> JobView:
    current = s.current_members()
    running = [m for m in current if m.reported_generation == s.job.generation]
    finished = {m.member_id for m in s.finished_members()}
    # A finished member is listed (GONE, phase IDLE, its rank and final step): the
    # convention that says the job ended rather than lost its members.
    members = tuple(
        MemberView(
            member_id=m.member_id,
            pod_name=m.pod_name,
            pod_index=m.pod_index,
            pod_uid=m.pod_uid,
            host=m.host,
            state=m.state,
            rank=m.rank or 0,
            phase=WorkerPhase.IDLE if m.member_id in finished else m.phase,
            step=m.step,
            samples_per_s=0.0 if m.member_id in finished else m.samples_per_s,
            last_heartbeat_at=m.last_heartbeat_at,
            leave_requested=m.leave_requested,
            leave_deadline_s=m.leave_deadline_s,
        )
        for m in sorted(s.members.values(), key=lambda m: (m.pod_index, m.registered_at))
        if m.state != MemberState.GONE or m.member_id in finished
    )
    lead = min(running, key=lambda m: m.step) if running else None
    done = lead is None and s.finished()
    if done:
        lead = max(s.finished_members(), key=lambda m: m.step)
    r = s.active_resize()
    durable = newest_durable(s)
    return JobView(
        job_id=s.job_id,
        generation=s.job.generation,
        world_size=len(current),
        members=members,
        # After a restart a finished member's step is forgotten; its final checkpoint is not.
        step=s.finished_step() if done else (lead.step if lead else 0),
        epoch=lead.epoch if lead else 0,
        samples_consumed=lead.samples_consumed if lead else 0,
        samples_per_s=sum(m.samples_per_s for m in running),
        last_checkpoint_step=s.last_good_step(),
        active_resize=_resize_view(s, r) if r is not None else None,
        lost_steps_total=s.job.lost_steps_total,
        finished=done,
        failure=s.job.failure,
        restarts=restart_streak(s, tuning, s.job.failed_at or now),
        restart_budget=tuning.restart_budget,
        durable_checkpoint_step=durable.durable_step if durable else 0,
        durable_checkpoint_lag_s=durable.durable_lag_s if durable else 0.0,
        durable_checkpoint_at=durable.durable_at if durable else 0.0,
    )


def newest_durable(s: JobState) -> Member | None:
    """The member that reported the job's newest durable checkpoint (rank 0 of the
    generation that wrote it, whatever its rank now); None before any."""
    best = max(s.members.values(), key=lambda m: m.durable_step, default=None)
    return best if best is not None and best.durable_step else None
