"""The launcher's words in the coordinator's proto: a beat's state as a worker phase, a
directive as the launcher's :class:`Directive`. It changes with the proto, apart from the
link's connection handling (tide/trainer/launcher/link.py)."""

from __future__ import annotations

from tide.trainer.launcher.model import Directive, DirectiveKind, RendezvousPlan, State
from tide.v1 import coordinator_pb2 as pb

PHASE = {
    State.STANDBY: pb.WORKER_PHASE_IDLE,
    State.STARTING: pb.WORKER_PHASE_STARTING,
    State.RUNNING: pb.WORKER_PHASE_RUNNING,
    State.HOLDING: pb.WORKER_PHASE_HOLDING,
    State.FAILED: pb.WORKER_PHASE_FAILED,
    State.DRAINING: pb.WORKER_PHASE_HOLDING,
    State.DONE: pb.WORKER_PHASE_IDLE,
}

_KINDS = {
    pb.Directive.KIND_RENDEZVOUS: DirectiveKind.RENDEZVOUS,
    pb.Directive.KIND_CHECKPOINT: DirectiveKind.CHECKPOINT,
    pb.Directive.KIND_HOLD: DirectiveKind.HOLD,
    pb.Directive.KIND_RESUME: DirectiveKind.RESUME,
    pb.Directive.KIND_DRAIN: DirectiveKind.DRAIN,
    pb.Directive.KIND_STOP: DirectiveKind.STOP,
    pb.Directive.KIND_PREPARE: DirectiveKind.PREPARE,
}


def directive_of(d: pb.Directive) -> Directive:
    kind = _KINDS.get(d.kind, DirectiveKind.UNKNOWN)
    try:
        name = pb.Directive.Kind.Name(d.kind)
    except ValueError:
        name = f"KIND_{d.kind}"
    plan = None
    # A CHECKPOINT carries one in overlap mode: g+1's prepared RENDEZVOUS (the barrier commits).
    if kind in (DirectiveKind.RENDEZVOUS, DirectiveKind.PREPARE) or (
        kind is DirectiveKind.CHECKPOINT and d.HasField("rendezvous")
    ):
        r = d.rendezvous
        plan = RendezvousPlan(
            rank=r.rank,
            world_size=r.world_size,
            master_endpoint=r.master_endpoint,
            trainer_endpoints=tuple(r.trainer_endpoints),
            restore_step=r.restore_step,
            prepared=r.prepared,
            generation=r.generation,
            start_delay_s=r.start_delay_s,
        )
    return Directive(
        d.directive_id, d.generation, kind, name, d.checkpoint_step, plan, leaving=d.leaving
    )
