"""What every phase handler shares: the events (:class:`ResizeEvent`), what a handler is
given (:class:`Context`, :class:`AckEvent`), the :class:`PhaseHandler` base with its
"nothing happens" defaults, and the rules more than one phase applies the same way
(aborting, opening a generation, the job-finished message).

Its own room because the handler modules all stand on it and none of it belongs to one
phase: a new event changes this module and every handler, a new phase changes none of it.
The underscore helpers are shared within ``phases`` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from tide.services.coordinator.domain import DirectiveKind, Member, MemberState, Resize, ResizePhase
from tide.services.coordinator.engine.effects import (
    Abort,
    Effect,
    EnterRendezvous,
    Fail,
    OpenGeneration,
    Recover,
    Send,
    Supersede,
)
from tide.services.coordinator.engine.state import JobState
from tide.services.coordinator.settings import Tuning


class ResizeEvent(Enum):
    """Every event a phase handler answers; the unit tests cover each with each phase."""

    ADVANCE = "advance"
    ACK_CHECKPOINT = "ack CHECKPOINT"
    # Rank 0 held past the CHECKPOINT's step, with the checkpoint of where it held (the
    # directive came after g passed the step).
    ACK_CHECKPOINT_PAST = "ack CHECKPOINT held past its step"
    # A rank held at another step than a rank that acked before it.
    ACK_CHECKPOINT_APART = "ack CHECKPOINT held apart"
    NACK_CHECKPOINT = "nack CHECKPOINT"
    ACK_RENDEZVOUS = "ack RENDEZVOUS"
    ACK_DRAIN = "ack DRAIN"
    ACK_PREPARE = "ack PREPARE"
    NACK_PREPARE = "nack PREPARE"
    DEADLINE = "deadline"
    MEMBER_LOST = "member lost"
    ABORT_REQUEST = "AbortResize"
    JOB_FINISHED = "job finished"
    RESTART = "restart"


@dataclass(frozen=True)
class Context:
    state: JobState
    tuning: Tuning
    now: float


@dataclass(frozen=True)
class AckEvent:
    member_id: str
    kind: DirectiveKind
    ok: bool
    # The step the acked directive named (CHECKPOINT), to ignore an older barrier's ack.
    directive_step: int = 0
    checkpoint_step: int = 0
    checkpoint_digest: str = ""
    held_at: float | None = None
    checkpoint_write_s: float = 0.0
    message: str = ""


class PhaseHandler:
    """The rules of one phase; the defaults are "nothing happens"."""

    phase: ResizePhase | None = None

    def advance(self, c: Context, r: Resize) -> list[Effect]:
        return []

    def on_ack(self, c: Context, r: Resize, ack: AckEvent) -> list[Effect]:
        return []

    def on_deadline(self, c: Context, r: Resize) -> list[Effect]:
        return []

    def on_loss(
        self, c: Context, r: Resize | None, lost: Sequence[str], gen_broken: bool, reason: str
    ) -> list[Effect]:
        return [Recover(reason)] if gen_broken else []

    def on_abort_request(self, c: Context, r: Resize, reason: str) -> list[Effect]:
        return []

    def on_job_finished(self, c: Context, r: Resize) -> list[Effect]:
        return []

    def on_restart(self, c: Context, r: Resize) -> list[Effect]:
        return []


def _abort(c: Context, r: Resize, message: str, *, resume: bool = True) -> list[Effect]:
    """ABORTED; in a barrier the CHECKPOINTs are withdrawn and the holders RESUME."""
    out: list[Effect] = []
    if r.phase == ResizePhase.PREPARING:
        # g never stopped: nothing to resume. The standbys' groups are simply not used.
        for mid in (*r.participants, *r.newcomers):
            if mid not in r.leaving:
                out.append(Supersede(mid, frozenset({DirectiveKind.PREPARE})))
    if r.phase == ResizePhase.CHECKPOINTING:
        for mid in r.participants:
            out.append(Supersede(mid, frozenset({DirectiveKind.CHECKPOINT})))
            if resume and c.state.members[mid].state == MemberState.ACTIVE:
                out.append(
                    Send(
                        mid,
                        DirectiveKind.RESUME,
                        c.state.job.generation,
                        reason=f"decision {r.decision_id} aborted",
                        deadline_s=c.tuning.heartbeat_timeout_s,
                    )
                )
    out.append(Abort(r.decision_id, message))
    return out


def _open(
    c: Context, r: Resize, ordered: Sequence[Member], restore: int, *, first: bool
) -> list[Effect]:
    if not ordered:
        return [Fail(r.decision_id, "no member left to form a generation")]
    ids = tuple(m.member_id for m in ordered)
    return [
        OpenGeneration(
            ids,
            restore,
            reason=f"decision {r.decision_id}",
            deadline_s=r.deadline_s,
            decision_id=r.decision_id,
            prepared=() if first else c.state.prepared_rendezvous(r, ids),
        ),
        EnterRendezvous(r.decision_id, newcomers=ids if first else None),
    ]


def _finished_message(c: Context) -> str:
    if c.state.job.failure:
        return f"the job failed: {c.state.job.failure}"
    return f"the job finished at step {c.state.finished_step()}"
