"""The coordinator's vocabulary: members, generations, directives, checkpoints and
resizes, their lifecycles as transition tables, and the pure rules (which step to
checkpoint at, who leaves, rank order, how long the pause was).

No I/O, no clock reads and no gRPC here: :mod:`tide.services.coordinator.engine` drives
these objects and :mod:`tide.services.coordinator.store` persists them. The enum values
equal the proto's, so the servicer converts by value.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from tide.base.lifecycle import TransitionTable


class MemberState(IntEnum):
    """Lifecycle of one launcher in one job.

    A launcher registers as STANDBY, becomes ACTIVE when a generation includes it,
    DRAINING when a shrink tells it to leave, and GONE when it has left or is
    declared dead. GONE is final: a launcher that comes back registers again and
    gets a new member.
    """

    STANDBY = 1
    ACTIVE = 2
    DRAINING = 3
    GONE = 4


MEMBER_TRANSITIONS: TransitionTable[MemberState] = TransitionTable(
    "member",
    {
        MemberState.STANDBY: frozenset(
            {
                MemberState.ACTIVE,  # a generation (first, grow, recovery) includes it
                MemberState.GONE,  # heartbeat timeout, or its pod was replaced
            }
        ),
        MemberState.ACTIVE: frozenset(
            {
                MemberState.DRAINING,  # chosen to leave in a shrink, after the barrier
                MemberState.GONE,  # heartbeat timeout, replaced, or never started in g+1
                MemberState.STANDBY,  # left out of a generation while its launcher lives
            }
        ),
        MemberState.DRAINING: frozenset(
            {
                MemberState.GONE,  # acked DRAIN, timed out, or drain deadline passed
            }
        ),
        MemberState.GONE: frozenset(),
    },
)


class ResizePhase(IntEnum):
    """Lifecycle of one resize (one scaler decision) of one job.

    The values are the proto's. Its RESIZE_PHASE_DRAINING (3) is not one of them: a
    shrink sends DRAIN to the leavers together with the stayers' RENDEZVOUS, so the
    leavers drain inside RENDEZVOUS and no resize waits in a phase of its own for them.
    """

    WAITING_FOR_MEMBERS = 1
    CHECKPOINTING = 2
    RENDEZVOUS = 4
    COMPLETED = 5
    ABORTED = 6
    FAILED = 7
    # Overlap mode only: g+1's group forms in standby workers while g trains.
    PREPARING = 8

    @property
    def final(self) -> bool:
        return RESIZE_TRANSITIONS.is_final(self)


RESIZE_TRANSITIONS: TransitionTable[ResizePhase] = TransitionTable(
    "resize",
    {
        ResizePhase.WAITING_FOR_MEMBERS: frozenset(
            {
                ResizePhase.CHECKPOINTING,  # enough members (or deadline with >= min): barrier
                ResizePhase.PREPARING,  # the same, in overlap mode: g+1's group forms first
                ResizePhase.RENDEZVOUS,  # no generation yet: nothing to checkpoint
                ResizePhase.COMPLETED,  # already at the target size
                ResizePhase.ABORTED,  # deadline below min, AbortResize, member lost, restart
            }
        ),
        ResizePhase.PREPARING: frozenset(
            {
                # Every member of g+1 formed its group (or the deadline passed, or one
                # nacked, with the fallback "plain": the plain barrier, recorded).
                ResizePhase.CHECKPOINTING,
                # Deadline or nack with the fallback "abort", AbortResize, a member lost,
                # restart: g was never stopped, so nothing needs resuming.
                ResizePhase.ABORTED,
            }
        ),
        ResizePhase.CHECKPOINTING: frozenset(
            {
                # Every participant acked. On a shrink the leavers get DRAIN at the same
                # moment and drain while g+1 forms: RENDEZVOUS covers both.
                ResizePhase.RENDEZVOUS,
                ResizePhase.ABORTED,  # deadline, nack, participant lost, AbortResize, restart
                # Overlap mode: a committing barrier (its CHECKPOINTs carried g+1's prepared
                # RENDEZVOUS) that cannot complete: members may have switched, g cannot resume.
                ResizePhase.FAILED,
            }
        ),
        ResizePhase.RENDEZVOUS: frozenset(
            {
                # Every member of g+1 reported its first step and every leaver is GONE
                # (acked DRAIN or passed its drain deadline, which is this phase's deadline).
                ResizePhase.COMPLETED,
                ResizePhase.FAILED,  # a member of g+1 was lost or g+1 missed the deadline
            }
        ),
        ResizePhase.COMPLETED: frozenset(),
        ResizePhase.ABORTED: frozenset(),
        ResizePhase.FAILED: frozenset(),
    },
)


class WorkerPhase(IntEnum):
    UNSPECIFIED = 0
    STARTING = 1
    RUNNING = 2
    HOLDING = 3
    IDLE = 4
    FAILED = 5


class DirectiveKind(IntEnum):
    CHECKPOINT = 1
    HOLD = 2
    RESUME = 3
    RENDEZVOUS = 4
    DRAIN = 5
    STOP = 6
    PREPARE = 7


@dataclass(frozen=True)
class Breakdown:
    """Where a pause went, seconds each (the proto's PauseBreakdown)."""

    barrier_s: float = 0.0
    checkpoint_write_s: float = 0.0
    worker_restart_s: float = 0.0
    group_init_s: float = 0.0
    restore_s: float = 0.0


@dataclass(frozen=True)
class RendezvousInfo:
    """What one member needs to join one generation."""

    generation: int
    world_size: int
    rank: int
    master_endpoint: str
    trainer_endpoints: tuple[str, ...]
    restore_step: int
    # A RENDEZVOUS whose group the PREPARE of the same generation formed (overlap mode).
    prepared: bool = False
    # The restart backoff of a recovery after a worker failure: the workers start this
    # long after the RENDEZVOUS arrives, seconds.
    start_delay_s: float = 0.0


#: The shortest span a step rate is measured over. A phase change is reported at once,
#: so two heartbeats can arrive milliseconds apart one step apart; their ratio once made
#: a 12-steps-a-second job look like 60, and the barrier's step land past the job's end.
RATE_WINDOW_S = 1.0


@dataclass
class StepRate:
    """A member's steps a second, over at least RATE_WINDOW_S of one generation."""

    generation: int = 0
    anchor_step: int = 0
    anchor_mono: float = 0.0
    per_s: float = 0.0

    def observe(self, generation: int, step: int, mono: float) -> float:
        if generation != self.generation or step < self.anchor_step or self.anchor_mono <= 0:
            # A new generation restarts from a checkpoint after a pause: no span across it.
            self.generation, self.anchor_step, self.anchor_mono = generation, step, mono
        elif mono - self.anchor_mono >= RATE_WINDOW_S:
            self.per_s = (step - self.anchor_step) / (mono - self.anchor_mono)
            self.anchor_step, self.anchor_mono = step, mono
        return self.per_s


@dataclass(frozen=True)
class WorkerExit:
    """How a member's worker ended, as its launcher reported it with phase FAILED."""

    # Negative: killed by that signal.
    exit_code: int
    cause: str
    log_tail: str = ""


@dataclass
class Member:
    member_id: str
    job_id: str
    pod_name: str
    pod_index: int
    pod_uid: str
    host: str
    launcher_id: str
    free_port: int
    state: MemberState
    registered_at: float
    # Rank in the job's current generation; None when not in it.
    rank: int | None = None
    version: int = 0
    # Below: what heartbeats report. Kept in memory only: a restarted coordinator
    # learns it again within one heartbeat interval.
    last_seen_mono: float = 0.0
    last_heartbeat_at: float = 0.0
    reported_generation: int = 0
    phase: WorkerPhase = WorkerPhase.UNSPECIFIED
    step: int = 0
    epoch: int = 0
    samples_consumed: int = 0
    samples_per_s: float = 0.0
    steps_per_s: float = 0.0
    rate: StepRate = field(default_factory=lambda: StepRate())
    first_step_at: float | None = None
    startup: Breakdown = field(default_factory=Breakdown)
    # Its pod asked for a coordinated leave (a SIGTERM the launcher got).
    leave_requested: bool = False
    # When that pod's grace ends (unix seconds), if its launcher said.
    leave_deadline_s: float | None = None
    # How its last failed worker ended (a heartbeat in phase FAILED said so).
    worker_exit: WorkerExit | None = None
    # The newest checkpoint its launcher reported committed to the durable store (rank 0
    # writes them after the pause), that commit's lag behind the snapshot, seconds, and
    # when it committed (unix seconds; 0: unknown).
    durable_step: int = 0
    durable_lag_s: float = 0.0
    durable_at: float = 0.0

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.free_port}"


def transition_member(member: Member, new: MemberState) -> None:
    if new == member.state:
        return
    member.state = MEMBER_TRANSITIONS.check(
        member.state, new, what=f"member {member.member_id} of job {member.job_id}"
    )


@dataclass
class Generation:
    job_id: str
    generation: int
    world_size: int
    member_ids: tuple[str, ...]
    master_endpoint: str
    trainer_endpoints: tuple[str, ...]
    restore_step: int
    created_at: float
    reason: str
    decision_id: int | None = None
    # Steps lost: reached_step minus the step its workers actually restored, once they
    # reported it (restored_step None until then: nothing is counted before).
    lost_steps: int = 0
    # The highest step the generation before reached (raised by a survivor's last word).
    reached_step: int = 0
    restored_step: int | None = None


@dataclass
class Checkpoint:
    job_id: str
    step: int
    generation: int
    digest: str
    good: bool
    write_s: float
    created_at: float


@dataclass
class Directive:
    job_id: str
    directive_id: str
    member_id: str
    kind: DirectiveKind
    generation: int
    created_at: float
    # Order of sending within the job; directive_id is derived from it.
    seq: int = 0
    checkpoint_step: int = 0
    rendezvous: RendezvousInfo | None = None
    deadline_at: float | None = None
    reason: str = ""
    acked: bool = False
    ack_ok: bool = False
    # A later directive made this one moot (RESUME after an aborted CHECKPOINT,
    # RENDEZVOUS of a newer generation); it is no longer sent.
    superseded: bool = False
    # A CHECKPOINT to a shrink's leaver: its pod writes no handover. Not persisted: a
    # CHECKPOINT re-sent after a restart without it only costs the leaver a handover.
    leaving: bool = False

    @property
    def pending(self) -> bool:
        return not self.acked and not self.superseded


@dataclass
class Resize:
    decision_id: int
    job_id: str
    target_world_size: int
    min_world_size: int
    leaving_pods: tuple[str, ...]
    deadline_s: float
    phase: ResizePhase
    from_generation: int
    started_at: float
    phase_started_at: float
    to_generation: int = 0
    checkpoint_step: int = 0
    participants: tuple[str, ...] = ()
    newcomers: tuple[str, ...] = ()
    leaving: tuple[str, ...] = ()
    # Members that have acknowledged the current phase's directive.
    acked: tuple[str, ...] = ()
    held_at_latest: float = 0.0
    checkpoint_digest: str = ""
    checkpoint_write_s: float = 0.0
    rendezvous_sent_at: float = 0.0
    finished_at: float = 0.0
    pause_s: float = 0.0
    breakdown: Breakdown = field(default_factory=Breakdown)
    message: str = ""
    version: int = 0
    # The step each participant said it held at in this barrier's acks: the ranks of g must
    # all have held at one step. In memory only (not persisted): a restarted coordinator
    # checks the acks it hears after its restart.
    held_steps: dict[str, int] = field(default_factory=dict, compare=False)

    @property
    def phase_deadline_at(self) -> float:
        return self.phase_started_at + self.deadline_s


def transition_resize(resize: Resize, new: ResizePhase, *, at: float, message: str = "") -> None:
    resize.phase = RESIZE_TRANSITIONS.check(
        resize.phase, new, what=f"resize {resize.decision_id} of job {resize.job_id}"
    )
    resize.phase_started_at = at
    resize.acked = ()
    if message:
        resize.message = message
    if new.final:
        resize.finished_at = at


@dataclass
class JobRecord:
    """The per-job counters several writers could touch; versioned."""

    job_id: str
    generation: int = 0
    directive_seq: int = 0
    lost_steps_total: int = 0
    # Set once the job failed for good (its restart budget spent): why, and when.
    failure: str = ""
    failed_at: float | None = None
    version: int = 0


# --- pure rules ---------------------------------------------------------------


def choose_checkpoint_step(
    steps: Iterable[int], steps_per_s: Iterable[float], *, min_lead_steps: int, lead_s: float
) -> int:
    """The step every member can still reach after hearing the directive.

    A member may be up to one heartbeat interval ahead of what it reported, plus
    the directive's delivery time; ``lead_s`` covers both, converted to steps with
    the fastest reported rate. ``min_lead_steps`` keeps a margin when no rate is
    known yet.
    """
    top = max(steps, default=0)
    rate = max(steps_per_s, default=0.0)
    lead = max(min_lead_steps, math.ceil(max(rate, 0.0) * lead_s))
    return top + lead


def choose_leaving(
    actives: Sequence[Member], n_leave: int, named: Sequence[str]
) -> tuple[Member, ...]:
    """Who leaves a shrink: the named pods first (a node being drained; by name or by
    uid, as the agent knows a pod by either), then the highest pod indexes, since a
    PaddleJob operator removes those."""
    if n_leave <= 0:
        return ()
    by_index_desc = sorted(actives, key=lambda m: (-m.pod_index, m.pod_name))
    names = set(named)
    chosen = [m for m in by_index_desc if m.pod_name in names or (m.pod_uid and m.pod_uid in names)]
    chosen += [m for m in by_index_desc if m not in chosen]
    return tuple(chosen[:n_leave])


def rank_order(stayers: Sequence[Member], newcomers: Sequence[Member]) -> tuple[Member, ...]:
    """Members that stay keep their relative order (by their current rank);
    newcomers follow, by pod index."""
    kept = sorted(stayers, key=lambda m: (m.rank if m.rank is not None else 1 << 30, m.pod_index))
    new = sorted(newcomers, key=lambda m: (m.pod_index, m.pod_name))
    return (*kept, *new)


def rendezvous_for(
    members: Sequence[Member], generation: int, restore_step: int
) -> tuple[RendezvousInfo, ...]:
    """One RendezvousInfo per member, in rank order; rank 0 hosts the master store."""
    if not members:
        raise ValueError("a generation needs at least one member")
    endpoints = tuple(m.endpoint for m in members)
    return tuple(
        RendezvousInfo(
            generation=generation,
            world_size=len(members),
            rank=rank,
            master_endpoint=endpoints[0],
            trainer_endpoints=endpoints,
            restore_step=restore_step,
        )
        for rank in range(len(members))
    )


def measure_pause(
    *,
    held_at_latest: float,
    checkpoint_write_s: float,
    rendezvous_sent_at: float,
    first_steps_at: Sequence[float],
    startups: Sequence[Breakdown],
) -> tuple[float, Breakdown]:
    """Pause = latest held_at of g (training stopped) → latest first step of g+1.

    The parts: rank 0's checkpoint write; the barrier, i.e. the coordination time
    inside the pause besides the write (last hold → RENDEZVOUS sent); and the
    slowest member's worker restart, group init and restore. The first step's own
    compute is the unattributed rest.
    """
    if held_at_latest <= 0 or not first_steps_at:
        return 0.0, Breakdown()
    pause = max(0.0, max(first_steps_at) - held_at_latest)
    barrier = max(0.0, rendezvous_sent_at - held_at_latest - checkpoint_write_s)
    return pause, Breakdown(
        barrier_s=barrier,
        checkpoint_write_s=checkpoint_write_s,
        worker_restart_s=max((s.worker_restart_s for s in startups), default=0.0),
        group_init_s=max((s.group_init_s for s in startups), default=0.0),
        restore_s=max((s.restore_s for s in startups), default=0.0),
    )
