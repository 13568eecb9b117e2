"""The barrier: how it starts (:func:`_begin`, :func:`_barrier`), PREPARING (overlap
mode's g+1 formed in standby workers while g trains) and CHECKPOINTING (every
participant holds at step S and rank 0 writes S).

One room because the two phases change together: a PREPARE's groups become the
CHECKPOINTs' commit (``JobState.barrier_commits``), and a failed prepare falls back to the
plain barrier built here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from tide.services.coordinator.domain import (
    DirectiveKind,
    Member,
    MemberState,
    RendezvousInfo,
    Resize,
    ResizePhase,
    choose_checkpoint_step,
    rank_order,
    rendezvous_for,
)
from tide.services.coordinator.engine.effects import (
    BeginBarrier,
    BeginPrepare,
    Drain,
    Effect,
    ExtendPhase,
    Fail,
    Lose,
    Prepare,
    RecordHold,
    RecordPrepared,
    Recover,
    SaveBarrierCheckpoint,
    Send,
    Supersede,
)
from tide.services.coordinator.engine.phases.base import (
    AckEvent,
    Context,
    PhaseHandler,
    _abort,
    _finished_message,
    _open,
)


def _begin(
    c: Context,
    r: Resize,
    participants: Sequence[Member],
    newcomers: Sequence[Member],
    leaving: Sequence[Member],
) -> list[Effect]:
    """The barrier, or in overlap mode first the PREPARE of g+1 to its members."""
    if c.tuning.resize_mode != "overlap":
        return _barrier(c, r, participants, newcomers, leaving)
    ids = {m.member_id for m in leaving}
    ordered = rank_order([m for m in participants if m.member_id not in ids], newcomers)
    # The restore step is the barrier's, not chosen yet: the CHECKPOINT brings it.
    # ``prepared`` in a PREPARE says the barrier will commit: a newcomer's prepared worker
    # may train as soon as it has restored (from peers that only restore once committed).
    infos = tuple(
        dataclasses.replace(i, prepared=True)
        for i in rendezvous_for(ordered, c.state.job.generation + 1, 0)
    )
    out: list[Effect] = [
        BeginPrepare(
            r.decision_id,
            participants=tuple(m.member_id for m in participants),
            newcomers=tuple(m.member_id for m in newcomers),
            leaving=tuple(m.member_id for m in leaving),
        )
    ]
    for m, info in zip(ordered, infos, strict=True):
        out.append(
            Prepare(
                m.member_id,
                c.state.job.generation,
                info,
                reason=f"decision {r.decision_id}",
                deadline_s=r.deadline_s,
            )
        )
    return out


def _barrier(
    c: Context,
    r: Resize,
    participants: Sequence[Member],
    newcomers: Sequence[Member],
    leaving: Sequence[Member],
    note: str = "",
    commit: Mapping[str, RendezvousInfo] | None = None,
) -> list[Effect]:
    """CHECKPOINT(S) to g. ``commit``: g+1's prepared RENDEZVOUS by member (overlap mode);
    each stayer's CHECKPOINT carries its own with restore step S, so the barrier commits."""
    step = choose_checkpoint_step(
        (m.step for m in participants),
        (m.steps_per_s for m in participants),
        min_lead_steps=c.tuning.checkpoint_min_lead_steps,
        lead_s=c.tuning.checkpoint_lead_s,
    )
    out: list[Effect] = [
        BeginBarrier(
            r.decision_id,
            step,
            participants=tuple(m.member_id for m in participants),
            newcomers=tuple(m.member_id for m in newcomers),
            leaving=tuple(m.member_id for m in leaving),
            note=note,
        )
    ]
    leavers = {m.member_id for m in leaving}
    for m in participants:
        info = (commit or {}).get(m.member_id)
        out.append(
            Send(
                m.member_id,
                DirectiveKind.CHECKPOINT,
                c.state.job.generation,
                reason=f"decision {r.decision_id}",
                deadline_s=r.deadline_s,
                checkpoint_step=step,
                rendezvous=dataclasses.replace(info, restore_step=step) if info else None,
                leaving=m.member_id in leavers,
            )
        )
    return out


class Preparing(PhaseHandler):
    """Overlap mode: g+1's members form its group in standby workers while g trains; the
    barrier starts once every one of them has. g is untouched until then, so a failure
    here either falls back to the plain barrier or aborts with nothing to resume."""

    phase = ResizePhase.PREPARING

    def advance(self, c: Context, r: Resize) -> list[Effect]:
        ids = [m.member_id for m in c.state.next_members(r)]
        if not ids or not set(ids) <= set(r.acked):
            return []
        infos = c.state.prepared_rendezvous(r, ids)
        # Every group formed: the barrier commits (a fallback's barrier is the plain one).
        return self._barrier(c, r, commit=dict(zip(ids, infos, strict=True)) if infos else None)

    @staticmethod
    def _barrier(
        c: Context, r: Resize, note: str = "", commit: Mapping[str, RendezvousInfo] | None = None
    ) -> list[Effect]:
        s = c.state
        return _barrier(
            c,
            r,
            [s.members[i] for i in r.participants],
            [s.members[i] for i in r.newcomers],
            [s.members[i] for i in r.leaving],
            note,
            commit,
        )

    def _fallback(self, c: Context, r: Resize, why: str) -> list[Effect]:
        if c.tuning.prepare_fallback == "abort":
            return _abort(c, r, f"{why}; aborted (prepare_fallback abort), generation untouched")
        withdrawn: list[Effect] = [
            Supersede(m.member_id, frozenset({DirectiveKind.PREPARE}))
            for m in c.state.next_members(r)
        ]
        return [*withdrawn, *self._barrier(c, r, f"{why}; falling back to the plain barrier")]

    def on_ack(self, c: Context, r: Resize, ack: AckEvent) -> list[Effect]:
        if ack.kind != DirectiveKind.PREPARE or ack.member_id in r.acked:
            return []
        if ack.member_id not in {m.member_id for m in c.state.next_members(r)}:
            return []
        if not ack.ok:
            why = f"member {ack.member_id} could not prepare: {ack.message or 'no reason given'}"
            return self._fallback(c, r, why)
        return [RecordPrepared(r.decision_id, ack.member_id)]

    def on_deadline(self, c: Context, r: Resize) -> list[Effect]:
        missing = [m.member_id for m in c.state.next_members(r) if m.member_id not in r.acked]
        why = f"prepare deadline ({r.deadline_s:.1f} s) passed; no group from {', '.join(missing)}"
        return self._fallback(c, r, why)

    def on_loss(
        self, c: Context, r: Resize | None, lost: Sequence[str], gen_broken: bool, reason: str
    ) -> list[Effect]:
        out: list[Effect] = []
        if r is not None and any(i in r.participants or i in r.newcomers for i in lost):
            out = _abort(c, r, f"member(s) {', '.join(lost)} lost while g+1 prepared: {reason}")
        return [*out, Recover(reason)] if gen_broken else out

    def on_abort_request(self, c: Context, r: Resize, reason: str) -> list[Effect]:
        return _abort(c, r, f"aborted on request: {reason or 'no reason given'}")

    def on_job_finished(self, c: Context, r: Resize) -> list[Effect]:
        return _abort(c, r, _finished_message(c))

    def on_restart(self, c: Context, r: Resize) -> list[Effect]:
        return _abort(c, r, "the coordinator restarted before the barrier completed")


def _held_apart(c: Context, r: Resize, ack: AckEvent) -> str:
    """Why the participants of ``r`` did not all hold at one step, counting ``ack``; "" when
    they did (as far as their acks said: a launcher that names no step is not counted)."""
    steps = {m: st for m, st in r.held_steps.items() if m != ack.member_id and m in r.acked}
    if ack.checkpoint_step:
        steps[ack.member_id] = ack.checkpoint_step
    if len(set(steps.values())) <= 1:
        return ""
    at = ", ".join(f"{m} at {st}" for m, st in sorted(steps.items()))
    return f"the ranks of generation {c.state.job.generation} held at different steps ({at})"


def _fail_commit(c: Context, r: Resize, message: str, lose: Sequence[str] = ()) -> list[Effect]:
    """A committing barrier that cannot complete: members that held at S (or past it) may
    have switched to g+1's prepared workers, so g cannot resume. The resize FAILS and the job re-forms
    from its newest good checkpoint, as after a failed RENDEZVOUS."""
    out: list[Effect] = [Fail(r.decision_id, message)]
    if lose:
        out.append(Lose(tuple(lose), message))
    else:
        out.append(Recover(message))
    return out


class Checkpointing(PhaseHandler):
    """The barrier: every participant holds at step S and rank 0 writes S.

    In overlap mode the CHECKPOINTs carry g+1's prepared RENDEZVOUS and the barrier is a
    commit point (``JobState.barrier_commits``): a member switches to its prepared worker at
    its own hold (at S, or later when the CHECKPOINT came after g passed S), so past it the
    resize completes or fails, as from RENDEZVOUS on; only a barrier whose ranks held before
    S (nobody switched) is still aborted to g. In both modes a barrier moves to the later
    step where every rank of g held, and ranks that held at different steps end it."""

    phase = ResizePhase.CHECKPOINTING

    def advance(self, c: Context, r: Resize) -> list[Effect]:
        if not set(r.participants) <= set(r.acked):
            return []
        s = c.state
        out: list[Effect] = [SaveBarrierCheckpoint(r.decision_id)]
        # A shrink sends DRAIN to the leavers and RENDEZVOUS to the stayers in one unit:
        # g+1 has its own master port and store, so a leaver still holding in g cannot
        # disturb it, and waiting for the leavers' acks only lengthened the pause. The
        # resize completes once every leaver is GONE too (see Rendezvous).
        for mid in r.leaving:
            if s.members[mid].state == MemberState.ACTIVE:
                out.append(
                    Drain(
                        mid,
                        s.job.generation,
                        reason=f"decision {r.decision_id}: leaving",
                        deadline_s=r.deadline_s,
                    )
                )
        return [*out, *_open(c, r, s.next_members(r), r.checkpoint_step, first=False)]

    def on_ack(self, c: Context, r: Resize, ack: AckEvent) -> list[Effect]:
        if ack.kind != DirectiveKind.CHECKPOINT or ack.member_id not in r.participants:
            return []
        # This barrier's CHECKPOINT (it still names the step it was sent with when the
        # barrier moved, below); an older barrier's ack is not.
        if ack.directive_step != c.state.barrier_step(r):
            return []
        commits = c.state.barrier_commits(r)
        if not ack.ok:
            why = (
                f"member {ack.member_id} could not checkpoint step {r.checkpoint_step}: "
                f"{ack.message or 'no reason given'}"
            )
            if commits:
                return _fail_commit(c, r, why, lose=(ack.member_id,))
            return _abort(c, r, why)
        split = _held_apart(c, r, ack)
        if split:
            # The ranks agree on their stop step at every step, so this cannot happen while
            # that agreement holds; if it does, no restore step is right for all of them.
            if commits:
                return _fail_commit(c, r, split)
            return _abort(c, r, split)
        held = ack.held_at if ack.held_at else c.now
        step = ack.checkpoint_step
        if c.state.members[ack.member_id].rank != 0:
            return [RecordHold(r.decision_id, ack.member_id, held, held_step=step)]
        if step >= r.checkpoint_step and ack.checkpoint_digest:
            # Past S: the CHECKPOINT reached g after it had passed S (a generation's first
            # seconds, before its step rate is known). Every rank held together at the same
            # later step (they agree on the stop step at each step) and rank 0 wrote it, so
            # the barrier moves there rather than abort a good checkpoint. In overlap mode
            # each launcher switched at that hold too (at S or later:
            # tide/trainer/launcher/core.py), its prepared worker restoring the pod's state of
            # that step, and a newcomer's takes the newest state the stayers hold: g+1
            # restores that step, which its RENDEZVOUS (sent once every rank acked) names.
            return [
                RecordHold(
                    r.decision_id,
                    ack.member_id,
                    held,
                    ack.checkpoint_digest,
                    ack.checkpoint_write_s,
                    moved_to_step=step if step > r.checkpoint_step else 0,
                    held_step=step,
                )
            ]
        why = (
            f"rank 0 ({ack.member_id}) acked without the checkpoint of step "
            f"{r.checkpoint_step} (got step {step})"
        )
        if commits and step >= r.checkpoint_step:
            # Held at S or later: the launchers switched; only a re-formed generation is safe.
            return _fail_commit(c, r, why)
        # Held before S (a stop asked for another reason: no launcher switches before S), or,
        # in a plain barrier (none switches), at a later step without its checkpoint: every
        # rank of g held there together, so g resumes.
        return _abort(c, r, why)

    def on_deadline(self, c: Context, r: Resize) -> list[Effect]:
        missing = [i for i in r.participants if i not in r.acked]
        why = (
            f"barrier deadline ({r.deadline_s:.1f} s) passed; no ack of CHECKPOINT "
            f"step {r.checkpoint_step} from {', '.join(missing)}"
        )
        if c.state.barrier_commits(r):
            return _fail_commit(c, r, why, lose=missing)
        return _abort(c, r, why)

    def on_loss(
        self, c: Context, r: Resize | None, lost: Sequence[str], gen_broken: bool, reason: str
    ) -> list[Effect]:
        out: list[Effect] = []
        if r is not None and any(i in r.participants or i in r.newcomers for i in lost):
            why = f"member(s) {', '.join(lost)} lost during the barrier: {reason}"
            if c.state.barrier_commits(r):
                # A lost newcomer leaves g intact, but its stayers may have switched.
                return [Fail(r.decision_id, why), Recover(reason)]
            out = _abort(c, r, why, resume=not gen_broken)
        return [*out, Recover(reason)] if gen_broken else out

    def on_abort_request(self, c: Context, r: Resize, reason: str) -> list[Effect]:
        if c.state.barrier_commits(r):
            # Too late, as in RENDEZVOUS: the resize is carried to completion.
            return []
        return _abort(c, r, f"aborted on request: {reason or 'no reason given'}")

    def on_job_finished(self, c: Context, r: Resize) -> list[Effect]:
        return _abort(c, r, _finished_message(c), resume=False)

    def on_restart(self, c: Context, r: Resize) -> list[Effect]:
        if c.state.barrier_commits(r):
            # Members may have switched at their hold: carry the barrier on (unacked
            # CHECKPOINTs are re-sent on reconnect), with a fresh deadline.
            return [ExtendPhase(r.decision_id, c.now)]
        return _abort(c, r, "the coordinator restarted before the barrier completed")
