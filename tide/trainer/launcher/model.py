"""The launcher's own vocabulary: its lifecycle, and the directives, acks and heartbeats it
exchanges with the coordinator, as plain values. Only tide/trainer/launcher/link.py turns these
into protobuf and back, so the rest of the launcher never sees gRPC."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tide.base.lifecycle import TransitionTable


class State(enum.Enum):
    STANDBY = "standby"  # no worker; waiting for a generation
    STARTING = "starting"  # a worker is starting (process, group init, restore)
    RUNNING = "running"
    HOLDING = "holding"  # held at a step boundary after CHECKPOINT/HOLD
    FAILED = "failed"  # the worker died unasked; waiting for the next RENDEZVOUS
    DRAINING = "draining"
    DONE = "done"  # the launcher is exiting


LIFECYCLE: TransitionTable[State] = TransitionTable(
    "launcher",
    {
        State.STANDBY: {State.STARTING, State.DRAINING, State.DONE},
        # STARTING again: a RENDEZVOUS that replaces one still starting.
        State.STARTING: {State.STARTING, State.RUNNING, State.FAILED, State.DRAINING, State.DONE},
        State.RUNNING: {State.STARTING, State.HOLDING, State.FAILED, State.DRAINING, State.DONE},
        State.HOLDING: {State.STARTING, State.RUNNING, State.FAILED, State.DRAINING, State.DONE},
        State.FAILED: {State.STARTING, State.DRAINING, State.DONE},
        State.DRAINING: {State.DONE},
        State.DONE: set(),
    },
)

# A launcher in these states is leaving: it never registers again.
LEAVING = frozenset({State.DRAINING, State.DONE})


class DirectiveKind(enum.Enum):
    RENDEZVOUS = "rendezvous"
    CHECKPOINT = "checkpoint"
    HOLD = "hold"
    RESUME = "resume"
    DRAIN = "drain"
    STOP = "stop"
    PREPARE = "prepare"
    UNKNOWN = "unknown"  # a kind this launcher does not know (a newer coordinator)


@dataclass(frozen=True)
class RendezvousPlan:
    """Where this member sits in the generation a RENDEZVOUS forms."""

    rank: int
    world_size: int
    master_endpoint: str
    trainer_endpoints: tuple[str, ...]
    restore_step: int
    # A RENDEZVOUS whose group the PREPARE of this generation formed ahead (overlap mode);
    # in a PREPARE: the barrier will commit, so a newcomer's prepared worker trains as soon
    # as it has restored (its peers restore only once they switched at the barrier).
    prepared: bool = False
    # The generation it forms: a RENDEZVOUS's own; a PREPARE's next one (it is sent in g).
    generation: int = 0
    # The restart backoff of a re-form after a loss: start the workers this late, seconds.
    start_delay_s: float = 0.0


@dataclass(frozen=True)
class Directive:
    directive_id: str
    generation: int
    kind: DirectiveKind
    # The coordinator's name of the kind, for logs (and for an UNKNOWN one).
    kind_name: str
    checkpoint_step: int = 0
    rendezvous: RendezvousPlan | None = None
    # A CHECKPOINT to a shrink's leaver.
    leaving: bool = False


@dataclass(frozen=True)
class Ack:
    directive_id: str
    generation: int
    ok: bool = True
    message: str = ""
    # A CHECKPOINT/HOLD ack: when the ranks held, at which step, rank 0's checkpoint.
    held_at: float | None = None
    checkpoint_step: int = 0
    checkpoint_digest: str = ""
    checkpoint_write_s: float = 0.0
    # A RENDEZVOUS ack: the step the new workers actually restored (0: from scratch).
    restored_step: int | None = None


@dataclass(frozen=True)
class WorkerExit:
    """How the worker that failed ended, for the coordinator's account of a crash loop."""

    # Its exit status; negative: killed by that signal.
    exit_code: int
    # In words: "exited with 1", "was killed by SIGSEGV".
    cause: str
    # The last lines of its log (at most LOG_TAIL_BYTES).
    log_tail: str = ""


@dataclass
class WorkerProgress:
    """What the current worker said last about its training (a new generation starts at its restore step)."""

    step: int = 0
    epoch: int = 0
    cursor: int = 0
    samples_per_s: float = 0.0
    first_step_at: float = 0.0
    worker_restart_s: float = 0.0
    group_init_s: float = 0.0
    restore_s: float = 0.0


@dataclass(frozen=True)
class DurableCheckpoint:
    """The newest checkpoint a worker of this launcher committed to the durable store and
    verified (rank 0 only)."""

    step: int = 0
    # Its manifest's sha256 (hex).
    digest: str = ""
    # From its snapshot to its commit, seconds: how far the durable copy lagged training.
    lag_s: float = 0.0
    # When the launcher heard of its commit (unix seconds).
    at: float = 0.0


@dataclass(frozen=True)
class Beat:
    """One heartbeat's content, taken when it is sent."""

    generation: int
    state: State
    progress: WorkerProgress
    # The newest checkpoint a worker of this launcher wrote and verified (rank 0 only).
    checkpoint: DurableCheckpoint = DurableCheckpoint()
    # The pod got SIGTERM: this member asks for a coordinated leave (tide/trainer/launcher/leave.py).
    leave_requested: bool = False
    # When the pod's grace ends (unix seconds; 0: not asked), for the scaler's plan.
    leave_deadline_s: float = 0.0
    # With state FAILED: how the worker ended.
    worker_exit: WorkerExit | None = None
