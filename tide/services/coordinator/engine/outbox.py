"""The one place that changes a job's state: effects in, a committed unit out.

:class:`Outbox` performs each effect the rules return, records every object it
changes in the operation's :class:`~tide.services.coordinator.store.Unit`, and queues the
directives it creates. :meth:`Outbox.commit` saves the unit and only then makes the
queued directives visible to the members' streams: **a directive never reaches a
launcher before the state it depends on is durable**. If the commit fails, the
in-memory state is ahead of the store and nothing of it was sent; the job is marked
broken and the Coordinator reloads it from the store before its next use.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Iterable
from typing import assert_never

from tide.base.errors import Unavailable
from tide.base.lifecycle import InvalidTransition
from tide.services.common.clock import Clock
from tide.services.coordinator.domain import (
    Breakdown,
    Checkpoint,
    Directive,
    DirectiveKind,
    Generation,
    JobRecord,
    Member,
    MemberState,
    RendezvousInfo,
    Resize,
    ResizePhase,
    WorkerPhase,
    rendezvous_for,
    transition_member,
    transition_resize,
)
from tide.services.coordinator.engine import effects as fx
from tide.services.coordinator.engine.endings import Endings
from tide.services.coordinator.engine.phases import Context, longest_chain, rules
from tide.services.coordinator.engine.recovery import credit_silence
from tide.services.coordinator.engine.state import JobState
from tide.services.coordinator.engine.traces import ResizeTraces
from tide.services.coordinator.metrics import CoordinatorMetrics
from tide.services.coordinator.settings import Tuning
from tide.services.coordinator.store import CoordinatorStore, Unit

#: One operation moves a resize along at most this many edges (the table has no cycle).
MAX_PHASE_CHANGES = longest_chain()


class Notifier:
    """A change counter that coroutines can wait on (streams, watchers).

    Changes happen on the engine's thread (Coordinator.call) and waiters wait on the
    event loop: the counter and the waiters' list are guarded by a lock, and a waiter is
    woken through its loop's thread-safe queue."""

    def __init__(self) -> None:
        self.version = 0
        self._waiters: list[asyncio.Future[None]] = []
        self._mu = threading.Lock()

    def notify(self) -> None:
        with self._mu:
            self.version += 1
            waiters, self._waiters = self._waiters, []
        for fut in waiters:
            fut.get_loop().call_soon_threadsafe(_wake, fut)

    async def wait(self, seen: int) -> int:
        """Return once the version differs from ``seen``."""
        while True:
            with self._mu:
                if self.version != seen:
                    return self.version
                fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                self._waiters.append(fut)
            await fut


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Outbox(Endings):
    """Applies effects to one job's state and commits them as one unit."""

    def __init__(
        self,
        state: JobState,
        store: CoordinatorStore,
        clock: Clock,
        tuning: Tuning,
        metrics: CoordinatorMetrics,
        log: logging.LoggerAdapter[logging.Logger],
    ) -> None:
        self.state = state
        self.notifier = Notifier()
        self.broken = False
        #: Why the last commit failed (what made the runtime broken); None before.
        self.fault: Exception | None = None
        self._store = store
        self._clock = clock
        self._tuning = tuning
        self._metrics = metrics
        self._log = log
        self._unit = Unit()
        self._queued: list[Directive] = []
        # Final resizes already counted in the metrics (a reload brings finished ones back).
        self._counted: set[int] = set()
        self._counted_generation = state.job.generation
        self.traces = ResizeTraces()

    def context(self) -> Context:
        return Context(self.state, self._tuning, self._clock.now())

    # --- the unit of work ------------------------------------------------------

    def _changed(
        self, *objs: JobRecord | Member | Generation | Checkpoint | Resize | Directive
    ) -> None:
        for obj in objs:
            self._unit.add(obj)

    def touch_job(self) -> None:
        """Save the job row in this unit even if no counter changed (a new job's first row)."""
        self._changed(self.state.job)

    def commit(self) -> None:
        unit, self._unit = self._unit, Unit()
        queued, self._queued = self._queued, []
        if unit.empty():
            return
        started = time.perf_counter()
        held_from = self._clock.monotonic()
        try:
            self._store.save(unit)
        except Exception as exc:
            self.broken = True
            self.fault = exc
            self._metrics.commit_failures.inc()
            self._log.exception("commit failed; the job will be reloaded from the store")
            if isinstance(exc, Unavailable):
                raise
            raise Unavailable(f"job {self.state.job_id}: cannot persist state: {exc}") from exc
        self._metrics.commit_seconds.observe(time.perf_counter() - started)
        # A commit that retried through a store outage held every heartbeat back.
        mono = self._clock.monotonic()
        credit_silence(self.state, mono - held_from, mono)
        for d in queued:
            self.state.directives[d.directive_id] = d
        for r in unit.resizes:
            if r.phase.final and r.decision_id not in self._counted:
                self._counted.add(r.decision_id)
                self._metrics.resizes.labels(r.phase.name.lower()).inc()
                if r.phase == ResizePhase.COMPLETED and r.pause_s > 0:
                    self._metrics.pause_seconds.observe(r.pause_s)
        for g in unit.generations:
            # A generation's row is saved again when its restored step or lost steps change.
            if g.generation > self._counted_generation:
                self._counted_generation = g.generation
                self._metrics.generations.labels("resize" if g.decision_id else "recovery").inc()
        self.notifier.notify()

    # --- the phase loop ----------------------------------------------------------

    def settle(self) -> None:
        """Let the active resize take every step it can now.

        Each pass asks its phase's handler to advance; a pass that moves the phase may
        let the next phase move too (a first generation is in RENDEZVOUS at once). The
        table has no cycle, so more passes than its longest path is a bug."""
        for _ in range(MAX_PHASE_CHANGES + 1):
            r = self.state.active_resize()
            if r is None:
                return
            before = r.phase
            self.apply(rules(r).advance(self.context(), r))
            if r.phase == before:
                return
        raise InvalidTransition(
            f"job {self.state.job_id}: resize moved more than {MAX_PHASE_CHANGES} phases "
            "in one operation"
        )

    # --- effects -----------------------------------------------------------------

    def apply(self, effects: Iterable[fx.Effect]) -> None:
        for e in effects:
            self._apply(e)

    def _apply(self, e: fx.Effect) -> None:
        """Perform one effect; the larger ones have a method of their own below."""
        s = self.state
        match e:
            case fx.Send():
                self._send(
                    s.members[e.member_id],
                    e.kind,
                    e.generation,
                    e.reason,
                    e.deadline_s,
                    checkpoint_step=e.checkpoint_step,
                    rendezvous=e.rendezvous,
                    leaving=e.leaving,
                )
            case fx.Prepare():
                self._send(
                    s.members[e.member_id],
                    DirectiveKind.PREPARE,
                    e.generation,
                    e.reason,
                    e.deadline_s,
                    rendezvous=e.rendezvous,
                )
            case fx.BeginPrepare():
                self._begin_prepare(e)
            case fx.RecordPrepared():
                r = s.resizes[e.decision_id]
                if e.member_id not in r.acked:
                    r.acked = (*r.acked, e.member_id)
                    self._changed(r)
            case fx.RecordAck():
                d = s.directives[e.directive_id]
                d.acked, d.ack_ok = True, e.ok
                self._changed(d)
            case fx.Supersede():
                self._supersede(e.member_id, e.kinds)
            case fx.BeginBarrier():
                self._begin_barrier(e)
            case fx.RecordHold():
                self._record_hold(e)
            case fx.SaveBarrierCheckpoint():
                self._save_barrier_checkpoint(s.resizes[e.decision_id])
            case fx.Drain():
                m = s.members[e.member_id]
                transition_member(m, MemberState.DRAINING)
                self._changed(m)
                self._send(m, DirectiveKind.DRAIN, e.generation, e.reason, e.deadline_s)
            case fx.DrainOut():
                self._drain_out(s.members[e.member_id])
            case fx.OpenGeneration():
                self._open_generation(e)
            case fx.EnterRendezvous():
                self._enter_rendezvous(e)
            case fx.Complete():
                self._complete(e)
            case fx.Abort():
                self._finish_resize(e.decision_id, ResizePhase.ABORTED, e.message)
            case fx.Fail():
                self._finish_resize(e.decision_id, ResizePhase.FAILED, e.message)
            case fx.AckedLeaver():
                r = s.resizes[e.decision_id]
                r.acked = (*r.acked, e.member_id)
                self._changed(r)
            case fx.ExtendPhase():
                r = s.resizes[e.decision_id]
                r.phase_started_at = max(r.phase_started_at, e.at)
                self._changed(r)
                self._log.info(
                    "resize %d: carried on after %s in phase %s",
                    r.decision_id,
                    e.after,
                    r.phase.name,
                    extra={"decision_id": r.decision_id},
                )
            case fx.Lose():
                self._lose(e)
            case fx.Recover():
                self._recover(e.reason)
            case fx.ClearRanks():
                for m in s.members.values():
                    # A finished member keeps its rank: that is how a finished job shows.
                    if m.rank is not None and m.state != MemberState.GONE:
                        m.rank = None
                        self._changed(m)
            case fx.RecordReached():
                self._record_reached(e)
            case fx.RecordRestored():
                self._record_restored(e)
            case fx.FailJob():
                self._fail_job(e.message)
            case fx.ReportCheckpoint():
                self._report_checkpoint(e)
            case fx.Finish():
                self._finish_member(s.members[e.member_id])
            case fx.LeaveDrained():
                m = s.members[e.member_id]
                if m.state != MemberState.GONE:
                    transition_member(m, MemberState.GONE)
                    m.rank = None
                    self._changed(m)
                self._log.info(
                    "member %s drained and left", m.member_id, extra={"member": m.member_id}
                )
            case fx.AddMember():
                s.members[e.member.member_id] = e.member
                self._changed(e.member)
            case fx.Registered():
                self._registered(e)
            case fx.StartResize():
                s.resizes[e.resize.decision_id] = e.resize
                self._changed(e.resize, s.job)
            case fx.CreditStall():
                self._credit_stall(e.seconds)
            case fx.RenewDeadlines():
                now = self._clock.now()
                for d in s.directives.values():
                    if d.pending and d.deadline_at is not None:
                        d.deadline_at = max(d.deadline_at, now + e.timeout_s)
                        self._changed(d)
            case _:
                # mypy proves every member of fx.Effect has a case above.
                assert_never(e)

    def _send(
        self,
        m: Member,
        kind: DirectiveKind,
        generation: int,
        reason: str,
        deadline_s: float,
        *,
        checkpoint_step: int = 0,
        rendezvous: RendezvousInfo | None = None,
        leaving: bool = False,
    ) -> None:
        job = self.state.job
        job.directive_seq += 1
        now = self._clock.now()
        d = Directive(
            job_id=job.job_id,
            directive_id=f"d{job.directive_seq}",
            member_id=m.member_id,
            kind=kind,
            generation=generation,
            created_at=now,
            seq=job.directive_seq,
            checkpoint_step=checkpoint_step,
            rendezvous=rendezvous,
            leaving=leaving,
            deadline_at=now + deadline_s,
            reason=reason,
        )
        self._queued.append(d)
        self._changed(job, d)
        r = self.state.active_resize()
        ids: dict[str, object] = {"member": m.member_id, "generation": generation}
        if r is not None:
            ids["decision_id"] = r.decision_id
            self.traces.directive(r.decision_id, kind.name, m.member_id, generation, reason)
        self._log.info(
            "send %s (%s) to member %s in generation %d: %s",
            kind.name,
            d.directive_id,
            m.member_id,
            generation,
            reason,
            extra=ids,
        )

    def _supersede(self, member_id: str, kinds: frozenset[DirectiveKind] = frozenset()) -> None:
        for d in (*self.state.directives.values(), *self._queued):
            if d.member_id == member_id and d.pending and (not kinds or d.kind in kinds):
                d.superseded = True
                self._changed(d)

    def _begin_prepare(self, e: fx.BeginPrepare) -> None:
        r = self.state.resizes[e.decision_id]
        transition_resize(r, ResizePhase.PREPARING, at=self._clock.now())
        self.traces.phase(r.decision_id, ResizePhase.PREPARING)
        r.participants, r.newcomers, r.leaving = e.participants, e.newcomers, e.leaving
        self._changed(r)
        self._log.info(
            "resize %d: g+1 prepares over %d member(s), %d newcomer(s), %d leaving",
            r.decision_id,
            len(e.participants),
            len(e.newcomers),
            len(e.leaving),
            extra={"decision_id": r.decision_id},
        )

    def _begin_barrier(self, e: fx.BeginBarrier) -> None:
        r = self.state.resizes[e.decision_id]
        transition_resize(r, ResizePhase.CHECKPOINTING, at=self._clock.now(), message=e.note)
        self.traces.phase(r.decision_id, ResizePhase.CHECKPOINTING, e.note)
        if e.note:
            self._log.warning(
                "resize %d: %s", r.decision_id, e.note, extra={"decision_id": r.decision_id}
            )
        r.participants, r.newcomers, r.leaving = e.participants, e.newcomers, e.leaving
        r.checkpoint_step = e.step
        self._changed(r)
        self._log.info(
            "resize %d: barrier at step %d over %d member(s), %d newcomer(s), %d leaving "
            "(highest reported step %d, fastest %.1f steps/s)",
            r.decision_id,
            e.step,
            len(e.participants),
            len(e.newcomers),
            len(e.leaving),
            max((self.state.members[m].step for m in e.participants), default=0),
            max((self.state.members[m].steps_per_s for m in e.participants), default=0.0),
            extra={"decision_id": r.decision_id},
        )

    def _record_hold(self, e: fx.RecordHold) -> None:
        r = self.state.resizes[e.decision_id]
        m = self.state.members[e.member_id]
        if e.moved_to_step > r.checkpoint_step:
            self._log.info(
                "resize %d: barrier moved from step %d to %d, where every rank of generation"
                " %d held: its CHECKPOINT came after they passed step %d",
                r.decision_id,
                r.checkpoint_step,
                e.moved_to_step,
                self.state.job.generation,
                r.checkpoint_step,
                extra={"decision_id": r.decision_id},
            )
            r.checkpoint_step = e.moved_to_step
        if e.checkpoint_digest:
            r.checkpoint_digest = e.checkpoint_digest
            r.checkpoint_write_s = e.checkpoint_write_s
        if e.held_step:
            r.held_steps[m.member_id] = e.held_step
        r.held_at_latest = max(r.held_at_latest, e.held_at)
        if m.member_id not in r.acked:
            r.acked = (*r.acked, m.member_id)
        m.phase = WorkerPhase.HOLDING
        m.step = max(m.step, r.checkpoint_step)
        self._changed(r)

    def _save_barrier_checkpoint(self, r: Resize) -> None:
        s = self.state
        ck = s.checkpoint(r.checkpoint_step, s.job.generation)
        if ck is None:
            ck = Checkpoint(
                job_id=s.job_id,
                step=r.checkpoint_step,
                generation=s.job.generation,
                digest=r.checkpoint_digest,
                good=True,
                write_s=r.checkpoint_write_s,
                created_at=self._clock.now(),
            )
            s.checkpoints.append(ck)
        else:
            # Rank 0 may have reported it in a heartbeat already: add the ack's facts.
            ck.digest = r.checkpoint_digest
            ck.write_s = r.checkpoint_write_s
            ck.good = True
        self._changed(ck)

    def _drain_out(self, m: Member) -> None:
        if m.state != MemberState.DRAINING:
            return
        self._log.warning(
            "member %s did not confirm DRAIN in time; treated as gone",
            m.member_id,
            extra={"member": m.member_id},
        )
        transition_member(m, MemberState.GONE)
        m.rank = None
        self._supersede(m.member_id)
        self._changed(m)

    def _open_generation(self, e: fx.OpenGeneration) -> None:
        s = self.state
        g = s.job.generation + 1
        ordered = [s.members[i] for i in e.member_ids]
        infos = (
            tuple(
                dataclasses.replace(i, restore_step=e.restore_step, prepared=True)
                for i in e.prepared
            )
            if e.prepared
            else rendezvous_for(ordered, g, e.restore_step)
        )
        if e.start_delay_s:
            infos = tuple(dataclasses.replace(i, start_delay_s=e.start_delay_s) for i in infos)
        for m in s.members.values():
            if m.rank is not None and m.member_id not in e.member_ids:
                m.rank = None
                if m.state == MemberState.ACTIVE:
                    transition_member(m, MemberState.STANDBY)
                self._changed(m)
        for m, info in zip(ordered, infos, strict=True):
            transition_member(m, MemberState.ACTIVE)
            m.rank = info.rank
            m.first_step_at = None
            m.startup = Breakdown()
            self._supersede(m.member_id)
            self._changed(m)
            self._send(m, DirectiveKind.RENDEZVOUS, g, e.reason, e.deadline_s, rendezvous=info)
        gen = Generation(
            job_id=s.job_id,
            generation=g,
            world_size=len(ordered),
            member_ids=e.member_ids,
            master_endpoint=infos[0].master_endpoint,
            trainer_endpoints=infos[0].trainer_endpoints,
            restore_step=e.restore_step,
            created_at=self._clock.now(),
            reason=e.reason,
            decision_id=e.decision_id,
            # A recovery records what g reached next (RecordReached); a planned generation
            # continues from its barrier's step: anything it restores below is lost.
            reached_step=e.restore_step,
        )
        s.generations[g] = gen
        s.job.generation = g
        self._changed(gen, s.job)
        self._log.info(
            "generation %d: world %d, master %s, restore step %d (%s)",
            g,
            gen.world_size,
            gen.master_endpoint,
            e.restore_step,
            e.reason,
            extra={"generation": g, "decision_id": e.decision_id},
        )

    def _enter_rendezvous(self, e: fx.EnterRendezvous) -> None:
        r = self.state.resizes[e.decision_id]
        now = self._clock.now()
        if e.newcomers is not None:
            r.newcomers = e.newcomers
        transition_resize(r, ResizePhase.RENDEZVOUS, at=now)
        self.traces.phase(r.decision_id, ResizePhase.RENDEZVOUS)
        r.to_generation = self.state.job.generation
        r.rendezvous_sent_at = now
        self._changed(r)

    def _complete(self, e: fx.Complete) -> None:
        r = self.state.resizes[e.decision_id]
        r.pause_s, r.breakdown = e.pause_s, e.breakdown
        if e.to_generation is not None:
            r.to_generation = e.to_generation
        self._finish_resize(e.decision_id, ResizePhase.COMPLETED, e.message)
        self._log.info(
            "resize %d completed: generation %d, pause %.3f s (%s)",
            r.decision_id,
            r.to_generation,
            r.pause_s,
            e.message,
            extra={"decision_id": r.decision_id, "generation": r.to_generation},
        )

    def _finish_resize(self, decision_id: int, phase: ResizePhase, message: str) -> None:
        r = self.state.resizes[decision_id]
        transition_resize(r, phase, at=self._clock.now(), message=message)
        self.traces.phase(decision_id, phase, message)
        self._changed(r)
        if phase is not ResizePhase.COMPLETED:
            why = phase.name.lower()
            ids = {"decision_id": decision_id}
            self._log.warning("resize %d %s: %s", decision_id, why, message, extra=ids)

    def _registered(self, e: fx.Registered) -> None:
        m = self.state.members[e.member_id]
        m.host = e.host
        m.free_port = e.free_port or m.free_port
        m.pod_uid = e.pod_uid or m.pod_uid
        m.last_seen_mono = self._clock.monotonic()
        m.last_heartbeat_at = self._clock.now()
        m.reported_generation = e.last_generation
        self._changed(m, self.state.job)

    def _credit_stall(self, stalled_s: float) -> None:
        s = self.state
        mono = self._clock.monotonic()
        for m in s.members.values():
            if m.state != MemberState.GONE:
                # Never past now: a heartbeat handled just before this tick is simply recent.
                m.last_seen_mono = min(mono, m.last_seen_mono + stalled_s)
        for d in s.directives.values():
            if d.pending and d.deadline_at is not None:
                d.deadline_at += stalled_s
                self._changed(d)
        r = s.active_resize()
        if r is not None:
            r.phase_started_at += stalled_s
            self._changed(r)
        self._log.debug("stall of %.2f s credited to every timeout and deadline", stalled_s)
