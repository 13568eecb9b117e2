"""The resize-phase table without gRPC: for each phase and each event, the effects.

Every (phase, event) pair has a case in CASES; test_every_pair_has_a_case fails when
a phase or an event is added without one.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import pytest

from services.coordinator.domain import (
    Breakdown,
    Directive,
    DirectiveKind,
    MemberState,
    RendezvousInfo,
    Resize,
    ResizePhase,
)
from services.coordinator.engine.effects import (
    Abort,
    AckedLeaver,
    BeginBarrier,
    BeginPrepare,
    Complete,
    Drain,
    DrainOut,
    Effect,
    EnterRendezvous,
    ExtendPhase,
    Fail,
    Lose,
    OpenGeneration,
    Prepare,
    RecordHold,
    RecordPrepared,
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
from tidebase.errors import ConfigError

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


def _preparing(s: JobState, **fields: Any) -> Resize:
    base: dict[str, Any] = {"participants": ("m0", "m1"), "newcomers": ("s0",)}
    return resize(s, P.PREPARING, **{**base, **fields})


def _withdrawn(*ids: str) -> list[Effect]:
    return [Supersede(mid, PREP) for mid in ids]


def _plain_barrier(note: str = "") -> list[Effect]:
    return [
        BeginBarrier(1, 13, ("m0", "m1"), ("s0",), (), note),
        Send("m0", K.CHECKPOINT, 1, "decision 1", 40.0, 13),
        Send("m1", K.CHECKPOINT, 1, "decision 1", 40.0, 13),
    ]


def preparing(event: ResizeEvent) -> Result:
    s = job()
    r = _preparing(s)
    c, h = Context(s, OVERLAP, NOW), PHASES[P.PREPARING]
    every = ("m0", "m1", "s0")
    match event:
        case E.ADVANCE:  # the last of g+1 formed its group: the barrier, as in plain mode
            r.acked = every
            return h.advance(c, r), _plain_barrier()
        case E.ACK_PREPARE:
            return h.on_ack(c, r, _ack("s0", K.PREPARE)), [RecordPrepared(1, "s0")]
        case E.NACK_PREPARE:  # the default fallback: the plain barrier, recorded
            ack = _ack("s0", K.PREPARE, ok=False, message="no memory")
            why = "member s0 could not prepare: no memory; falling back to the plain barrier"
            return h.on_ack(c, r, ack), [*_withdrawn(*every), *_plain_barrier(why)]
        case E.DEADLINE:
            r.acked = ("m0", "m1")
            why = (
                "prepare deadline (40.0 s) passed; no group from s0; "
                "falling back to the plain barrier"
            )
            return h.on_deadline(c, r), [*_withdrawn(*every), *_plain_barrier(why)]
        case E.MEMBER_LOST:  # a newcomer: g is untouched and keeps training
            msg = "member(s) s0 lost while g+1 prepared: gone"
            return _lose(s, r, "s0"), [*_withdrawn(*every), Abort(1, msg)]
        case E.ABORT_REQUEST:
            msg = "aborted on request: scaler"
            return h.on_abort_request(c, r, "scaler"), [*_withdrawn(*every), Abort(1, msg)]
        case E.JOB_FINISHED:
            _finished(s)
            msg = "the job finished at step 10"
            return h.on_job_finished(c, r), [*_withdrawn(*every), Abort(1, msg)]
        case E.RESTART:
            msg = "the coordinator restarted before the barrier completed"
            return h.on_restart(c, r), [*_withdrawn(*every), Abort(1, msg)]
    # Nothing but PREPARE was sent in this phase.
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
        E.ACK_PREPARE: K.PREPARE,
        E.NACK_PREPARE: K.PREPARE,
    }[event]
    ok = event not in (E.NACK_CHECKPOINT, E.NACK_PREPARE)
    return _ack("m0", kind, ok=ok, directive_step=13)


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
    P.PREPARING: preparing,
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
    # WAITING_FOR_MEMBERS -> PREPARING -> CHECKPOINTING -> RENDEZVOUS -> COMPLETED
    assert longest_chain() == MAX_PHASE_CHANGES == 4


def _prepare(
    mid: str, rank: int, world: int = 3, endpoints: tuple[str, ...] = ENDPOINTS
) -> Prepare:
    # ``prepared`` in a PREPARE: the barrier will commit.
    info = RendezvousInfo(2, world, rank, endpoints[0], endpoints, 0, prepared=True)
    return Prepare(mid, 1, info, "decision 1", 40.0)


def test_overlap_mode_prepares_g_plus_1_while_g_trains() -> None:
    s = job()
    r = resize(s, P.WAITING_FOR_MEMBERS)
    assert PHASES[r.phase].advance(Context(s, OVERLAP, NOW), r) == [
        BeginPrepare(1, ("m0", "m1"), ("s0",), ()),
        _prepare("m0", 0),
        _prepare("m1", 1),
        _prepare("s0", 2),
    ]


def test_an_overlap_shrink_prepares_only_the_stayers() -> None:
    s = job(actives=3, standby=0)
    r = resize(s, P.WAITING_FOR_MEMBERS, target=2)
    assert PHASES[r.phase].advance(Context(s, OVERLAP, NOW), r) == [
        BeginPrepare(1, ("m0", "m1", "m2"), (), ("m2",)),
        _prepare("m0", 0, 2, ENDPOINTS[:2]),
        _prepare("m1", 1, 2, ENDPOINTS[:2]),
    ]


def test_a_prepare_that_misses_its_deadline_aborts_with_g_untouched_when_asked() -> None:
    s = job()
    r = _preparing(s, acked=("m0", "s0"))
    tuning = dataclasses.replace(OVERLAP, prepare_fallback="abort")
    msg = (
        "prepare deadline (40.0 s) passed; no group from m1; "
        "aborted (prepare_fallback abort), generation untouched"
    )
    # No RESUME: g never stopped.
    assert PHASES[r.phase].on_deadline(Context(s, tuning, NOW), r) == [
        *_withdrawn("m0", "m1", "s0"),
        Abort(1, msg),
    ]


def test_preparing_waits_for_every_member_of_g_plus_1_and_ignores_others() -> None:
    s = job(actives=3, standby=0)
    r = _preparing(s, participants=("m0", "m1", "m2"), newcomers=(), leaving=("m2",))
    h, c = PHASES[r.phase], Context(s, OVERLAP, NOW)
    r.acked = ("m0",)
    assert h.advance(c, r) == []
    assert h.on_ack(c, r, _ack("m2", K.PREPARE)) == []  # a leaver is no part of g+1
    assert h.on_ack(c, r, _ack("m0", K.PREPARE)) == []  # acked already


def _acked_prepare(s: JobState, seq: int, mid: str, rank: int, ok: bool = True) -> None:
    info = RendezvousInfo(2, 3, rank, ENDPOINTS[0], ENDPOINTS, 0)
    d = Directive("ns/j", f"d{seq}", mid, K.PREPARE, 1, 1.0, seq=seq, rendezvous=info)
    d.acked, d.ack_ok = True, ok
    s.directives[d.directive_id] = d


def test_the_barrier_after_a_prepare_opens_g_plus_1_as_prepared() -> None:
    s = job()
    for seq, (mid, rank) in enumerate((("m0", 0), ("m1", 1), ("s0", 2)), start=1):
        _acked_prepare(s, seq, mid, rank)
    r = _barrier(s, acked=("m0", "m1"))
    infos = tuple(RendezvousInfo(2, 3, rank, ENDPOINTS[0], ENDPOINTS, 0) for rank in range(3))
    assert PHASES[r.phase].advance(Context(s, OVERLAP, NOW), r) == [
        SaveBarrierCheckpoint(1),
        OpenGeneration(("m0", "m1", "s0"), 13, "decision 1", 40.0, 1, prepared=infos),
        EnterRendezvous(1),
    ]


def test_a_fallback_barrier_opens_g_plus_1_on_the_plain_path() -> None:
    s = job()
    _acked_prepare(s, 1, "m0", 0)
    _acked_prepare(s, 2, "m1", 1)
    _acked_prepare(s, 3, "s0", 2, ok=False)
    r = _barrier(s, acked=("m0", "m1"))
    got = PHASES[r.phase].advance(Context(s, OVERLAP, NOW), r)
    assert got[1] == OpenGeneration(("m0", "m1", "s0"), 13, "decision 1", 40.0, decision_id=1)


@pytest.mark.parametrize(("name", "value"), [("resize_mode", "fast"), ("prepare_fallback", "")])
def test_an_unknown_mode_is_refused_naming_the_value(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"{name}: must be one of .*got '{value}'"):
        Tuning(**{name: value})


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


def _committing(s: JobState, **fields: Any) -> Resize:
    """A barrier whose CHECKPOINTs carried g+1's prepared RENDEZVOUS (overlap mode)."""
    r = _barrier(s, **fields)
    for seq, (mid, rank) in enumerate((("m0", 0), ("m1", 1)), start=10):
        info = RendezvousInfo(2, 3, rank, ENDPOINTS[0], ENDPOINTS, 13, prepared=True)
        d = Directive(
            "ns/j", f"d{seq}", mid, K.CHECKPOINT, 1, NOW, seq=seq, checkpoint_step=13,
            rendezvous=info,
        )  # fmt: skip
        s.directives[d.directive_id] = d
    r.started_at = NOW - 5.0
    return r


def committing(event: ResizeEvent) -> Result:
    """CHECKPOINTING as a commit point: members may have switched at their hold, so what
    would abort a plain barrier to g fails the resize and re-forms the job instead."""
    s = job()
    r = _committing(s)
    c, h = Context(s, OVERLAP, NOW), PHASES[P.CHECKPOINTING]
    assert s.barrier_commits(r)
    match event:
        case E.ADVANCE:  # as in a plain barrier (the RENDEZVOUS confirms the switch)
            r.acked = ("m0", "m1")
            return h.advance(c, r), [
                SaveBarrierCheckpoint(1),
                OpenGeneration(("m0", "m1", "s0"), 13, "decision 1", 40.0, decision_id=1),
                EnterRendezvous(1),
            ]
        case E.ACK_CHECKPOINT:
            ack = _ack("m1", K.CHECKPOINT, directive_step=13, checkpoint_step=13, held_at=99.0)
            return h.on_ack(c, r, ack), [RecordHold(1, "m1", 99.0)]
        case E.NACK_CHECKPOINT:  # its worker is gone: lost, which re-forms g
            ack = _ack("m1", K.CHECKPOINT, ok=False, directive_step=13, message="no worker")
            msg = "member m1 could not checkpoint step 13: no worker"
            return h.on_ack(c, r, ack), [Fail(1, msg), Lose(("m1",), msg)]
        case E.DEADLINE:
            r.acked = ("m0",)
            msg = "barrier deadline (40.0 s) passed; no ack of CHECKPOINT step 13 from m1"
            return h.on_deadline(c, r), [Fail(1, msg), Lose(("m1",), msg)]
        case E.MEMBER_LOST:  # a newcomer: g itself is intact, but its stayers may have switched
            msg = "member(s) s0 lost during the barrier: gone"
            return _lose(s, r, "s0"), [Fail(1, msg), Recover("gone")]
        case E.ABORT_REQUEST:  # too late, as in RENDEZVOUS
            return h.on_abort_request(c, r, "scaler"), []
        case E.JOB_FINISHED:  # nobody held at S: the workers finished before it
            _finished(s)
            msg = "the job finished at step 10"
            want = [Supersede("m0", CKPT), Supersede("m1", CKPT), Abort(1, msg)]
            return h.on_job_finished(c, r), want
        case E.RESTART:  # carried on: unacked CHECKPOINTs are re-sent on reconnect
            return h.on_restart(c, r), [ExtendPhase(1, NOW)]
    return h.on_ack(c, r, _any_ack(event)), []


@pytest.mark.parametrize("event", list(ResizeEvent), ids=[e.name for e in ResizeEvent])
def test_a_committing_barrier(event: ResizeEvent) -> None:
    got, want = committing(event)
    assert got == want


def test_a_committing_barrier_held_at_another_step_still_resumes_g() -> None:
    # The CHECKPOINT came late: every rank held together at 14, so no launcher switched
    # (each switches only at the CHECKPOINT's own step) and g can resume.
    s = job()
    r = _committing(s)
    ack = _ack("m0", K.CHECKPOINT, directive_step=13, checkpoint_step=14, checkpoint_digest="x")
    msg = "rank 0 (m0) acked without the checkpoint of step 13 (got step 14)"
    got = PHASES[r.phase].on_ack(Context(s, OVERLAP, NOW), r, ack)
    assert got == [*_resumes("m0", "m1"), Abort(1, msg)]
    # Held at 13 without the state's digest: they switched, so the job re-forms.
    ack = dataclasses.replace(ack, checkpoint_step=13, checkpoint_digest="")
    msg = "rank 0 (m0) acked without the checkpoint of step 13 (got step 13)"
    got = PHASES[r.phase].on_ack(Context(s, OVERLAP, NOW), r, ack)
    assert got == [Fail(1, msg), Recover(msg)]


def test_a_barrier_after_every_prepare_commits() -> None:
    s = job()
    for seq, (mid, rank) in enumerate((("m0", 0), ("m1", 1), ("s0", 2)), start=1):
        _acked_prepare(s, seq, mid, rank)
    r = _preparing(s, acked=("m0", "m1", "s0"))
    got = PHASES[r.phase].advance(Context(s, OVERLAP, NOW), r)
    sends = [e for e in got if isinstance(e, Send)]
    assert [(e.member_id, e.kind, e.checkpoint_step) for e in sends] == [
        ("m0", K.CHECKPOINT, 13),
        ("m1", K.CHECKPOINT, 13),
    ]
    # Each stayer's CHECKPOINT carries its own g+1 RENDEZVOUS, restore step S.
    assert [e.rendezvous for e in sends] == [
        RendezvousInfo(2, 3, rank, ENDPOINTS[0], ENDPOINTS, 13) for rank in (0, 1)
    ]


@pytest.mark.parametrize("tuning", [TUNING, OVERLAP], ids=["plain", "overlap"])
def test_a_shrink_tells_its_leaver_in_the_checkpoint(tuning: Tuning) -> None:
    # The leaver's pod then writes no handover that no next worker would read.
    s = job(actives=3, standby=0)
    r = _preparing(s, participants=("m0", "m1", "m2"), newcomers=(), leaving=("m2",))
    r.acked = ("m0", "m1")
    if tuning is TUNING:
        r = resize(s, P.WAITING_FOR_MEMBERS, target=2)
    got = PHASES[r.phase].advance(Context(s, tuning, NOW), r)
    sends = {e.member_id: e.leaving for e in got if isinstance(e, Send)}
    assert sends == {"m0": False, "m1": False, "m2": True}
