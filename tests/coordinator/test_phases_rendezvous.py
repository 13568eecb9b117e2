"""RENDEZVOUS (engine/phases/rendezvous.py): its case for every event, with g+1 formed
from m0, m1 and s0 while the leaver m2 drains."""

from __future__ import annotations

import pytest

from tests.coordinator.builders import generation, job, resize
from tests.coordinator.phase_support import (
    NOW,
    E,
    K,
    P,
    Result,
    _ack,
    _any_ack,
    _ctx,
    _finished,
    _lose,
)
from tide.services.coordinator.domain import Breakdown, Directive, MemberState, Resize
from tide.services.coordinator.engine.effects import (
    AckedLeaver,
    Complete,
    DrainOut,
    ExtendPhase,
    Fail,
    Lose,
    Recover,
)
from tide.services.coordinator.engine.phases import PHASES, ResizeEvent
from tide.services.coordinator.engine.state import JobState

pytestmark = pytest.mark.unit


def _rendezvous(s: JobState, *, started: bool = True, leaver: bool = False) -> Resize:
    """g+1 = 2 of m0, m1, s0 sent; every member stepped in it when ``started``."""
    s.job.generation = 2
    s.generations[2] = generation(2, ("m0", "m1", "s0"), decision_id=1)
    for rank, mid in enumerate(("m0", "m1", "s0")):
        m = s.members[mid]
        m.state, m.rank = MemberState.ACTIVE, rank
        if started:
            m.reported_generation, m.first_step_at = 2, 95.0
    if leaver:
        s.members["m2"].state, s.members["m2"].rank = MemberState.DRAINING, None
    return resize(
        s,
        P.RENDEZVOUS,
        participants=("m0", "m1", "m2") if leaver else ("m0", "m1"),
        newcomers=("s0",),
        leaving=("m2",) if leaver else (),
        checkpoint_step=13,
        to_generation=2,
        held_at_latest=90.0,
        checkpoint_write_s=0.25,
        rendezvous_sent_at=91.0,
    )


def rendezvous(event: ResizeEvent) -> Result:
    s = job(actives=3)
    r = _rendezvous(s, started=event != E.DEADLINE, leaver=True)
    c, h = _ctx(s), PHASES[P.RENDEZVOUS]
    match event:
        case E.ADVANCE:  # every member of g+1 stepped, the leaver is gone
            s.members["m2"].state = MemberState.GONE
            pause = Breakdown(barrier_s=0.75, checkpoint_write_s=0.25)
            done = Complete(1, "generation 2 runs with 3 member(s)", 5.0, pause)
            return h.advance(c, r), [done]
        case E.ACK_DRAIN:
            return h.on_ack(c, r, _ack("m2", K.DRAIN)), [AckedLeaver(1, "m2")]
        case E.DEADLINE:  # s0 never acked its RENDEZVOUS; the leaver never acked DRAIN
            for mid in ("m0", "m1"):
                s.members[mid].reported_generation, s.members[mid].first_step_at = 2, 95.0
            s.directives["d9"] = Directive("ns/j", "d9", "s0", K.RENDEZVOUS, 2, 0.0, seq=9)
            msg = "generation 2 not running after 40.0 s: no first step from s0"
            want = [DrainOut("m2"), Fail(1, msg), Lose(("s0",), "RENDEZVOUS not acknowledged")]
            return h.on_deadline(c, r), want
        case E.MEMBER_LOST:
            msg = "member(s) m1 lost while generation 2 formed: gone"
            return _lose(s, r, "m1"), [Fail(1, msg), Recover("gone")]
        case E.JOB_FINISHED:  # the leaver still drains: not complete, so it failed
            _finished(s)
            return h.on_job_finished(c, r), [Fail(1, "the job finished at step 10")]
        case E.RESTART:
            return h.on_restart(c, r), [ExtendPhase(1, NOW)]
        case E.ABORT_REQUEST:  # too late: the old generation cannot resume
            return h.on_abort_request(c, r, "scaler"), []
    # The member's side of a RENDEZVOUS ack is membership's; a CHECKPOINT is moot now.
    return h.on_ack(c, r, _any_ack(event)), []
