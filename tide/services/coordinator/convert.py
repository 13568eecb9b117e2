"""The coordinator's records to protobuf and back: the one copy the servicer uses.

Enum values equal the proto's, so enums convert by value. Times go through
tide.base.timeconv; a time of 0 means "not set" and leaves the field unset.
"""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from tide.base.errors import InvalidArgument
from tide.base.timeconv import field_seconds, ts_from_seconds
from tide.services.coordinator.domain import Breakdown, Directive, WorkerExit, WorkerPhase
from tide.services.coordinator.engine import (
    AckInput,
    HeartbeatInput,
    JobView,
    RegisterInput,
    RegisterResult,
    ResizeInput,
    ResizeView,
)
from tide.v1 import coordinator_pb2 as pb


def _ts(seconds: float | None) -> Timestamp | None:
    return ts_from_seconds(seconds) if seconds else None


def breakdown_to_proto(b: Breakdown) -> pb.PauseBreakdown:
    return pb.PauseBreakdown(
        barrier_s=b.barrier_s,
        checkpoint_write_s=b.checkpoint_write_s,
        worker_restart_s=b.worker_restart_s,
        group_init_s=b.group_init_s,
        restore_s=b.restore_s,
    )


def breakdown_from_proto(b: pb.PauseBreakdown) -> Breakdown:
    return Breakdown(
        barrier_s=b.barrier_s,
        checkpoint_write_s=b.checkpoint_write_s,
        worker_restart_s=b.worker_restart_s,
        group_init_s=b.group_init_s,
        restore_s=b.restore_s,
    )


def directive_to_proto(d: Directive) -> pb.Directive:
    out = pb.Directive(
        directive_id=d.directive_id,
        kind=int(d.kind),  # type: ignore[arg-type]
        generation=d.generation,
        checkpoint_step=d.checkpoint_step,
        reason=d.reason,
        leaving=d.leaving,
    )
    if d.rendezvous is not None:
        rv = d.rendezvous
        out.rendezvous.CopyFrom(
            pb.Rendezvous(
                generation=rv.generation,
                world_size=rv.world_size,
                rank=rv.rank,
                master_endpoint=rv.master_endpoint,
                trainer_endpoints=list(rv.trainer_endpoints),
                restore_step=rv.restore_step,
                prepared=rv.prepared,
                start_delay_s=rv.start_delay_s,
            )
        )
    deadline = _ts(d.deadline_at)
    if deadline is not None:
        out.deadline.CopyFrom(deadline)
    return out


def progress_to_proto(v: ResizeView) -> pb.ResizeProgress:
    return pb.ResizeProgress(
        decision_id=v.decision_id,
        phase=int(v.phase),  # type: ignore[arg-type]
        generation=v.generation,
        world_size=v.world_size,
        checkpoint_step=v.checkpoint_step,
        pause_s=v.pause_s,
        pause=breakdown_to_proto(v.breakdown),
        lost_steps=v.lost_steps,
        message=v.message,
    )


def status_to_proto(v: JobView) -> pb.JobStatus:
    out = pb.JobStatus(
        job_id=v.job_id,
        generation=v.generation,
        world_size=v.world_size,
        step=v.step,
        epoch=v.epoch,
        samples_consumed=v.samples_consumed,
        samples_per_s=v.samples_per_s,
        last_checkpoint_step=v.last_checkpoint_step,
        lost_steps_total=v.lost_steps_total,
        finished=v.finished,
        failed=bool(v.failure),
        failure=v.failure,
        restarts=v.restarts,
        restart_budget=v.restart_budget,
        durable_checkpoint_step=v.durable_checkpoint_step,
        durable_checkpoint_lag_s=v.durable_checkpoint_lag_s,
    )
    durable_at = _ts(v.durable_checkpoint_at)
    if durable_at is not None:
        out.durable_checkpoint_at.CopyFrom(durable_at)
    for m in v.members:
        member = out.members.add(
            member_id=m.member_id,
            pod_name=m.pod_name,
            pod_index=m.pod_index,
            pod_uid=m.pod_uid,
            host=m.host,
            state=int(m.state),
            rank=m.rank,
            phase=int(m.phase),
            step=m.step,
            samples_per_s=m.samples_per_s,
            leave_requested=m.leave_requested,
        )
        seen = _ts(m.last_heartbeat_at)
        if seen is not None:
            member.last_heartbeat.CopyFrom(seen)
        grace_end = _ts(m.leave_deadline_s)
        if grace_end is not None:
            member.leave_deadline.CopyFrom(grace_end)
    if v.active_resize is not None:
        out.active_resize.CopyFrom(progress_to_proto(v.active_resize))
    return out


def register_from_proto(r: pb.RegisterRequest) -> RegisterInput:
    return RegisterInput(
        job_id=r.job_id,
        pod_name=r.pod_name,
        pod_index=r.pod_index,
        host=r.host,
        launcher_id=r.launcher_id,
        last_generation=r.last_generation,
        pod_uid=r.pod_uid,
        free_port=r.free_port,
    )


def register_to_proto(res: RegisterResult) -> pb.RegisterResponse:
    return pb.RegisterResponse(
        member_id=res.member_id,
        generation=res.generation,
        state=int(res.state),  # type: ignore[arg-type]
        heartbeat_interval_s=res.heartbeat_interval_s,
        heartbeat_timeout_s=res.heartbeat_timeout_s,
    )


def ack_from_proto(r: pb.AckRequest) -> AckInput:
    return AckInput(
        member_id=r.member_id,
        directive_id=r.directive_id,
        generation=r.generation,
        ok=r.ok,
        checkpoint_step=r.checkpoint_step,
        checkpoint_digest=r.checkpoint_digest,
        message=r.message,
        held_at=field_seconds(r, "held_at"),
        checkpoint_write_s=r.checkpoint_write_s,
        restored_step=r.restored_step if r.HasField("restored_step") else None,
    )


def _phase(value: int) -> WorkerPhase:
    try:
        return WorkerPhase(value)
    except ValueError:
        raise InvalidArgument(f"phase: unknown worker phase {value}") from None


def heartbeat_from_proto(r: pb.HeartbeatRequest) -> HeartbeatInput:
    return HeartbeatInput(
        member_id=r.member_id,
        generation=r.generation,
        phase=_phase(r.phase),
        step=r.step,
        samples_consumed=r.samples_consumed,
        epoch=r.epoch,
        samples_per_s=r.samples_per_s,
        first_step_at=field_seconds(r, "first_step_at"),
        startup=breakdown_from_proto(r.startup),
        free_port=r.free_port,
        last_checkpoint_step=r.last_checkpoint_step,
        last_checkpoint_digest=r.last_checkpoint_digest,
        leave_requested=r.leave_requested,
        leave_deadline_s=field_seconds(r, "leave_deadline"),
        last_checkpoint_lag_s=r.last_checkpoint_lag_s,
        last_checkpoint_at=field_seconds(r, "last_checkpoint_at"),
        worker_exit=WorkerExit(
            exit_code=r.worker_exit.exit_code,
            cause=r.worker_exit.cause or f"exited with {r.worker_exit.exit_code}",
            log_tail=r.worker_exit.log_tail,
        )
        if r.HasField("worker_exit")
        else None,
    )


def resize_from_proto(r: pb.ResizeRequest) -> ResizeInput:
    return ResizeInput(
        decision_id=r.decision_id,
        job_id=r.job_id,
        target_world_size=r.target_world_size,
        deadline_s=r.deadline_s,
        leaving_pods=tuple(r.leaving_pods),
        min_world_size=r.min_world_size,
        world_multiple=r.world_multiple,
    )
