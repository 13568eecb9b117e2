"""WAITING_FOR_MEMBERS: the entry of every resize, until enough members run (and report
steps) for a barrier, or enough registered for a first generation.

Its own room because its rules (who grows, who leaves, when to give up waiting) change
with the membership policy, not with the barrier or the rendezvous that follow it.
"""

from __future__ import annotations

from collections.abc import Sequence

from tide.services.coordinator.domain import Resize, ResizePhase, choose_leaving
from tide.services.coordinator.engine.effects import Complete, Effect, Recover
from tide.services.coordinator.engine.phases.barrier import _begin
from tide.services.coordinator.engine.phases.base import (
    Context,
    PhaseHandler,
    _abort,
    _finished_message,
    _open,
)


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
