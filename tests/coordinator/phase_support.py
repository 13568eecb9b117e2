"""What the resize-phase tests share: the tuning and clock they run with, a barrier in
CHECKPOINTING, the context, acks, a member's loss and the job's end as the outbox would
bring them to a handler, and the shape of a (phase, event) case.

Its own module because test_phases.py (the table) and the tests of each handler room
(test_phases_waiting.py, test_phases_barrier.py, test_phases_rendezvous.py) all use it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tests.coordinator.builders import resize
from tide.services.coordinator.domain import DirectiveKind, MemberState, Resize, ResizePhase
from tide.services.coordinator.engine.effects import Effect, Send, Supersede
from tide.services.coordinator.engine.phases import AckEvent, Context, ResizeEvent, rules
from tide.services.coordinator.engine.state import JobState
from tide.services.coordinator.settings import Tuning

P, E, K = ResizePhase, ResizeEvent, DirectiveKind
TUNING = Tuning(
    heartbeat_timeout_s=30.0,
    phase_timeout_s=40.0,
    checkpoint_min_lead_steps=2,
    checkpoint_lead_s=3.0,
)
NOW = 100.0
CKPT = frozenset({K.CHECKPOINT})
PREP = frozenset({K.PREPARE})
OVERLAP = dataclasses.replace(TUNING, resize_mode="overlap")
ENDPOINTS = ("h:1000", "h:1001", "h:1010")


def _barrier(s: JobState, **fields: Any) -> Resize:
    base: dict[str, Any] = {
        "participants": ("m0", "m1"),
        "newcomers": ("s0",),
        "checkpoint_step": 13,
    }
    return resize(s, P.CHECKPOINTING, **{**base, **fields})


def _ctx(s: JobState) -> Context:
    return Context(s, TUNING, NOW)


def _ack(mid: str, kind: DirectiveKind, ok: bool = True, **kw: object) -> AckEvent:
    return AckEvent(mid, kind, ok, **kw)  # type: ignore[arg-type]


def _lose(s: JobState, r: Resize | None, mid: str) -> list[Effect]:
    """What the outbox does before asking the phase: the member is GONE, rank cleared."""
    m = s.members[mid]
    broken = m.state == MemberState.ACTIVE and m.rank is not None
    m.state, m.rank = MemberState.GONE, None
    return rules(r).on_loss(_ctx(s), r, [mid], broken, "gone")


def _finished(s: JobState) -> None:
    for m in s.members.values():
        if m.rank is not None:
            m.state = MemberState.GONE


def _resumes(*ids: str, why: str = "decision 1 aborted") -> list[Effect]:
    out: list[Effect] = []
    for mid in ids:
        out += [Supersede(mid, CKPT), Send(mid, K.RESUME, 1, why, 30.0)]
    return out


# (what the handler returned, what it should have): compared as lists.
Result = tuple[list[Effect], list[Any]]
Case = Callable[[], Result]


def _any_ack(event: ResizeEvent) -> AckEvent:
    if event == E.ACK_CHECKPOINT_PAST:
        return _ack(
            "m0", K.CHECKPOINT, directive_step=13, checkpoint_step=18, checkpoint_digest="x"
        )
    if event == E.ACK_CHECKPOINT_APART:
        return _ack("m1", K.CHECKPOINT, directive_step=13, checkpoint_step=14)
    kind = {
        E.ACK_CHECKPOINT: K.CHECKPOINT,
        E.NACK_CHECKPOINT: K.CHECKPOINT,
        E.ACK_RENDEZVOUS: K.RENDEZVOUS,
        E.ACK_DRAIN: K.DRAIN,
        E.ACK_PREPARE: K.PREPARE,
        E.NACK_PREPARE: K.PREPARE,
    }[event]
    ok = event not in (E.NACK_CHECKPOINT, E.NACK_PREPARE)
    return _ack("m0", kind, ok=ok, directive_step=13)
