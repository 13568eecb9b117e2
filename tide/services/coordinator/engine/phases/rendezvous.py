"""RENDEZVOUS: g+1 forms while the leavers of a shrink drain, until it completes or fails.

Its own room because past the barrier nothing goes back: its rules (when g+1 counts as
running, what a late member or a lost one means, the pause measured) change with the
rendezvous, not with how the barrier got there.
"""

from __future__ import annotations

from collections.abc import Sequence

from tide.services.coordinator.domain import (
    DirectiveKind,
    MemberState,
    Resize,
    ResizePhase,
    measure_pause,
)
from tide.services.coordinator.engine.effects import (
    AckedLeaver,
    Complete,
    DrainOut,
    Effect,
    ExtendPhase,
    Fail,
    Lose,
    Recover,
)
from tide.services.coordinator.engine.phases.base import (
    AckEvent,
    Context,
    PhaseHandler,
    _finished_message,
)


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
