"""The outbox's half that performs how generations and jobs end: losses, the recovery
they start, the lost steps counted from what the survivors restored, checkpoints
reported good, members that finished and a job that failed for good.

A mixin of :class:`tide.services.coordinator.engine.outbox.Outbox`, which owns the unit of
work and the queue these methods record into; split off so that each module stays
readable. Nothing else calls these methods.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Iterable

from tide.services.common.clock import Clock
from tide.services.coordinator.domain import (
    Checkpoint,
    Directive,
    DirectiveKind,
    Generation,
    JobRecord,
    Member,
    MemberState,
    Resize,
    transition_member,
)
from tide.services.coordinator.engine import effects as fx
from tide.services.coordinator.engine.phases import Context, rules
from tide.services.coordinator.engine.recovery import plan_recovery
from tide.services.coordinator.engine.state import JobState
from tide.services.coordinator.metrics import CoordinatorMetrics
from tide.services.coordinator.settings import Tuning


class Endings:
    """Losses, recoveries, lost steps, finished members and failed jobs."""

    state: JobState
    _clock: Clock
    _tuning: Tuning
    _metrics: CoordinatorMetrics
    _log: logging.LoggerAdapter[logging.Logger]

    @abstractmethod
    def context(self) -> Context: ...

    @abstractmethod
    def apply(self, effects: Iterable[fx.Effect]) -> None: ...

    @abstractmethod
    def _changed(
        self, *objs: JobRecord | Member | Generation | Checkpoint | Resize | Directive
    ) -> None: ...

    @abstractmethod
    def _supersede(self, member_id: str, kinds: frozenset[DirectiveKind] = frozenset()) -> None: ...

    @abstractmethod
    def _send(
        self, m: Member, kind: DirectiveKind, generation: int, reason: str, deadline_s: float
    ) -> None: ...

    def _lose(self, e: fx.Lose) -> None:
        """Members (or only their workers) are lost; their phase's rules say what follows
        (an abort, a failed g+1, a re-formed generation)."""
        gen_broken = False
        lost: list[str] = []
        for mid in e.member_ids:
            m = self.state.members[mid]
            if m.state == MemberState.GONE:
                continue
            if m.state == MemberState.ACTIVE and m.rank is not None:
                gen_broken = True
            if not (e.worker_failed and m.state == MemberState.ACTIVE):
                transition_member(m, MemberState.GONE)
                m.rank = None
                self._supersede(m.member_id)
            self._changed(m)
            lost.append(m.member_id)
            self._metrics.members_lost.labels(self.state.job_id).inc()
            self._log.warning(
                "member %s lost: %s", m.member_id, e.reason, extra={"member": m.member_id}
            )
        if lost:
            r = self.state.active_resize()
            self.apply(rules(r).on_loss(self.context(), r, lost, gen_broken, e.reason))

    def _recover(self, reason: str) -> None:
        plan = plan_recovery(self.state, self._tuning, reason, self._clock.now())
        self.apply(plan.effects)
        if self.state.job.failure:
            return  # failed, before or by this plan's FailJob (which logged it)
        if not plan.survivors:
            self._log.error(
                "generation %d lost every member (%s); the next Resize forms a new one",
                plan.broken_generation,
                reason,
            )
            return
        self._metrics.restarts.labels(self.state.job_id).inc()
        self._log.warning(
            "unplanned loss: generation %d re-formed with %d member(s), named the checkpoint "
            "of step %d (reached %d); re-form %d in a row of at most %d, workers start in "
            "%.1f s",
            self.state.job.generation,
            plan.survivors,
            plan.restore_step,
            plan.reached_step,
            plan.restarts,
            self._tuning.restart_budget,
            plan.start_delay_s,
        )

    def _record_reached(self, e: fx.RecordReached) -> None:
        gen = self.state.generations[e.generation]
        if e.step <= gen.reached_step:
            return
        gen.reached_step = e.step
        self._changed(gen)
        if e.last_word_of:
            self._log.info(
                "member %s reached step %d in generation %d",
                e.last_word_of,
                e.step,
                e.generation - 1,
                extra={"member": e.last_word_of},
            )
        self._count_lost(gen)

    def _record_restored(self, e: fx.RecordRestored) -> None:
        gen = self.state.generations.get(e.generation)
        if gen is None or (gen.restored_step is not None and e.step >= gen.restored_step):
            return
        if e.step != gen.restore_step:
            self._log.info(
                "member %s restored step %d in generation %d (step %d was named)",
                e.member_id,
                e.step,
                e.generation,
                gen.restore_step,
                extra={"member": e.member_id, "generation": e.generation},
            )
        # The ranks of a generation restore one step together; should two differ, the
        # older one is what the generation redoes from.
        gen.restored_step = e.step
        self._changed(gen)
        self._count_lost(gen)

    def _count_lost(self, gen: Generation) -> None:
        """Lost steps = what the generation before reached past what this one restored:
        counted only once the restored step is known, and only ever raised."""
        if gen.restored_step is None:
            return
        steps = max(0, gen.reached_step - gen.restored_step) - gen.lost_steps
        if steps <= 0:
            return
        gen.lost_steps += steps
        self.state.job.lost_steps_total += steps
        self._metrics.lost_steps.labels(self.state.job_id).inc(steps)
        self._changed(gen, self.state.job)
        self._log.warning(
            "generation %d redoes %d step(s): reached %d before it, restored %d",
            gen.generation,
            gen.lost_steps,
            gen.reached_step,
            gen.restored_step,
            extra={"generation": gen.generation},
        )

    def _fail_job(self, message: str) -> None:
        s = self.state
        if s.job.failure:
            return
        s.job.failure, s.job.failed_at = message, self._clock.now()
        self._changed(s.job)
        self._metrics.jobs_failed.labels(s.job_id).inc()
        self._log.error("job failed: %s", message)
        for m in s.members.values():
            if m.state != MemberState.GONE:
                self._supersede(m.member_id)
                self._send(
                    m,
                    DirectiveKind.STOP,
                    s.job.generation,
                    "the job failed: its restart budget is spent",
                    self._tuning.heartbeat_timeout_s,
                )
        r = s.active_resize()
        if r is not None:
            self.apply(rules(r).on_job_finished(self.context(), r))

    def _report_checkpoint(self, e: fx.ReportCheckpoint) -> None:
        s = self.state
        ck = s.checkpoint(e.step, e.generation)
        if ck is None:
            ck = Checkpoint(
                job_id=s.job_id,
                step=e.step,
                generation=e.generation,
                digest=e.digest,
                good=True,
                write_s=0.0,
                created_at=self._clock.now(),
            )
            s.checkpoints.append(ck)
        else:
            # A barrier's checkpoint that rank 0 reports once it is on disk: as good as
            # promoted, since the workers restore it after a loss either way.
            ck.good = True
            ck.digest = ck.digest or e.digest
        self._changed(ck)
        self._log.info(
            "checkpoint of step %d reported good by member %s (generation %d)",
            e.step,
            e.member_id,
            e.generation,
            extra={"member": e.member_id, "generation": e.generation},
        )

    def _finish_member(self, m: Member) -> None:
        """GONE, keeping its rank as the mark of a finished member (a lost one has none).
        When every member of the generation has finished, the job is finished: nothing
        re-forms, and a resize in flight ends by its phase's rule."""
        s = self.state
        transition_member(m, MemberState.GONE)
        self._supersede(m.member_id)
        self._changed(m)
        self._log.info(
            "member %s finished at step %d in generation %d",
            m.member_id,
            m.step,
            m.reported_generation,
            extra={"member": m.member_id},
        )
        if s.current_members():
            return
        self._log.info(
            "job finished at step %d in generation %d", s.finished_step(), s.job.generation
        )
        r = s.active_resize()
        if r is not None:
            self.apply(rules(r).on_job_finished(self.context(), r))
