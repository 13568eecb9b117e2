"""What the engine's rules decide, as data: the phase handlers, membership and
recovery return these, and :mod:`tide.services.coordinator.engine.outbox` alone performs
them (changes the state, records the change in the unit of work, queues the
directives until the commit).

Each effect names its subject by id, so a test compares a handler's answer with a
literal list.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tide.services.coordinator.domain import (
    Breakdown,
    DirectiveKind,
    Member,
    RendezvousInfo,
    Resize,
)


@dataclass(frozen=True)
class Send:
    """A directive to one member, of ``generation`` (the job's current one when decided)."""

    member_id: str
    kind: DirectiveKind
    generation: int
    reason: str
    deadline_s: float
    checkpoint_step: int = 0
    # Overlap mode: a CHECKPOINT that carries the member's prepared RENDEZVOUS (restore step
    # S), so that it switches to its prepared worker at its own hold: the barrier commits.
    rendezvous: RendezvousInfo | None = None
    # A CHECKPOINT to a shrink's leaver: no handover to a next worker in its pod.
    leaving: bool = False


@dataclass(frozen=True)
class Prepare:
    """PREPARE to one member of g+1 (sent in g, the job's generation when decided): its
    standby worker forms ``rendezvous``'s group while g trains (overlap mode)."""

    member_id: str
    generation: int
    rendezvous: RendezvousInfo
    reason: str
    deadline_s: float


@dataclass(frozen=True)
class BeginPrepare:
    """PREPARING over the same members a barrier would take; the PREPAREs are separate."""

    decision_id: int
    participants: tuple[str, ...]
    newcomers: tuple[str, ...]
    leaving: tuple[str, ...]


@dataclass(frozen=True)
class RecordPrepared:
    """A member of g+1 acked PREPARE: its standby worker has g+1's group."""

    decision_id: int
    member_id: str


@dataclass(frozen=True)
class RecordAck:
    directive_id: str
    ok: bool


@dataclass(frozen=True)
class Supersede:
    """The member's pending directives (of ``kinds``; all when empty) are no longer sent."""

    member_id: str
    kinds: frozenset[DirectiveKind] = frozenset()


@dataclass(frozen=True)
class BeginBarrier:
    """CHECKPOINTING at ``step`` over the participants; the CHECKPOINTs are separate Sends."""

    decision_id: int
    step: int
    participants: tuple[str, ...]
    newcomers: tuple[str, ...]
    leaving: tuple[str, ...]
    # Why this barrier is the plain one after a PREPARE (the fallback), recorded; "" else.
    note: str = ""


@dataclass(frozen=True)
class RecordHold:
    """A participant acked CHECKPOINT: it holds at the step; rank 0 brings the write's facts."""

    decision_id: int
    member_id: str
    held_at: float
    checkpoint_digest: str = ""
    checkpoint_write_s: float = 0.0
    # Rank 0 held (with g) at this later step than the barrier's: the barrier moves to it.
    moved_to_step: int = 0
    # The step the participant held at, as its ack said (0: its launcher did not say).
    held_step: int = 0


@dataclass(frozen=True)
class SaveBarrierCheckpoint:
    """The barrier's checkpoint is good: every participant holds at it and rank 0 wrote it."""

    decision_id: int


@dataclass(frozen=True)
class Drain:
    """A leaver of a shrink: DRAINING, and DRAIN is sent."""

    member_id: str
    generation: int
    reason: str
    deadline_s: float


@dataclass(frozen=True)
class DrainOut:
    """A leaver past its drain deadline is GONE as if it had acked: not a loss."""

    member_id: str


@dataclass(frozen=True)
class OpenGeneration:
    """Generation g+1 of ``member_ids`` in rank order; RENDEZVOUS to each of them."""

    member_ids: tuple[str, ...]
    restore_step: int
    reason: str
    deadline_s: float
    decision_id: int | None = None
    # Overlap mode: what each member's PREPARE said, in rank order; their groups are formed,
    # so the RENDEZVOUS repeats it (with the restore step) and marks it prepared.
    prepared: tuple[RendezvousInfo, ...] = ()
    # A recovery's restart backoff: its workers start this late, seconds.
    start_delay_s: float = 0.0


@dataclass(frozen=True)
class EnterRendezvous:
    """The resize's g+1 is the generation just opened; ``newcomers`` set for a first one."""

    decision_id: int
    newcomers: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Complete:
    decision_id: int
    message: str
    pause_s: float = 0.0
    breakdown: Breakdown = field(default_factory=Breakdown)
    # Set when nothing had to move (already at the target size): the job's generation.
    to_generation: int | None = None


@dataclass(frozen=True)
class Abort:
    """ABORTED; the superseding and RESUMEs that go with it are separate effects."""

    decision_id: int
    message: str


@dataclass(frozen=True)
class Fail:
    decision_id: int
    message: str


@dataclass(frozen=True)
class AckedLeaver:
    """A leaver of the resize acked its DRAIN."""

    decision_id: int
    member_id: str


@dataclass(frozen=True)
class ExtendPhase:
    """The phase deadline starts again no earlier than ``at`` (after a restart, or after
    the store failed a commit: ``after`` says which)."""

    decision_id: int
    at: float
    after: str = "restart"


@dataclass(frozen=True)
class Lose:
    """Members (only their workers when ``worker_failed``) are lost; the phase decides the rest."""

    member_ids: tuple[str, ...]
    reason: str
    worker_failed: bool = False


@dataclass(frozen=True)
class Recover:
    """The current generation broke: re-form it from the last good checkpoint."""

    reason: str


@dataclass(frozen=True)
class ClearRanks:
    """Every member was lost: nobody holds a rank (finished members keep theirs)."""


@dataclass(frozen=True)
class RecordReached:
    """The step the generation before ``generation`` reached, which a recovery counts its
    lost steps from (never lowered)."""

    generation: int
    step: int
    # The member whose last word of the broken generation raised it; "" at first.
    last_word_of: str = ""


@dataclass(frozen=True)
class RecordRestored:
    """A member's new workers restored ``step`` in ``generation`` (its RENDEZVOUS ack):
    the generation's lost steps are what the one before reached past it."""

    generation: int
    member_id: str
    step: int


@dataclass(frozen=True)
class FailJob:
    """The job failed for good (its restart budget is spent): nothing re-forms it, every
    member is told to STOP, and the status says ``message``."""

    message: str


@dataclass(frozen=True)
class ReportCheckpoint:
    """A member's worker wrote and verified the checkpoint of ``step``: it is good."""

    member_id: str
    step: int
    digest: str
    generation: int


@dataclass(frozen=True)
class Finish:
    """The member's worker ran the job's budget to its end: GONE, keeping its rank."""

    member_id: str


@dataclass(frozen=True)
class LeaveDrained:
    """The member acked DRAIN (or STOP) and left."""

    member_id: str


@dataclass(frozen=True)
class AddMember:
    member: Member


@dataclass(frozen=True)
class Registered:
    """A launcher (re-)registered: its endpoint now, and it was heard from."""

    member_id: str
    host: str
    free_port: int
    pod_uid: str
    last_generation: int


@dataclass(frozen=True)
class StartResize:
    resize: Resize


@dataclass(frozen=True)
class CreditStall:
    """The coordinator did not run for ``seconds``: every silence and deadline moves by it."""

    seconds: float


@dataclass(frozen=True)
class RenewDeadlines:
    """After a restart: every pending directive gets ``timeout_s`` from now again, at least."""

    timeout_s: float


Effect = (
    Send
    | Prepare
    | BeginPrepare
    | RecordPrepared
    | RecordAck
    | Supersede
    | BeginBarrier
    | RecordHold
    | SaveBarrierCheckpoint
    | Drain
    | DrainOut
    | OpenGeneration
    | EnterRendezvous
    | Complete
    | Abort
    | Fail
    | AckedLeaver
    | ExtendPhase
    | Lose
    | Recover
    | ClearRanks
    | RecordReached
    | RecordRestored
    | FailJob
    | ReportCheckpoint
    | Finish
    | LeaveDrained
    | AddMember
    | Registered
    | StartResize
    | CreditStall
    | RenewDeadlines
)
