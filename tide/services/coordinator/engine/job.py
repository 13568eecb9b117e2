"""One job's coordinator: each call is one operation that asks the rules (membership,
the phase table, recovery) for effects, lets the outbox perform them and commits.

Every operation is synchronous (no await inside) and runs on the engine's one thread
(:meth:`Coordinator.call`), so each runs atomically.
"""

from __future__ import annotations

import dataclasses
import logging

from tide.base.errors import InvalidArgument
from tide.services.common.clock import Clock
from tide.services.common.logs import with_context
from tide.services.coordinator.domain import (
    Checkpoint,
    Directive,
    DirectiveKind,
    Generation,
    JobRecord,
    Member,
    MemberState,
    Resize,
    ResizePhase,
)
from tide.services.coordinator.engine import membership, recovery, views
from tide.services.coordinator.engine.effects import (
    CreditStall,
    DrainOut,
    ExtendPhase,
    Finish,
    Lose,
    RecordAck,
    RenewDeadlines,
    StartResize,
)
from tide.services.coordinator.engine.messages import (
    AckInput,
    HeartbeatInput,
    JobView,
    RegisterInput,
    RegisterResult,
    ResizeInput,
    ResizeView,
)
from tide.services.coordinator.engine.outbox import Notifier, Outbox
from tide.services.coordinator.engine.phases import AckEvent, rules
from tide.services.coordinator.engine.state import JobState
from tide.services.coordinator.errors import (
    JobEnded,
    MemberGone,
    ResizeInProgress,
    StaleGeneration,
    UnknownDirective,
    UnknownResize,
)
from tide.services.coordinator.metrics import CoordinatorMetrics
from tide.services.coordinator.settings import Tuning
from tide.services.coordinator.store import CoordinatorStore, JobSnapshot

logger = logging.getLogger(__name__)


class JobRuntime:
    """The coordinator of one job."""

    def __init__(
        self,
        job: JobRecord,
        store: CoordinatorStore,
        clock: Clock,
        tuning: Tuning,
        metrics: CoordinatorMetrics | None = None,
        state: JobState | None = None,
    ) -> None:
        self.state = state or JobState(job)
        self._clock = clock
        self._tuning = tuning
        self._log = with_context(logger, job_id=job.job_id)
        self._metrics = metrics or CoordinatorMetrics()
        self.outbox = Outbox(self.state, store, clock, tuning, self._metrics, self._log)
        self._stream_tokens: dict[str, object] = {}

    @classmethod
    def from_snapshot(
        cls,
        snap: JobSnapshot,
        store: CoordinatorStore,
        clock: Clock,
        tuning: Tuning,
        metrics: CoordinatorMetrics | None = None,
    ) -> JobRuntime:
        return cls(snap.job, store, clock, tuning, metrics, JobState.from_snapshot(snap))

    # --- what streams, views and tests read ---------------------------------

    @property
    def job(self) -> JobRecord:
        return self.state.job

    @property
    def members(self) -> dict[str, Member]:
        return self.state.members

    @property
    def generations(self) -> dict[int, Generation]:
        return self.state.generations

    @property
    def checkpoints(self) -> list[Checkpoint]:
        return self.state.checkpoints

    @property
    def resizes(self) -> dict[int, Resize]:
        return self.state.resizes

    @property
    def directives(self) -> dict[str, Directive]:
        return self.state.directives

    @property
    def notifier(self) -> Notifier:
        return self.outbox.notifier

    @property
    def broken(self) -> bool:
        return self.outbox.broken

    def member(self, member_id: str) -> Member:
        return self.state.member(member_id)

    def active_resize(self) -> Resize | None:
        return self.state.active_resize()

    def current_members(self) -> list[Member]:
        return self.state.current_members()

    def finished(self) -> bool:
        return self.state.finished()

    def pending_directives(self, member_id: str) -> list[Directive]:
        return self.state.pending_directives(member_id)

    def resize_view(self, decision_id: int) -> ResizeView:
        return views.resize_view(self.state, decision_id)

    def status(self) -> JobView:
        return views.job_view(self.state, self._tuning, self._clock.now())

    # --- streams --------------------------------------------------------------

    def open_stream(self, member_id: str) -> object:
        """A token for a new Directives stream; a newer stream of the member supersedes it."""
        m = self.member(member_id)
        if m.state == MemberState.GONE:
            raise MemberGone(f"member {member_id} has left job {self.job.job_id}; register again")
        token = object()
        self._stream_tokens[member_id] = token
        self.notifier.notify()
        return token

    def stream_current(self, member_id: str, token: object) -> bool:
        m = self.members.get(member_id)
        return (
            m is not None
            and m.state != MemberState.GONE
            and self._stream_tokens.get(member_id) is token
            and not self.broken
        )

    # --- operations -------------------------------------------------------------

    def _finish_operation(self) -> None:
        self.outbox.settle()
        self.outbox.commit()

    def register(self, inp: RegisterInput) -> RegisterResult:
        member_id, effects = membership.register(self.state, inp, self._clock.now())
        self.outbox.apply(effects)
        m = self.members[member_id]
        self._log.info(
            "member %s registered: pod %s index %d at %s (state %s, last generation %d, job at %d)",
            m.member_id,
            m.pod_name,
            m.pod_index,
            m.endpoint,
            m.state.name,
            inp.last_generation,
            self.job.generation,
            extra={"member": m.member_id},
        )
        self._finish_operation()
        return RegisterResult(
            member_id=m.member_id,
            generation=self.job.generation,
            state=m.state,
            heartbeat_interval_s=self._tuning.heartbeat_interval_s,
            heartbeat_timeout_s=self._tuning.heartbeat_timeout_s,
        )

    def heartbeat(self, inp: HeartbeatInput) -> int:
        effects, changed = membership.heartbeat(
            self.state, inp, self._clock.now(), self._clock.monotonic()
        )
        self.outbox.apply(effects)
        if changed:
            self.notifier.notify()
        durable = views.newest_durable(self.state)
        if durable is not None and durable.member_id == inp.member_id:
            self._metrics.durable(
                self.job.job_id, durable.durable_step, durable.durable_lag_s, durable.durable_at
            )
        self._finish_operation()
        return self.job.generation

    def ack(self, inp: AckInput) -> None:
        m = self.member(inp.member_id)
        d = self.directives.get(inp.directive_id)
        if d is None or d.member_id != m.member_id:
            raise UnknownDirective(
                f"directive {inp.directive_id!r} was not sent to member {m.member_id}"
            )
        if inp.generation != d.generation:
            raise StaleGeneration(
                f"ack of {d.directive_id} names generation {inp.generation}; "
                f"the directive belongs to generation {d.generation}"
            )
        # A DRAIN is never overtaken: on a shrink it goes out with the stayers' RENDEZVOUS,
        # so the job is already in g+1 when the leaver (in g) acks it.
        if d.generation < self.job.generation and d.kind != DirectiveKind.DRAIN:
            raise StaleGeneration(
                f"directive {d.directive_id} of generation {d.generation} was overtaken: "
                f"job {self.job.job_id} is in generation {self.job.generation}"
            )
        if d.acked:
            return
        self.outbox.apply([RecordAck(d.directive_id, inp.ok)])
        if not d.superseded:
            self.outbox.apply(membership.on_ack(self.state, m, d, inp))
            r = self.active_resize()
            if r is not None:
                event = AckEvent(
                    member_id=m.member_id,
                    kind=d.kind,
                    ok=inp.ok,
                    directive_step=d.checkpoint_step,
                    checkpoint_step=inp.checkpoint_step,
                    checkpoint_digest=inp.checkpoint_digest,
                    held_at=inp.held_at,
                    checkpoint_write_s=inp.checkpoint_write_s,
                    message=inp.message,
                )
                self.outbox.apply(rules(r).on_ack(self.outbox.context(), r, event))
        self._finish_operation()

    def start_resize(self, inp: ResizeInput) -> Resize:
        existing = self.resizes.get(inp.decision_id)
        if existing is not None:
            return existing
        if inp.target_world_size < 1:
            raise InvalidArgument(f"target_world_size: must be >= 1, got {inp.target_world_size}")
        if not 0 <= inp.deadline_s < float("inf"):
            raise InvalidArgument(f"deadline_s: must be >= 0 and finite, got {inp.deadline_s}")
        min_size = inp.min_world_size or inp.target_world_size
        if min_size > inp.target_world_size:
            raise InvalidArgument(
                f"min_world_size: must be <= target_world_size ({inp.target_world_size}), "
                f"got {inp.min_world_size}"
            )
        _check_whole_groups(inp, min_size)
        ended = self._ended()
        if ended:
            raise JobEnded(f"job {self.job.job_id} {ended}: nothing to resize")
        active = self.active_resize()
        if active is not None:
            raise ResizeInProgress(
                f"resize {active.decision_id} of job {self.job.job_id} is in phase "
                f"{active.phase.name}; abort it or wait"
            )
        now = self._clock.now()
        r = Resize(
            decision_id=inp.decision_id,
            job_id=self.job.job_id,
            target_world_size=inp.target_world_size,
            min_world_size=min_size,
            leaving_pods=tuple(inp.leaving_pods),
            # 0: the coordinator's own phase timeout.
            deadline_s=inp.deadline_s or self._tuning.phase_timeout_s,
            phase=ResizePhase.WAITING_FOR_MEMBERS,
            from_generation=self.job.generation,
            started_at=now,
            phase_started_at=now,
        )
        self.outbox.apply([StartResize(r)])
        self.outbox.traces.begin(r, inp.trace_parent)
        self._log.info(
            "resize %d: world %d -> %d (deadline %.1f s)",
            r.decision_id,
            len(self.state.actives()),
            r.target_world_size,
            r.deadline_s,
            extra={"decision_id": r.decision_id},
        )
        self._finish_operation()
        return r

    def _ended(self) -> str:
        """How the job ended ("" while it runs): a Resize of it can never complete."""
        if self.job.failure:
            return f"failed: {self.job.failure}"
        if self.state.finished():
            return f"finished at step {self.state.finished_step()}"
        return ""

    def abort_resize(self, decision_id: int, reason: str) -> ResizePhase:
        r = self.resizes.get(decision_id)
        if r is None:
            raise UnknownResize(f"no resize {decision_id} in job {self.job.job_id}")
        if not r.phase.final:
            # From RENDEZVOUS on the old generation cannot resume: the handler refuses, the
            # resize is carried to completion and its phase is the answer.
            self.outbox.apply(rules(r).on_abort_request(self.outbox.context(), r, reason))
            self.outbox.commit()
        return r.phase

    def tick(self, stalled_s: float = 0.0) -> None:
        """Check heartbeat timeouts and deadlines; called periodically.

        ``stalled_s``: how much later than planned this tick runs (the event loop was
        blocked or the process starved). Nobody could be heard during that time, so every
        heartbeat timeout and deadline moves by it; otherwise a stall longer than
        heartbeat_timeout_s would declare every member lost at once."""
        s, out = self.state, self.outbox
        now, mono = self._clock.now(), self._clock.monotonic()
        if stalled_s > 0:
            out.apply([CreditStall(stalled_s)])
        silent = recovery.silent(s, mono, self._tuning)
        if silent:
            reason = f"no heartbeat for {self._tuning.heartbeat_timeout_s:.1f} s"
            out.apply([Lose(tuple(m.member_id for m in silent), reason)])
        drains = recovery.overdue_drains(s, now)
        if drains:
            out.apply([DrainOut(i) for i in drains])
            # The last leaver gone may complete a resize whose g+1 already runs, before its
            # phase deadline could fail it.
            out.settle()
        r = s.active_resize()
        if r is not None and now >= r.phase_deadline_at:
            out.apply(rules(r).on_deadline(out.context(), r))
        overdue = recovery.overdue(s, now)
        if overdue:
            out.apply([Lose(overdue, "a directive was not acknowledged")])
        self._finish_operation()

    def recover_after_restart(self) -> None:
        """Apply the restart rules: give every member a fresh heartbeat timeout to come
        back, abort a resize that had not passed its barrier, carry on one that had."""
        recovery.forget_liveness(self.state, self._clock.monotonic())
        # Deadlines kept running while nobody could ack: the downtime is not the
        # members' fault, so each pending directive gets a full timeout again.
        self.outbox.apply([RenewDeadlines(self._tuning.heartbeat_timeout_s)])
        r = self.active_resize()
        if r is not None:
            self.outbox.apply(rules(r).on_restart(self.outbox.context(), r))
        self.outbox.commit()

    def recover_after_store_fault(self, old: JobRuntime | None, cause: str) -> None:
        """Carry on from the stored state after a commit the store failed, in the same
        process: not a restart, so no resize is aborted for one.

        What the failed unit changed was never sent (directives go out only after their
        commit), so the store holds all that members were told; what they did meanwhile
        (acks, heartbeats) was refused UNAVAILABLE and comes again (a reconnecting
        launcher re-acks what it handled). What heartbeats reported lives in memory
        only, and this process still knows it: it is carried over, so a barrier is
        still placed past every member's step. Nobody could be heard while the store
        was down, so every member, directive and phase gets its full time again."""
        finished: list[str] = []
        if old is not None:
            for m in self.members.values():
                before = old.members.get(m.member_id)
                if before is not None:
                    _carry_reported(before, m)
                    if _finished_unstored(before, m, self.job.generation):
                        finished.append(m.member_id)
        mono = self._clock.monotonic()
        for m in self.members.values():
            m.last_seen_mono = mono
        self.outbox.apply([RenewDeadlines(self._tuning.heartbeat_timeout_s)])
        for mid in finished:
            # Its launcher reported the end (its worker exited 0 at the job's last step)
            # and the commit of that report failed: a fact this process heard, not a
            # silence. Its launcher may have given up reporting it again before the store
            # came back; recorded now, the member finishes instead of being lost later.
            self._log.info(
                "member %s reported its final step %d before the store failed; recorded now",
                mid,
                self.members[mid].step,
                extra={"member": mid},
            )
            self.outbox.apply([Finish(mid)])
        r = self.active_resize()
        if r is not None:
            after = f"the store failed a commit ({cause})"
            self.outbox.apply([ExtendPhase(r.decision_id, self._clock.now(), after=after)])
        self._finish_operation()


#: The fields of a Member that heartbeats report and the store does not keep (those
#: declared after ``version``, domain.py).
_FIELDS = [f.name for f in dataclasses.fields(Member)]
_REPORTED = tuple(_FIELDS[_FIELDS.index("version") + 1 :])


def _finished_unstored(before: Member, stored: Member, generation: int) -> bool:
    """Whether the member finished in memory in the stored ``generation`` (GONE with its
    rank kept: the mark of a finished member, a lost one has none) while the store still
    has it running."""
    return (
        before.reported_generation == generation
        and before.state == MemberState.GONE
        and before.rank is not None
        and stored.state == MemberState.ACTIVE
        and stored.rank is not None
    )


def _carry_reported(src: Member, dst: Member) -> None:
    for name in _REPORTED:
        setattr(dst, name, getattr(src, name))


def _check_whole_groups(inp: ResizeInput, min_size: int) -> None:
    """A world of model-parallel groups moves by whole groups: a partial one cannot train."""
    m = inp.world_multiple
    if m <= 1:
        return
    if inp.target_world_size % m:
        raise InvalidArgument(
            f"target_world_size: {inp.target_world_size} is not a multiple of world_multiple"
            f" {m} (the members one model-parallel group spans)"
        )
    if min_size != inp.target_world_size:
        raise InvalidArgument(
            f"min_world_size: must be 0 or target_world_size ({inp.target_world_size}) with"
            f" world_multiple {m}: a grow takes all its newcomers or none, got {min_size}"
        )
