"""The decision lifecycle: states, the legal edges, and what each state authorizes.

The edge table is the store's (``repo.DECISION_TRANSITIONS``), so the
database refuses exactly what this module would. What a state *means*
depends on the direction of the resize (docs/scaler.md has the diagram):

======================  ===============================  ================================
state (committed)       grow N → M authorizes            shrink N → M authorizes
======================  ===============================  ================================
PENDING                 nothing (persisted intent)       nothing
PREPARING               actuator.set_replicas(M):        coordinator Resize(M): checkpoint
                        newcomers schedule and warm up   barrier, DRAIN, re-rendezvous
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

import logging
import os
import signal
from collections.abc import Mapping

from tide.v1 import common_pb2

from services.scaler.repo import DECISION_TRANSITIONS, FINAL_STATES, DecisionState

logger = logging.getLogger(__name__)

__all__ = [
    "DECISION_TRANSITIONS",
    "FINAL_STATES",
    "DecisionState",
    "FaultPoint",
    "can_transition",
    "state_to_proto",
]

_PROTO: Mapping[DecisionState, common_pb2.DecisionState.ValueType] = {
    s: common_pb2.DecisionState.Value(f"DECISION_STATE_{s.value}") for s in DecisionState
}
_FROM_PROTO: Mapping[int, DecisionState] = {v: k for k, v in _PROTO.items()}


def can_transition(old: DecisionState, new: DecisionState) -> bool:
    return new in DECISION_TRANSITIONS[old]


def state_to_proto(state: DecisionState) -> common_pb2.DecisionState.ValueType:
    return _PROTO[state]


def state_from_proto(value: int) -> DecisionState:
    return _FROM_PROTO[value]


#: Environment variable that arms a fault point, e.g. ``decision:PREPARING`` (right
#: after PREPARING is committed, before its side effect) or ``decision:PREPARING+effect``
#: (right after the side effect, before the next commit).
FAULT_ENV = "TIDE_FAULT"


class FaultPoint:
    """Kills this process with SIGKILL when the armed point is reached (crash tests)."""

    def __init__(self, armed: str | None = None) -> None:
        self.armed = armed if armed is not None else os.environ.get(FAULT_ENV, "")

    def __call__(self, point: str) -> None:
        if self.armed and point == self.armed:
            logger.error("fault point %s reached: SIGKILL", point)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
