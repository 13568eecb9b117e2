"""The resize-phase table: one handler per :class:`ResizePhase`, holding that phase's
rules for every event, keyed by phase in :data:`PHASES`.

A handler reads the job's state and returns effects; it never changes anything
(:mod:`services.coordinator.engine.outbox` performs the effects). Events:

- ``advance``: something changed that may let the phase move on (a member
  registered, an ack arrived, a first step was reported); also the phase's entry;
- ``on_ack``: a member acked a directive of this phase;
- ``on_deadline``: the phase's deadline passed;
- ``on_loss``: members were lost (``gen_broken``: one had a rank in the current
  generation, so it must re-form unless the phase does it itself);
- ``on_abort_request``: AbortResize; ``on_job_finished``: the last member
  finished; ``on_restart``: the coordinator was restarted with this resize.

Adding a phase is one handler here plus its row in ``RESIZE_TRANSITIONS``;
tests/coordinator/test_phases.py fails until every event of it has a case.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from services.coordinator.domain import (
    RESIZE_TRANSITIONS,
    DirectiveKind,
    Member,
    MemberState,
    RendezvousInfo,
    Resize,
    ResizePhase,
    choose_checkpoint_step,
    choose_leaving,
    measure_pause,
    rank_order,
    rendezvous_for,
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
from services.coordinator.engine.state import JobState
from services.coordinator.settings import Tuning


class ResizeEvent(Enum):
    """Every event a phase handler answers; the unit tests cover each with each phase."""

    ADVANCE = "advance"
    ACK_CHECKPOINT = "ack CHECKPOINT"
    NACK_CHECKPOINT = "nack CHECKPOINT"
    ACK_RENDEZVOUS = "ack RENDEZVOUS"
    ACK_DRAIN = "ack DRAIN"
    ACK_PREPARE = "ack PREPARE"
    NACK_PREPARE = "nack PREPARE"
    DEADLINE = "deadline"
    MEMBER_LOST = "member lost"
    ABORT_REQUEST = "AbortResize"
    JOB_FINISHED = "job finished"
    RESTART = "restart"


@dataclass(frozen=True)
class Context:
    state: JobState
    tuning: Tuning
    now: float


@dataclass(frozen=True)
class AckEvent:
    member_id: str
    kind: DirectiveKind
    ok: bool
    # The step the acked directive named (CHECKPOINT), to ignore an older barrier's ack.
    directive_step: int = 0
    checkpoint_step: int = 0
    checkpoint_digest: str = ""
    held_at: float | None = None
    checkpoint_write_s: float = 0.0
    message: str = ""


class PhaseHandler:
    """The rules of one phase; the defaults are "nothing happens"."""

    phase: ResizePhase | None = None

    def advance(self, c: Context, r: Resize) -> list[Effect]:
        return []

    def on_ack(self, c: Context, r: Resize, ack: AckEvent) -> list[Effect]:
        return []

    def on_deadline(self, c: Context, r: Resize) -> list[Effect]:
        return []

    def on_loss(
        self, c: Context, r: Resize | None, lost: Sequence[str], gen_broken: bool, reason: str
    ) -> list[Effect]:
        return [Recover(reason)] if gen_broken else []

    def on_abort_request(self, c: Context, r: Resize, reason: str) -> list[Effect]:
        return []

    def on_job_finished(self, c: Context, r: Resize) -> list[Effect]:
        return []

    def on_restart(self, c: Context, r: Resize) -> list[Effect]:
        return []


def _abort(c: Context, r: Resize, message: str, *, resume: bool = True) -> list[Effect]:
    """ABORTED; in a barrier the CHECKPOINTs are withdrawn and the holders RESUME."""
    out: list[Effect] = []
    if r.phase == ResizePhase.PREPARING:
        # g never stopped: nothing to resume. The standbys' groups are simply not used.
        for mid in (*r.participants, *r.newcomers):
            if mid not in r.leaving:
                out.append(Supersede(mid, frozenset({DirectiveKind.PREPARE})))
    if r.phase == ResizePhase.CHECKPOINTING:
        for mid in r.participants:
            out.append(Supersede(mid, frozenset({DirectiveKind.CHECKPOINT})))
            if resume and c.state.members[mid].state == MemberState.ACTIVE:
                out.append(
                    Send(
                        mid,
                        DirectiveKind.RESUME,
                        c.state.job.generation,
                        reason=f"decision {r.decision_id} aborted",
                        deadline_s=c.tuning.heartbeat_timeout_s,
                    )
                )
    out.append(Abort(r.decision_id, message))
    return out


def _open(
    c: Context, r: Resize, ordered: Sequence[Member], restore: int, *, first: bool
) -> list[Effect]:
    if not ordered:
        return [Fail(r.decision_id, "no member left to form a generation")]
    ids = tuple(m.member_id for m in ordered)
    return [
        OpenGeneration(
            ids,
            restore,
            reason=f"decision {r.decision_id}",
            deadline_s=r.deadline_s,
            decision_id=r.decision_id,
            prepared=() if first else c.state.prepared_rendezvous(r, ids),
        ),
        EnterRendezvous(r.decision_id, newcomers=ids if first else None),
    ]


class WaitingForMembers(PhaseHandler):
    """Until enough members run (and report steps) for a barrier, or enough registered
    for a first generation."""

    phase = ResizePhase.WAITING_FOR_MEMBERS

    def advance(self, c: Context, r: Resize) -> list[Effect]:
        return self._decide(c, r, deadline_passed=False)

    def on_deadline(self, c: Context, r: Resize) -> list[Effect]:
        return self._decide(c, r, deadline_passed=True)

    def _decide(self, c: Context, r: Resize, *, deadline_passed: bool) -> list[Effect]:
        s = c.state
        actives, standby = s.actives(), s.standby()
        if not actives:
            # No generation runs: the first one (or a restart after every member was lost).
            if len(standby) >= r.target_world_size or (
                deadline_passed and len(standby) >= r.min_world_size
            ):
                # 0: the newest good checkpoint on disk, periodic ones included.
                return _open(c, r, standby[: r.target_world_size], 0, first=True)
            if deadline_passed:
                return _abort(
                    c,
                    r,
                    f"only {len(standby)} member(s) registered within {r.deadline_s:.1f} s; "
                    f"need at least {r.min_world_size}",
                )
            return []
        n = len(actives)
        if r.target_world_size != n and not all(s.running(m) for m in actives):
            # The checkpoint step is chosen from reported steps: wait until every member
            # runs and has reported (after a restart or a recovery).
            if deadline_passed:
                return _abort(
                    c,
                    r,
                    f"generation {s.job.generation} was not running within "
                    f"{r.deadline_s:.1f} s; no barrier possible",
                )
            return []
        if r.target_world_size > n:
            want = r.target_world_size - n
            if len(standby) >= want:
                return _begin(c, r, actives, standby[:want], ())
            if not deadline_passed:
                return []
            if standby and n + len(standby) >= r.min_world_size:
                return _begin(c, r, actives, standby, ())
            return _abort(
                c,
                r,
                f"{len(standby)} of {want} newcomer(s) registered within "
                f"{r.deadline_s:.1f} s; min world size {r.min_world_size}",
            )
        if r.target_world_size < n:
            leaving = choose_leaving(actives, n - r.target_world_size, r.leaving_pods)
            return _begin(c, r, actives, [], leaving)
        return [
            Complete(r.decision_id, f"already at world size {n}", to_generation=s.job.generation)
        ]

    def on_loss(
        self, c: Context, r: Resize | None, lost: Sequence[str], gen_broken: bool, reason: str
    ) -> list[Effect]:
        if r is None or not gen_broken:
            return []
        return [*_abort(c, r, f"member(s) {', '.join(lost)} lost: {reason}"), Recover(reason)]

    def on_abort_request(self, c: Context, r: Resize, reason: str) -> list[Effect]:
        return _abort(c, r, f"aborted on request: {reason or 'no reason given'}")

    def on_job_finished(self, c: Context, r: Resize) -> list[Effect]:
        return _abort(c, r, _finished_message(c), resume=False)

    def on_restart(self, c: Context, r: Resize) -> list[Effect]:
        return _abort(c, r, "the coordinator restarted before the barrier completed")


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


def _fail_commit(c: Context, r: Resize, message: str, lose: Sequence[str] = ()) -> list[Effect]:
    """A committing barrier that cannot complete: members that held at S may have switched
    to g+1's prepared workers, so g cannot resume. The resize FAILS and the job re-forms
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
    its own hold, so past it the resize completes or fails, as from RENDEZVOUS on; only a
    barrier whose ranks held at another step (nobody switched) is still aborted to g."""

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
        if (
            ack.kind != DirectiveKind.CHECKPOINT
            or ack.member_id not in r.participants
            or ack.directive_step != r.checkpoint_step
        ):
            return []
        if not ack.ok:
            why = (
                f"member {ack.member_id} could not checkpoint step {r.checkpoint_step}: "
                f"{ack.message or 'no reason given'}"
            )
            if c.state.barrier_commits(r):
                return _fail_commit(c, r, why, lose=(ack.member_id,))
            return _abort(c, r, why)
        held = ack.held_at if ack.held_at else c.now
        if c.state.members[ack.member_id].rank != 0:
            return [RecordHold(r.decision_id, ack.member_id, held)]
        if ack.checkpoint_step != r.checkpoint_step or not ack.checkpoint_digest:
            why = (
                f"rank 0 ({ack.member_id}) acked without the checkpoint of step "
                f"{r.checkpoint_step} (got step {ack.checkpoint_step})"
            )
            if ack.checkpoint_step == r.checkpoint_step and c.state.barrier_commits(r):
                # Held at S: the launchers switched; only a re-formed generation is safe.
                return _fail_commit(c, r, why)
            # Held at another step (the CHECKPOINT came late): every rank of g held there
            # together and no launcher switched (each does so only at S), so g resumes.
            return _abort(c, r, why)
        return [
            RecordHold(
                r.decision_id, ack.member_id, held, ack.checkpoint_digest, ack.checkpoint_write_s
            )
        ]

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


class Rendezvous(PhaseHandler):
    """g+1 forms while the leavers of a shrink drain; neither side can go back."""

    phase = ResizePhase.RENDEZVOUS

    def advance(self, c: Context, r: Resize) -> list[Effect]:
        return self._complete(c, r, gone=())

    def _complete(self, c: Context, r: Resize, gone: Sequence[str]) -> list[Effect]:
        """COMPLETED once every member of g+1 stepped and every leaver (but ``gone``) left."""
        s = c.state
        gen = s.generations.get(r.to_generation)
        if gen is None or s.job.generation != r.to_generation:
            return []
        ms = [s.members[i] for i in gen.member_ids]
        if any(m.first_step_at is None or m.reported_generation != gen.generation for m in ms):
            return []
        # The scaler lowers the replicas right after COMPLETED: a leaver still draining
        # would be killed before it acked.
        if not s.leavers_gone(r, besides=gone):
            return []
        pause, breakdown = measure_pause(
            held_at_latest=r.held_at_latest,
            checkpoint_write_s=r.checkpoint_write_s,
            rendezvous_sent_at=r.rendezvous_sent_at,
            first_steps_at=[m.first_step_at or 0.0 for m in ms],
            startups=[m.startup for m in ms],
        )
        message = f"generation {gen.generation} runs with {gen.world_size} member(s)"
        return [Complete(r.decision_id, message, pause_s=pause, breakdown=breakdown)]

    def on_ack(self, c: Context, r: Resize, ack: AckEvent) -> list[Effect]:
        if ack.kind in (DirectiveKind.DRAIN, DirectiveKind.STOP) and (
            ack.member_id in r.leaving and ack.member_id not in r.acked
        ):
            return [AckedLeaver(r.decision_id, ack.member_id)]
        return []

    def on_deadline(self, c: Context, r: Resize) -> list[Effect]:
        s = c.state
        # The leavers' DRAIN went out with the RENDEZVOUS, so their deadline is this one:
        # a leaver that never acked must not fail a g+1 that runs.
        drained = [i for i in r.leaving if s.members[i].state == MemberState.DRAINING]
        out: list[Effect] = [DrainOut(i) for i in drained]
        done = self._complete(c, r, gone=drained)
        if done:
            return [*out, *done]
        gen = s.generations[r.to_generation]
        late = [i for i in gen.member_ids if s.members[i].first_step_at is None]
        unacked = tuple(
            i
            for i in late
            if any(
                d.kind == DirectiveKind.RENDEZVOUS and d.generation == gen.generation
                for d in s.pending_directives(i)
            )
        )
        out.append(
            Fail(
                r.decision_id,
                f"generation {gen.generation} not running after {r.deadline_s:.1f} s: "
                f"no first step from {', '.join(late)}",
            )
        )
        if unacked:
            out.append(Lose(unacked, "RENDEZVOUS not acknowledged"))
        return out

    def on_loss(
        self, c: Context, r: Resize | None, lost: Sequence[str], gen_broken: bool, reason: str
    ) -> list[Effect]:
        gen = c.state.generations.get(r.to_generation) if r is not None else None
        if r is None or gen is None or not any(i in gen.member_ids for i in lost):
            return [Recover(reason)] if gen_broken else []
        failed = Fail(
            r.decision_id,
            f"member(s) {', '.join(lost)} lost while generation {r.to_generation} formed: {reason}",
        )
        return [failed, Recover(reason)]

    def on_job_finished(self, c: Context, r: Resize) -> list[Effect]:
        return self.advance(c, r) or [Fail(r.decision_id, _finished_message(c))]

    def on_restart(self, c: Context, r: Resize) -> list[Effect]:
        # Past the barrier the old generation cannot resume: carry it on, with a fresh deadline.
        return [ExtendPhase(r.decision_id, c.now)]


class Final(PhaseHandler):
    """COMPLETED, ABORTED, FAILED, and a job without a resize: no resize rule applies."""


def _finished_message(c: Context) -> str:
    if c.state.job.failure:
        return f"the job failed: {c.state.job.failure}"
    return f"the job finished at step {c.state.finished_step()}"


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
