"""The resize-phase table: one handler per :class:`ResizePhase`, holding that phase's
rules for every event, keyed by phase in :data:`PHASES`.

A handler reads the job's state and returns effects; it never changes anything
(:mod:`tide.services.coordinator.engine.outbox` performs the effects). Events:

- ``advance``: something changed that may let the phase move on (a member
  registered, an ack arrived, a first step was reported); also the phase's entry;
- ``on_ack``: a member acked a directive of this phase;
- ``on_deadline``: the phase's deadline passed;
- ``on_loss``: members were lost (``gen_broken``: one had a rank in the current
  generation, so it must re-form unless the phase does it itself);
- ``on_abort_request``: AbortResize; ``on_job_finished``: the last member
  finished; ``on_restart``: the coordinator was restarted with this resize.

Adding a phase is one handler (in the module of the phases it changes with), listed in
:data:`PHASES` here, plus its row in ``RESIZE_TRANSITIONS``;
tests/coordinator/test_phases.py fails until every event of it has a case.

This module is the table and its dispatch; the handlers live in their own rooms:
:mod:`.base` (events, context, the handler base and the shared rules),
:mod:`.waiting` (WAITING_FOR_MEMBERS), :mod:`.barrier` (PREPARING, CHECKPOINTING) and
:mod:`.rendezvous` (RENDEZVOUS). Other code imports from here.
"""

from __future__ import annotations

from collections.abc import Mapping

from tide.services.coordinator.domain import RESIZE_TRANSITIONS, Resize, ResizePhase
from tide.services.coordinator.engine.phases.barrier import Checkpointing, Preparing
from tide.services.coordinator.engine.phases.base import (
    AckEvent,
    Context,
    PhaseHandler,
    ResizeEvent,
)
from tide.services.coordinator.engine.phases.rendezvous import Rendezvous
from tide.services.coordinator.engine.phases.waiting import WaitingForMembers

__all__ = [
    "PHASES",
    "AckEvent",
    "Checkpointing",
    "Context",
    "Final",
    "PhaseHandler",
    "Preparing",
    "Rendezvous",
    "ResizeEvent",
    "WaitingForMembers",
    "longest_chain",
    "rules",
]


class Final(PhaseHandler):
    """COMPLETED, ABORTED, FAILED, and a job without a resize: no resize rule applies."""


_FINAL = Final()

# Each live handler names its phase once (its ``phase``); every final phase shares Final.
PHASES: Mapping[ResizePhase, PhaseHandler] = {
    **{
        h.phase: h
        for h in (WaitingForMembers(), Preparing(), Checkpointing(), Rendezvous())
        if h.phase is not None
    },
    **{p: _FINAL for p in ResizePhase if p.final},
}

_missing = [p.name for p in ResizePhase if p not in PHASES]
if _missing:
    raise RuntimeError(f"resize phases without a handler: {', '.join(_missing)}")
if any(p.final != isinstance(h, Final) for p, h in PHASES.items()):
    raise RuntimeError("a final phase must have the Final handler, and only a final phase")


def rules(r: Resize | None) -> PhaseHandler:
    """The handler of ``r``'s phase; the Final one when the job has no active resize."""
    return PHASES[r.phase] if r is not None else _FINAL


def longest_chain() -> int:
    """The most phase changes one operation can make: the longest path of the table,
    which has no cycle (a resize never goes back)."""

    def depth(p: ResizePhase, seen: frozenset[ResizePhase]) -> int:
        if p in seen:
            raise RuntimeError(f"the resize table has a cycle through {p.name}")
        return max((1 + depth(q, seen | {p}) for q in RESIZE_TRANSITIONS.allowed(p)), default=0)

    return max(depth(p, frozenset()) for p in ResizePhase)
