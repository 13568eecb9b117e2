"""The decision lifecycle: states, the legal edges, and what each state authorizes.

The edge table is the store's (``store.DECISION_LIFECYCLE``, a
tide.base.lifecycle.TransitionTable), so the database refuses exactly what
this module describes. What a state *means*
depends on the direction of the resize (docs/scaler.md has the diagram):

======================  ===============================  ================================
state (committed)       grow N → M authorizes            shrink N → M authorizes
======================  ===============================  ================================
PENDING                 nothing (persisted intent)       nothing
PREPARING               actuator.set_replicas(M):        coordinator Resize(M): checkpoint
                        newcomers schedule and warm up   barrier, then DRAIN + RENDEZVOUS
ACTUATING               coordinator Resize(M): wait for  actuator.set_replicas(M): the
                        newcomers, checkpoint, switch    drained pods go
COMPLETED / ABORTED /   nothing more (an abort of a grow restored N before it was recorded)
FAILED
======================  ===============================  ================================

Every transition is committed, with its decision_events row, before the side
effect it authorizes; a crash between the commit and the effect is resumed on
restart by repeating the effect, which is idempotent (set_replicas to a count;
Resize on the same decision_id).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from tide.services.scaler.store.records import DECISION_LIFECYCLE, FINAL_STATES, DecisionState
from tide.v1 import common_pb2

__all__ = [
    "DECISION_LIFECYCLE",
    "FINAL_STATES",
    "DecisionState",
    "FaultHook",
    "state_from_proto",
    "state_to_proto",
]

#: Called with the name of each point a decision passes: ``decision:<STATE>`` right
#: after that state is committed, ``decision:<STATE>+effect`` right after the side
#: effect it authorizes. Production passes none; the crash tests' hook
#: (tide.services.testing.faults) kills the process at one of them.
FaultHook = Callable[[str], None]

_PROTO: Mapping[DecisionState, common_pb2.DecisionState.ValueType] = {
    s: common_pb2.DecisionState.Value(f"DECISION_STATE_{s.value}") for s in DecisionState
}
_FROM_PROTO: Mapping[int, DecisionState] = {v: k for k, v in _PROTO.items()}


def state_to_proto(state: DecisionState) -> common_pb2.DecisionState.ValueType:
    return _PROTO[state]


def state_from_proto(value: int) -> DecisionState:
    return _FROM_PROTO[value]
