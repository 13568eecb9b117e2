"""The resize-phase table without gRPC: for each phase and each event, the effects.

Every (phase, event) pair has a case in CASES; test_every_pair_has_a_case fails when
a phase or an event is added without one.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest

from services.coordinator.domain import (
    Breakdown,
    Directive,
    DirectiveKind,
    MemberState,
    Resize,
    ResizePhase,
)
from services.coordinator.engine.effects import (
    Abort,
    AckedLeaver,
    BeginBarrier,
    Complete,
    Drain,
    DrainOut,
    Effect,
    EnterRendezvous,
    ExtendPhase,
    Fail,
    Lose,
    OpenGeneration,
    RecordHold,
    Recover,
    SaveBarrierCheckpoint,
    Send,
    Supersede,
)
from services.coordinator.engine.membership import check_heartbeat
from services.coordinator.engine.outbox import MAX_PHASE_CHANGES
from services.coordinator.engine.phases import (
    PHASES,
    AckEvent,
    Context,
    ResizeEvent,
    longest_chain,
    rules,
)
from services.coordinator.engine.state import JobState
from services.coordinator.errors import StaleGeneration
from services.coordinator.settings import Tuning
from tests.coordinator.builders import generation, job, resize

pytestmark = pytest.mark.unit

P, E, K = ResizePhase, ResizeEvent, DirectiveKind
TUNING = Tuning(
    heartbeat_timeout_s=30.0,
    phase_timeout_s=40.0,
    checkpoint_min_lead_steps=2,
    checkpoint_lead_s=3.0,
)
NOW = 100.0
CKPT = frozenset({K.CHECKPOINT})


def _barrier(s: JobState, **fields: Any) -> Resize:
    base: dict[str, Any] = {
        "participants": ("m0", "m1"),
        "newcomers": ("s0",),
        "checkpoint_step": 13,
    }
    return resize(s, P.CHECKPOINTING, **{**base, **fields})


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


def checkpointing(event: ResizeEvent) -> Result:
    s = job()
    r = _barrier(s)
    c, h = _ctx(s), PHASES[P.CHECKPOINTING]
    match event:
        case E.ADVANCE:  # the last participant acked: g+1 of the holders and the newcomer
            r.acked = ("m0", "m1")
            return h.advance(c, r), [
                SaveBarrierCheckpoint(1),
                OpenGeneration(("m0", "m1", "s0"), 13, "decision 1", 40.0, decision_id=1),
                EnterRendezvous(1),
            ]
        case E.ACK_CHECKPOINT:
            ack = _ack(
                "m0",
                K.CHECKPOINT,
                directive_step=13,
                checkpoint_step=13,
                checkpoint_digest="abc",
                held_at=99.0,
                checkpoint_write_s=0.25,
            )
            return h.on_ack(c, r, ack), [RecordHold(1, "m0", 99.0, "abc", 0.25)]
        case E.NACK_CHECKPOINT:
            ack = _ack("m1", K.CHECKPOINT, ok=False, directive_step=13, message="disk full")
            msg = "member m1 could not checkpoint step 13: disk full"
            return h.on_ack(c, r, ack), [*_resumes("m0", "m1"), Abort(1, msg)]
        case E.DEADLINE:
            r.acked = ("m0",)
            msg = "barrier deadline (40.0 s) passed; no ack of CHECKPOINT step 13 from m1"
            return h.on_deadline(c, r), [*_resumes("m0", "m1"), Abort(1, msg)]
        case E.MEMBER_LOST:  # the generation broke: nobody resumes it, it re-forms
            msg = "member(s) m1 lost during the barrier: gone"
            want = [Supersede("m0", CKPT), Supersede("m1", CKPT), Abort(1, msg), Recover("gone")]
            return _lose(s, r, "m1"), want
        case E.ABORT_REQUEST:
            msg = "aborted on request: no reason given"
            return h.on_abort_request(c, r, ""), [*_resumes("m0", "m1"), Abort(1, msg)]
        case E.JOB_FINISHED:
            _finished(s)
            msg = "the job finished at step 10"
            want = [Supersede("m0", CKPT), Supersede("m1", CKPT), Abort(1, msg)]
            return h.on_job_finished(c, r), want
        case E.RESTART:
            msg = "the coordinator restarted before the barrier completed"
            return h.on_restart(c, r), [*_resumes("m0", "m1"), Abort(1, msg)]
    # RENDEZVOUS and DRAIN are not sent before the barrier ends.
    return h.on_ack(c, r, _any_ack(event)), []


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


def _any_ack(event: ResizeEvent) -> AckEvent:
    kind = {
        E.ACK_CHECKPOINT: K.CHECKPOINT,
        E.NACK_CHECKPOINT: K.CHECKPOINT,
        E.ACK_RENDEZVOUS: K.RENDEZVOUS,
        E.ACK_DRAIN: K.DRAIN,
    }[event]
    return _ack("m0", kind, ok=event != E.NACK_CHECKPOINT, directive_step=13)


def final(phase: ResizePhase, event: ResizeEvent) -> Result:
    """A final phase ignores every event; a loss of the generation re-forms it."""
    s = job()
    r = resize(s, phase)
    c, h = _ctx(s), PHASES[phase]
    calls: dict[ResizeEvent, Callable[[], list[Effect]]] = {
        E.ADVANCE: lambda: h.advance(c, r),
        E.DEADLINE: lambda: h.on_deadline(c, r),
        E.MEMBER_LOST: lambda: h.on_loss(c, r, ["m1"], True, "gone"),
        E.ABORT_REQUEST: lambda: h.on_abort_request(c, r, "x"),
        E.JOB_FINISHED: lambda: h.on_job_finished(c, r),
        E.RESTART: lambda: h.on_restart(c, r),
    }
    got = calls.get(event, lambda: h.on_ack(c, r, _any_ack(event)))()
    return got, [Recover("gone")] if event == E.MEMBER_LOST else []


HANDLERS = {
    P.WAITING_FOR_MEMBERS: waiting,
    P.CHECKPOINTING: checkpointing,
    P.RENDEZVOUS: rendezvous,
}


def _case(p: ResizePhase, e: ResizeEvent) -> Case:
    handler = HANDLERS.get(p)
    return (lambda: handler(e)) if handler is not None else (lambda: final(p, e))


CASES: dict[tuple[ResizePhase, ResizeEvent], Case] = {
    (p, e): _case(p, e)
    for p, e in itertools.product([*HANDLERS, P.COMPLETED, P.ABORTED, P.FAILED], list(ResizeEvent))
}


def test_every_pair_has_a_case() -> None:
    assert set(CASES) == set(itertools.product(ResizePhase, ResizeEvent))
    assert set(PHASES) == set(ResizePhase)


@pytest.mark.parametrize(
    ("phase", "event"), list(CASES), ids=[f"{p.name}-{e.name}" for p, e in CASES]
)
def test_phase_event(phase: ResizePhase, event: ResizeEvent) -> None:
    got, want = CASES[(phase, event)]()
    assert got == want


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


def test_a_barrier_waits_for_every_participant_and_ignores_an_older_barriers_ack() -> None:
    s = job()
    r = _barrier(s, acked=("m0",))
    h = PHASES[r.phase]
    assert h.advance(_ctx(s), r) == []
    assert h.on_ack(_ctx(s), r, _ack("m1", K.CHECKPOINT, directive_step=7)) == []


def test_rank_0_without_the_checkpoint_aborts_the_barrier() -> None:
    s = job()
    r = _barrier(s)
    got = PHASES[r.phase].on_ack(_ctx(s), r, _ack("m0", K.CHECKPOINT, directive_step=13))
    msg = "rank 0 (m0) acked without the checkpoint of step 13 (got step 0)"
    assert got == [*_resumes("m0", "m1"), Abort(1, msg)]


def test_the_phase_loop_is_bounded_by_the_longest_path_of_the_table() -> None:
    # WAITING_FOR_MEMBERS -> CHECKPOINTING -> RENDEZVOUS -> COMPLETED
    assert longest_chain() == MAX_PHASE_CHANGES == 3


@pytest.mark.parametrize(
    ("reported", "named", "stale"),
    [
        (3, 3, False),  # the current one
        (3, 2, False),  # the one before: its RENDEZVOUS of 3 was in flight, or its last word
        (3, 1, True),  # left twice since
        (0, 0, False),  # a newcomer that never ran
    ],
)
def test_a_heartbeat_is_stale_only_for_a_generation_left_twice(
    reported: int, named: int, stale: bool
) -> None:
    s = job()
    for g in (2, 3):
        s.generations[g] = generation(g, ("m0", "m1"))
    m = s.members["m0"]
    m.reported_generation = reported
    if stale:
        with pytest.raises(StaleGeneration, match=f"generation {named}"):
            check_heartbeat(s, m, named)
    else:
        check_heartbeat(s, m, named)


def test_a_standby_that_ran_long_ago_may_report_that_generation() -> None:
    s = job()  # s0 ran in generation 1 only, then waited as a standby through 2 and 3
    s.generations[1] = generation(1, ("m0", "m1", "s0"))
    s.generations[3] = generation(3, ("m0", "m1"))
    s.members["s0"].reported_generation = 1
    check_heartbeat(s, s.members["s0"], 1)
