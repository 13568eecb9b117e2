"""The barrier (engine/phases/barrier.py): PREPARING's and CHECKPOINTING's cases for
every event, the barrier as a commit point in overlap mode, and how a barrier starts."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tests.coordinator.builders import job, resize
from tests.coordinator.phase_support import (
    CKPT,
    ENDPOINTS,
    NOW,
    OVERLAP,
    PREP,
    TUNING,
    E,
    K,
    P,
    Result,
    _ack,
    _any_ack,
    _barrier,
    _ctx,
    _finished,
    _lose,
    _resumes,
)
from tide.services.coordinator.domain import Directive, RendezvousInfo, Resize
from tide.services.coordinator.engine.effects import (
    Abort,
    BeginBarrier,
    BeginPrepare,
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
from tide.services.coordinator.engine.phases import PHASES, Context, ResizeEvent
from tide.services.coordinator.engine.state import JobState
from tide.services.coordinator.settings import Tuning

pytestmark = pytest.mark.unit


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
            return h.on_ack(c, r, ack), [RecordHold(1, "m0", 99.0, "abc", 0.25, held_step=13)]
        case E.ACK_CHECKPOINT_PAST:  # g passed 13 before the CHECKPOINT came: moved to 18
            moved = RecordHold(1, "m0", NOW, "x", moved_to_step=18, held_step=18)
            return h.on_ack(c, r, _any_ack(event)), [moved]
        case E.ACK_CHECKPOINT_APART:  # nobody switched in a plain barrier: g resumes
            _held(r, m0=13)
            msg = "the ranks of generation 1 held at different steps (m0 at 13, m1 at 14)"
            return h.on_ack(c, r, _any_ack(event)), [*_resumes("m0", "m1"), Abort(1, msg)]
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


def _held(r: Resize, **steps: int) -> None:
    """Participants that acked, at these steps, as the outbox records their holds."""
    r.acked = (*r.acked, *steps)
    r.held_steps.update(steps)


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


def _sent(s: JobState, r: Resize, *, commit: bool) -> None:
    """The barrier's CHECKPOINTs of step 13 to m0 and m1; ``commit``: each carrying its g+1
    RENDEZVOUS (overlap mode)."""
    for seq, (mid, rank) in enumerate((("m0", 0), ("m1", 1)), start=10):
        info = RendezvousInfo(2, 3, rank, ENDPOINTS[0], ENDPOINTS, 13, prepared=True)
        d = Directive(
            "ns/j", f"d{seq}", mid, K.CHECKPOINT, 1, NOW, seq=seq, checkpoint_step=13,
            rendezvous=info if commit else None,
        )  # fmt: skip
        s.directives[d.directive_id] = d
    r.started_at = NOW - 5.0


def _moved(r: Resize, step: int) -> None:
    """What the outbox does with rank 0's RecordHold(moved_to_step=step)."""
    r.checkpoint_step = step
    _held(r, m0=step)


@pytest.mark.parametrize("commit", [False, True], ids=["plain", "overlap"])
def test_a_barrier_g_passed_moves_to_where_rank_0_held_with_its_checkpoint(commit: bool) -> None:
    s = job()
    r = _barrier(s)
    _sent(s, r, commit=commit)
    c = Context(s, OVERLAP if commit else TUNING, NOW)
    late = _ack("m0", K.CHECKPOINT, directive_step=13, checkpoint_step=18, held_at=99.0)
    late = dataclasses.replace(late, checkpoint_digest="abc", checkpoint_write_s=0.25)
    got = PHASES[r.phase].on_ack(c, r, late)
    assert got == [RecordHold(1, "m0", 99.0, "abc", 0.25, moved_to_step=18, held_step=18)]
    # Moved: a rank that held at 18 acks the CHECKPOINT of 13; an older barrier's does not.
    _moved(r, 18)
    assert s.barrier_step(r) == 13 and s.barrier_commits(r) is commit
    m1 = _ack("m1", K.CHECKPOINT, directive_step=13, checkpoint_step=18, held_at=99.0)
    assert PHASES[r.phase].on_ack(c, r, m1) == [RecordHold(1, "m1", 99.0, held_step=18)]
    old = dataclasses.replace(m1, directive_step=7, checkpoint_step=7)
    assert PHASES[r.phase].on_ack(c, r, old) == []
    # g+1 restores where g held, newcomers included (they take the stayers' newest state).
    r.acked = ("m0", "m1")
    opened = next(e for e in PHASES[r.phase].advance(c, r) if isinstance(e, OpenGeneration))
    assert (opened.member_ids, opened.restore_step) == (("m0", "m1", "s0"), 18)


@pytest.mark.parametrize("commit", [False, True], ids=["plain", "overlap"])
def test_a_rank_that_held_apart_from_a_moved_barrier_ends_it(commit: bool) -> None:
    """The barrier moved to 18, where rank 0 held; m1 says 17 (the ranks' agreement on the
    stop step broke): no restore step is right for both."""
    s = job()
    r = _barrier(s)
    _sent(s, r, commit=commit)
    _moved(r, 18)
    m1 = _ack("m1", K.CHECKPOINT, directive_step=13, checkpoint_step=17, held_at=99.0)
    msg = "the ranks of generation 1 held at different steps (m0 at 18, m1 at 17)"
    got = PHASES[r.phase].on_ack(Context(s, OVERLAP if commit else TUNING, NOW), r, m1)
    # Overlap mode: each launcher may have switched at its own hold, so g cannot resume.
    assert got == (
        [Fail(1, msg), Recover(msg)] if commit else [*_resumes("m0", "m1"), Abort(1, msg)]
    )


def test_rank_0_past_s_after_a_rank_that_held_at_s_ends_the_barrier() -> None:
    s = job()
    r = _committing(s)
    _held(r, m1=13)
    late = _ack("m0", K.CHECKPOINT, directive_step=13, checkpoint_step=15, checkpoint_digest="x")
    msg = "the ranks of generation 1 held at different steps (m0 at 15, m1 at 13)"
    assert PHASES[r.phase].on_ack(Context(s, OVERLAP, NOW), r, late) == [
        Fail(1, msg),
        Recover(msg),
    ]


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


def _committing(s: JobState, **fields: Any) -> Resize:
    """A barrier whose CHECKPOINTs carried g+1's prepared RENDEZVOUS (overlap mode)."""
    r = _barrier(s, **fields)
    _sent(s, r, commit=True)
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
            return h.on_ack(c, r, ack), [RecordHold(1, "m1", 99.0, held_step=13)]
        case E.ACK_CHECKPOINT_PAST:  # every launcher switched at 18: the barrier moves there
            moved = RecordHold(1, "m0", NOW, "x", moved_to_step=18, held_step=18)
            return h.on_ack(c, r, _any_ack(event)), [moved]
        case E.ACK_CHECKPOINT_APART:  # each may have switched at its own hold: re-formed
            _held(r, m0=13)
            msg = "the ranks of generation 1 held at different steps (m0 at 13, m1 at 14)"
            return h.on_ack(c, r, _any_ack(event)), [Fail(1, msg), Recover(msg)]
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


@pytest.mark.parametrize("step", [13, 14])
def test_a_committing_barrier_whose_rank_0_held_at_or_past_s_without_its_state_fails(
    step: int,
) -> None:
    # The launchers switched at their hold (at S or past it): the job re-forms.
    s = job()
    r = _committing(s)
    ack = _ack("m0", K.CHECKPOINT, directive_step=13, checkpoint_step=step)
    msg = f"rank 0 (m0) acked without the checkpoint of step 13 (got step {step})"
    assert PHASES[r.phase].on_ack(Context(s, OVERLAP, NOW), r, ack) == [Fail(1, msg), Recover(msg)]


def test_a_committing_barrier_held_before_s_still_resumes_g() -> None:
    # A hold before S (asked for another reason): no launcher switched (each does so only
    # from S on), so g can resume.
    s = job()
    r = _committing(s)
    ack = _ack("m0", K.CHECKPOINT, directive_step=13, checkpoint_step=12, checkpoint_digest="x")
    msg = "rank 0 (m0) acked without the checkpoint of step 13 (got step 12)"
    got = PHASES[r.phase].on_ack(Context(s, OVERLAP, NOW), r, ack)
    assert got == [*_resumes("m0", "m1"), Abort(1, msg)]


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
