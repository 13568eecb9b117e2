"""What the engine takes and gives back: the servicer converts these from and to protobuf.

Plain frozen dataclasses, so the engine and its tests never touch protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tide.services.coordinator.domain import (
    Breakdown,
    MemberState,
    ResizePhase,
    WorkerExit,
    WorkerPhase,
)


@dataclass(frozen=True)
class RegisterInput:
    job_id: str
    pod_name: str
    pod_index: int
    host: str
    launcher_id: str
    last_generation: int = 0
    pod_uid: str = ""
    free_port: int = 0


@dataclass(frozen=True)
class RegisterResult:
    member_id: str
    generation: int
    state: MemberState
    heartbeat_interval_s: float
    heartbeat_timeout_s: float


@dataclass(frozen=True)
class HeartbeatInput:
    member_id: str
    generation: int
    phase: WorkerPhase
    step: int = 0
    samples_consumed: int = 0
    epoch: int = 0
    samples_per_s: float = 0.0
    first_step_at: float | None = None
    startup: Breakdown = field(default_factory=Breakdown)
    free_port: int = 0
    # The newest good checkpoint the member's worker wrote (periodic ones included); 0: none.
    last_checkpoint_step: int = 0
    last_checkpoint_digest: str = ""
    # The pod was told to go (SIGTERM) and asks for a coordinated leave.
    leave_requested: bool = False
    # When the pod's grace ends (unix seconds), if the launcher said.
    leave_deadline_s: float | None = None
    # With phase FAILED: how the worker ended, if the launcher said.
    worker_exit: WorkerExit | None = None
    # last_checkpoint_step is in the durable store: from its snapshot to its commit,
    # seconds, and when it committed (unix seconds), if the launcher said.
    last_checkpoint_lag_s: float = 0.0
    last_checkpoint_at: float | None = None


@dataclass(frozen=True)
class AckInput:
    member_id: str
    directive_id: str
    generation: int
    ok: bool
    checkpoint_step: int = 0
    checkpoint_digest: str = ""
    message: str = ""
    held_at: float | None = None
    checkpoint_write_s: float = 0.0
    # A RENDEZVOUS ack: the step the new workers restored; None from older launchers.
    restored_step: int | None = None


@dataclass(frozen=True)
class ResizeInput:
    decision_id: int
    job_id: str
    target_world_size: int
    deadline_s: float
    leaving_pods: tuple[str, ...] = ()
    min_world_size: int = 0
    #: The world is whole groups of this many members (0 or 1: any size).
    world_multiple: int = 0
    #: The caller's trace context (tide.services.common.tracing.extract); opaque here.
    trace_parent: Any = field(default=None, compare=False)


@dataclass(frozen=True)
class ResizeView:
    decision_id: int
    phase: ResizePhase
    generation: int
    world_size: int
    checkpoint_step: int
    pause_s: float
    breakdown: Breakdown
    lost_steps: int
    message: str


@dataclass(frozen=True)
class MemberView:
    member_id: str
    pod_name: str
    pod_index: int
    pod_uid: str
    host: str
    state: MemberState
    rank: int
    phase: WorkerPhase
    step: int
    samples_per_s: float
    last_heartbeat_at: float
    leave_requested: bool = False
    leave_deadline_s: float | None = None


@dataclass(frozen=True)
class JobView:
    job_id: str
    generation: int
    world_size: int
    members: tuple[MemberView, ...]
    step: int
    epoch: int
    samples_consumed: int
    samples_per_s: float
    last_checkpoint_step: int
    active_resize: ResizeView | None
    lost_steps_total: int
    finished: bool = False
    # The job failed for good: why ("" while it has not).
    failure: str = ""
    # Re-forms in a row after losses, and how many the coordinator allows.
    restarts: int = 0
    restart_budget: int = 0
    # The newest checkpoint in the durable store, its lag (snapshot to commit, seconds)
    # and when it committed (unix seconds); 0 while none was reported.
    durable_checkpoint_step: int = 0
    durable_checkpoint_lag_s: float = 0.0
    durable_checkpoint_at: float = 0.0
