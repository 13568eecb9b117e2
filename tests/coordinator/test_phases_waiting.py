"""WAITING_FOR_MEMBERS (engine/phases/waiting.py): its case for every event, and how a
first generation, a no-op resize and a shrink begin."""

from __future__ import annotations

import pytest

from tests.coordinator.builders import job, resize
from tests.coordinator.phase_support import (
    E,
    K,
    P,
    Result,
    _any_ack,
    _barrier,
    _ctx,
    _finished,
    _lose,
)
from tide.services.coordinator.engine.effects import (
    Abort,
    BeginBarrier,
    Complete,
    Drain,
    EnterRendezvous,
    OpenGeneration,
    Recover,
    SaveBarrierCheckpoint,
    Send,
)
from tide.services.coordinator.engine.phases import PHASES, ResizeEvent

pytestmark = pytest.mark.unit


def waiting(event: ResizeEvent) -> Result:
    s = job()
    r = resize(s, P.WAITING_FOR_MEMBERS)
    c, h = _ctx(s), PHASES[P.WAITING_FOR_MEMBERS]
    aborted = "the coordinator restarted before the barrier completed"
    match event:
        case E.ADVANCE:  # a newcomer registered: 2 running + 1 standby reach 3
            # S = 10 + max(2 steps, 1 step/s * 3 s)
            return h.advance(c, r), [
                BeginBarrier(1, 13, ("m0", "m1"), ("s0",), ()),
                Send("m0", K.CHECKPOINT, 1, "decision 1", 40.0, 13),
                Send("m1", K.CHECKPOINT, 1, "decision 1", 40.0, 13),
            ]
        case E.DEADLINE:
            del s.members["s0"]
            msg = "0 of 1 newcomer(s) registered within 40.0 s; min world size 3"
            return h.on_deadline(c, r), [Abort(1, msg)]
        case E.MEMBER_LOST:
            return _lose(s, r, "m1"), [Abort(1, "member(s) m1 lost: gone"), Recover("gone")]
        case E.ABORT_REQUEST:
            return h.on_abort_request(c, r, "scaler"), [Abort(1, "aborted on request: scaler")]
        case E.JOB_FINISHED:
            _finished(s)
            return h.on_job_finished(c, r), [Abort(1, "the job finished at step 10")]
        case E.RESTART:
            return h.on_restart(c, r), [Abort(1, aborted)]
    # Nothing was sent in this phase yet: an ack of any kind changes nothing here.
    return h.on_ack(c, r, _any_ack(event)), []


def test_first_generation_opens_from_standby_members_without_a_barrier() -> None:
    s = job(actives=0, standby=2)
    r = resize(s, P.WAITING_FOR_MEMBERS, target=2)
    assert PHASES[r.phase].advance(_ctx(s), r) == [
        OpenGeneration(("s0", "s1"), 0, "decision 1", 40.0, decision_id=1),
        EnterRendezvous(1, newcomers=("s0", "s1")),
    ]


def test_a_resize_to_the_current_size_completes_at_once() -> None:
    s = job()
    r = resize(s, P.WAITING_FOR_MEMBERS, target=2)
    done = Complete(1, "already at world size 2", to_generation=1)
    assert PHASES[r.phase].advance(_ctx(s), r) == [done]


def test_a_shrink_drains_the_leavers_and_opens_g_plus_1_in_one_step() -> None:
    s = job(actives=3, standby=0)
    r = resize(s, P.WAITING_FOR_MEMBERS, target=2)
    begin = PHASES[r.phase].advance(_ctx(s), r)[0]
    assert begin == BeginBarrier(1, 13, ("m0", "m1", "m2"), (), ("m2",))
    r = _barrier(s, participants=("m0", "m1", "m2"), newcomers=(), leaving=("m2",))
    r.acked = ("m0", "m1", "m2")
    assert PHASES[r.phase].advance(_ctx(s), r) == [
        SaveBarrierCheckpoint(1),
        Drain("m2", 1, "decision 1: leaving", 40.0),
        OpenGeneration(("m0", "m1"), 13, "decision 1", 40.0, decision_id=1),
        EnterRendezvous(1),
    ]
