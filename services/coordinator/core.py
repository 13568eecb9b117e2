"""The coordinator's engine: one :class:`JobRuntime` per job holds the membership,
generations, directive queues and the active resize, and moves them along the
transition tables of :mod:`services.coordinator.domain`.

Every operation is synchronous (no await inside), so on the one asyncio loop of the
server each runs atomically. It mutates in-memory state, collects what changed in a
:class:`~services.coordinator.store.Unit`, commits that unit, and only then makes
the directives it created visible to the members' streams: a directive never
reaches a launcher before the state it depends on is durable. If the commit fails,
the job's in-memory state is thrown away and reloaded from the store.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from services.common.clock import Clock
from services.common.logs import with_context
from services.coordinator.domain import (
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
    choose_checkpoint_step,
    choose_leaving,
    measure_pause,
    rank_order,
    rendezvous_for,
    transition_member,
    transition_resize,
)
from services.coordinator.errors import (
    MemberGone,
    ResizeInProgress,
    StaleGeneration,
    UnknownDirective,
    UnknownJob,
    UnknownMember,
    UnknownResize,
)
from services.coordinator.metrics import CoordinatorMetrics
from services.coordinator.settings import Tuning
from services.coordinator.store import CoordinatorStore, JobSnapshot, Unit
from tidebase.errors import InvalidArgument, Unavailable

logger = logging.getLogger(__name__)

T = TypeVar("T")


# --- inputs and views (what the servicer converts from and to protobuf) ---------


@dataclass(frozen=True)
class RegisterInput:
    job_id: str
    pod_name: str
    pod_index: int
    host: str
    launcher_id: str
    last_generation: int = 0
    pod_uid: str = ""
    free_port: int = 0


@dataclass(frozen=True)
class RegisterResult:
    member_id: str
    generation: int
    state: MemberState
    heartbeat_interval_s: float
    heartbeat_timeout_s: float


@dataclass(frozen=True)
class HeartbeatInput:
    member_id: str
    generation: int
    phase: WorkerPhase
    step: int = 0
    samples_consumed: int = 0
    epoch: int = 0
    samples_per_s: float = 0.0
    first_step_at: float | None = None
    startup: Breakdown = field(default_factory=Breakdown)
    free_port: int = 0
    # The newest good checkpoint the member's worker wrote (periodic ones included); 0: none.
    last_checkpoint_step: int = 0
    last_checkpoint_digest: str = ""


@dataclass(frozen=True)
class AckInput:
    member_id: str
    directive_id: str
    generation: int
    ok: bool
    checkpoint_step: int = 0
    checkpoint_digest: str = ""
    message: str = ""
    held_at: float | None = None
    checkpoint_write_s: float = 0.0


@dataclass(frozen=True)
class ResizeInput:
    decision_id: int
    job_id: str
    target_world_size: int
    deadline_s: float
    leaving_pods: tuple[str, ...] = ()
    min_world_size: int = 0


@dataclass(frozen=True)
class ResizeView:
    decision_id: int
    phase: ResizePhase
    generation: int
    world_size: int
    checkpoint_step: int
    pause_s: float
    breakdown: Breakdown
    lost_steps: int
    message: str


@dataclass(frozen=True)
class MemberView:
    member_id: str
    pod_name: str
    pod_index: int
    pod_uid: str
    host: str
    state: MemberState
    rank: int
    phase: WorkerPhase
    step: int
    samples_per_s: float
    last_heartbeat_at: float


@dataclass(frozen=True)
class JobView:
    job_id: str
    generation: int
    world_size: int
    members: tuple[MemberView, ...]
    step: int
    epoch: int
    samples_consumed: int
    samples_per_s: float
    last_checkpoint_step: int
    active_resize: ResizeView | None
    lost_steps_total: int
    finished: bool = False


class Notifier:
    """A change counter that coroutines can wait on (streams, watchers)."""

    def __init__(self) -> None:
        self.version = 0
        self._waiters: list[asyncio.Future[None]] = []

    def notify(self) -> None:
        self.version += 1
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait(self, seen: int) -> int:
        """Return once the version differs from ``seen``."""
        while self.version == seen:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut
        return self.version


def _add_once(items: list[T], obj: T) -> None:
    if not any(x is obj for x in items):
        items.append(obj)


class JobRuntime:
    """The coordinator of one job."""

    def __init__(
        self,
        job: JobRecord,
        store: CoordinatorStore,
        clock: Clock,
        tuning: Tuning,
        metrics: CoordinatorMetrics | None = None,
    ) -> None:
        self.job = job
        self.members: dict[str, Member] = {}
        self.generations: dict[int, Generation] = {}
        self.checkpoints: list[Checkpoint] = []
        self.resizes: dict[int, Resize] = {}
        # Committed directives, by id; streams only ever see these.
        self.directives: dict[str, Directive] = {}
        self.notifier = Notifier()
        self.broken = False
        self._store = store
        self._clock = clock
        self._tuning = tuning
        self._metrics = metrics or CoordinatorMetrics()
        self._unit = Unit()
        self._outgoing: list[Directive] = []
        self._stream_tokens: dict[str, object] = {}
        # Final resizes already counted in the metrics (a final one is saved once,
        # but a reload brings finished ones back).
        self._counted: set[int] = set()
        self._log = with_context(logger, job_id=job.job_id)

    @classmethod
    def from_snapshot(
        cls,
        snap: JobSnapshot,
        store: CoordinatorStore,
        clock: Clock,
        tuning: Tuning,
        metrics: CoordinatorMetrics | None = None,
    ) -> JobRuntime:
        rt = cls(snap.job, store, clock, tuning, metrics)
        rt.members = {m.member_id: m for m in snap.members}
        rt.generations = {g.generation: g for g in snap.generations}
        rt.checkpoints = list(snap.checkpoints)
        rt.resizes = {r.decision_id: r for r in snap.resizes}
        rt.directives = {d.directive_id: d for d in sorted(snap.directives, key=lambda d: d.seq)}
        return rt

    # --- unit of work -------------------------------------------------------

    def _dirty(self, obj: Member | Generation | Checkpoint | Resize | Directive) -> None:
        if isinstance(obj, Member):
            _add_once(self._unit.members, obj)
        elif isinstance(obj, Generation):
            _add_once(self._unit.generations, obj)
        elif isinstance(obj, Checkpoint):
            _add_once(self._unit.checkpoints, obj)
        elif isinstance(obj, Resize):
            _add_once(self._unit.resizes, obj)
        else:
            _add_once(self._unit.directives, obj)

    def _commit(self) -> None:
        unit, self._unit = self._unit, Unit()
        outgoing, self._outgoing = self._outgoing, []
        if unit.empty():
            return
        started = time.perf_counter()
        try:
            self._store.save(unit)
        except Exception as exc:
            # Memory is now ahead of the store; nothing of it was sent. The
            # Coordinator reloads this job from the store before its next use.
            self.broken = True
            self._metrics.commit_failures.inc()
            self._log.exception("commit failed; the job will be reloaded from the store")
            if isinstance(exc, Unavailable):
                raise
            raise Unavailable(f"job {self.job.job_id}: cannot persist state: {exc}") from exc
        self._metrics.commit_seconds.observe(time.perf_counter() - started)
        for d in outgoing:
            self.directives[d.directive_id] = d
        for r in unit.resizes:
            if r.phase.final and r.decision_id not in self._counted:
                self._counted.add(r.decision_id)
                self._metrics.resizes.labels(r.phase.name).inc()
                if r.phase == ResizePhase.COMPLETED and r.pause_s > 0:
                    self._metrics.pause_seconds.observe(r.pause_s)
        for g in unit.generations:
            self._metrics.generations.labels("resize" if g.decision_id else "recovery").inc()
        self.notifier.notify()

    def _touch_job(self) -> None:
        self._unit.job = self.job

    # --- lookups ------------------------------------------------------------

    def member(self, member_id: str) -> Member:
        m = self.members.get(member_id)
        if m is None:
            raise UnknownMember(f"member {member_id!r} is not known in job {self.job.job_id}")
        return m

    def active_resize(self) -> Resize | None:
        for r in self.resizes.values():
            if not r.phase.final:
                return r
        return None

    def current_members(self) -> list[Member]:
        """Members of the current generation still in it, in rank order."""
        ms = [
            m for m in self.members.values() if m.rank is not None and m.state != MemberState.GONE
        ]
        return sorted(ms, key=lambda m: m.rank or 0)

    def _actives(self) -> list[Member]:
        return [m for m in self.current_members() if m.state == MemberState.ACTIVE]

    def _standby(self) -> list[Member]:
        ms = [m for m in self.members.values() if m.state == MemberState.STANDBY]
        return sorted(ms, key=lambda m: (m.pod_index, m.pod_name))

    def _running(self, m: Member) -> bool:
        return m.reported_generation == self.job.generation and m.phase in (
            WorkerPhase.RUNNING,
            WorkerPhase.HOLDING,
        )

    def last_good_step(self) -> int:
        return max((c.step for c in self.checkpoints if c.good), default=0)

    def _pending(self, member_id: str) -> list[Directive]:
        return [d for d in (*self.directives.values(), *self._outgoing) if d.member_id == member_id]

    # --- directives ---------------------------------------------------------

    def _send(
        self,
        m: Member,
        kind: DirectiveKind,
        generation: int,
        *,
        reason: str,
        deadline_s: float,
        checkpoint_step: int = 0,
        rendezvous: RendezvousInfo | None = None,
    ) -> Directive:
        self.job.directive_seq += 1
        self._touch_job()
        seq = self.job.directive_seq
        now = self._clock.now()
        d = Directive(
            job_id=self.job.job_id,
            directive_id=f"d{seq}",
            member_id=m.member_id,
            kind=kind,
            generation=generation,
            created_at=now,
            seq=seq,
            checkpoint_step=checkpoint_step,
            rendezvous=rendezvous,
            deadline_at=now + deadline_s,
            reason=reason,
        )
        self._outgoing.append(d)
        self._dirty(d)
        self._log.info(
            "send %s (%s) to member %s in generation %d: %s",
            kind.name,
            d.directive_id,
            m.member_id,
            generation,
            reason,
        )
        return d

    def _supersede(self, m: Member, kinds: Iterable[DirectiveKind] | None = None) -> None:
        wanted = set(kinds) if kinds is not None else None
        for d in self._pending(m.member_id):
            if d.pending and (wanted is None or d.kind in wanted):
                d.superseded = True
                self._dirty(d)

    def pending_directives(self, member_id: str) -> list[Directive]:
        """Unacknowledged committed directives of a member, in the order they were sent."""
        ds = [d for d in self.directives.values() if d.member_id == member_id and d.pending]
        return sorted(ds, key=lambda d: d.seq)

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

    # --- Register -------------------------------------------------------------

    def register(self, inp: RegisterInput) -> RegisterResult:
        now, mono = self._clock.now(), self._clock.monotonic()
        m = next(
            (
                x
                for x in self.members.values()
                if x.launcher_id == inp.launcher_id and x.state != MemberState.GONE
            ),
            None,
        )
        if m is None:
            replaced = [
                x
                for x in self.members.values()
                if x.pod_name == inp.pod_name and x.state != MemberState.GONE
            ]
            if replaced:
                self._lose(
                    replaced,
                    worker_failed=False,
                    reason=f"pod {inp.pod_name} registered again with a new launcher",
                )
            m = Member(
                member_id=f"{inp.pod_name}-{uuid.uuid4().hex[:8]}",
                job_id=self.job.job_id,
                pod_name=inp.pod_name,
                pod_index=inp.pod_index,
                pod_uid=inp.pod_uid,
                host=inp.host,
                launcher_id=inp.launcher_id,
                free_port=inp.free_port,
                state=MemberState.STANDBY,
                registered_at=now,
            )
            self.members[m.member_id] = m
            self._log.info(
                "member %s registered: pod %s index %d at %s",
                m.member_id,
                m.pod_name,
                m.pod_index,
                m.endpoint,
            )
        else:
            m.host = inp.host
            m.free_port = inp.free_port or m.free_port
            m.pod_uid = inp.pod_uid or m.pod_uid
            self._log.info(
                "member %s re-registered (state %s, last generation %d, job at %d)",
                m.member_id,
                m.state.name,
                inp.last_generation,
                self.job.generation,
            )
        m.last_seen_mono = mono
        m.last_heartbeat_at = now
        m.reported_generation = inp.last_generation
        self._dirty(m)
        self._touch_job()
        self._advance()
        self._commit()
        return RegisterResult(
            member_id=m.member_id,
            generation=self.job.generation,
            state=m.state,
            heartbeat_interval_s=self._tuning.heartbeat_interval_s,
            heartbeat_timeout_s=self._tuning.heartbeat_timeout_s,
        )

    # --- Heartbeat ------------------------------------------------------------

    def heartbeat(self, inp: HeartbeatInput) -> int:
        m = self.member(inp.member_id)
        if m.state == MemberState.GONE:
            raise MemberGone(f"member {m.member_id} has left job {self.job.job_id}; register again")
        now, mono = self._clock.now(), self._clock.monotonic()
        if inp.free_port:
            m.free_port = inp.free_port
        m.last_heartbeat_at = now
        # Never backwards: a launcher's last word about the generation it is leaving can
        # arrive after its first heartbeat in the next one.
        m.reported_generation = max(m.reported_generation, inp.generation)
        in_current = m.rank is not None and inp.generation == self.job.generation > 0
        if in_current:
            if inp.step > m.step and m.last_seen_mono > 0 and mono > m.last_seen_mono:
                m.steps_per_s = (inp.step - m.step) / (mono - m.last_seen_mono)
            prev_phase = m.phase
            m.phase = inp.phase
            m.step = inp.step
            m.epoch = inp.epoch
            m.samples_consumed = inp.samples_consumed
            m.samples_per_s = inp.samples_per_s
            m.first_step_at = inp.first_step_at
            m.startup = inp.startup
            # Before any loss handling: a recovery this heartbeat triggers must name the
            # checkpoint it reports.
            if inp.last_checkpoint_step:
                self._record_reported_checkpoint(
                    m, inp.last_checkpoint_step, inp.last_checkpoint_digest, inp.generation
                )
            if inp.phase == WorkerPhase.FAILED and prev_phase != WorkerPhase.FAILED:
                self._lose(
                    [m], worker_failed=True, reason=f"worker of {m.member_id} reported FAILED"
                )
            elif inp.phase == WorkerPhase.IDLE and m.state == MemberState.ACTIVE:
                self._finish(m)
            elif prev_phase != inp.phase:
                self.notifier.notify()
        elif m.state == MemberState.STANDBY:
            m.phase = inp.phase
        elif 0 < inp.generation < self.job.generation:
            self._late_progress(m, inp)
        m.last_seen_mono = mono
        self._advance()
        self._commit()
        return self.job.generation

    def _record_reported_checkpoint(
        self, m: Member, step: int, digest: str, generation: int
    ) -> None:
        """A member's worker wrote the checkpoint of ``step`` and verified its manifest: it is
        good, and the next recovery names it. Only a step newer than every good one counts, so
        a heartbeat repeating it costs nothing."""
        if step <= self.last_good_step():
            return
        ck = self._checkpoint(step, generation)
        if ck is None:
            ck = Checkpoint(
                job_id=self.job.job_id,
                step=step,
                generation=generation,
                digest=digest,
                good=True,
                write_s=0.0,
                created_at=self._clock.now(),
            )
            self.checkpoints.append(ck)
        else:
            # A barrier's checkpoint that rank 0 reports once it is on disk: as good as
            # promoted, since the workers restore it after a loss either way.
            ck.good = True
            ck.digest = ck.digest or digest
        self._dirty(ck)
        self._log.info(
            "checkpoint of step %d reported good by member %s (generation %d)",
            step,
            m.member_id,
            generation,
        )

    def _checkpoint(self, step: int, generation: int) -> Checkpoint | None:
        for ck in self.checkpoints:
            if ck.step == step and ck.generation == generation:
                return ck
        return None

    def _late_progress(self, m: Member, inp: HeartbeatInput) -> None:
        """The last word of a generation a loss broke: a survivor's launcher reports the step
        its worker had reached when the RENDEZVOUS of the recovery arrived. Its heartbeats
        before the loss can lag a step behind the peer that died, so the lost steps of the
        recovery are raised to what it reports."""
        gen = self.generations.get(inp.generation + 1)
        if gen is None or gen.decision_id is not None:
            return
        reached = gen.restore_step + gen.lost_steps
        if inp.step <= reached:
            return
        more = inp.step - reached
        gen.lost_steps += more
        self.job.lost_steps_total += more
        self._metrics.lost_steps.inc(more)
        self._dirty(gen)
        self._touch_job()
        self._log.warning(
            "member %s reached step %d in generation %d: %d more step(s) lost (%d in all)",
            m.member_id,
            inp.step,
            inp.generation,
            more,
            gen.lost_steps,
        )

    def _finish(self, m: Member) -> None:
        """The member's worker ran the job's budget to its end and exited 0; its launcher
        exits too. It leaves without a loss: GONE, keeping its rank as the mark of a finished
        member (a lost one has none). When every member of the generation has finished, the
        job is finished: nothing re-forms, and a resize in flight ends."""
        transition_member(m, MemberState.GONE)
        self._supersede(m)
        self._dirty(m)
        self._log.info(
            "member %s finished at step %d in generation %d",
            m.member_id,
            m.step,
            m.reported_generation,
        )
        if self.current_members():
            return
        self._log.info(
            "job finished at step %d in generation %d", self.finished_step(), self.job.generation
        )
        r = self.active_resize()
        if r is None:
            return
        message = f"the job finished at step {self.finished_step()}"
        if r.phase in (ResizePhase.WAITING_FOR_MEMBERS, ResizePhase.CHECKPOINTING):
            self._abort(r, message, resume=False)
        elif r.phase == ResizePhase.RENDEZVOUS:
            self._maybe_complete(r)
            if not r.phase.final:
                transition_resize(r, ResizePhase.FAILED, at=self._clock.now(), message=message)
        else:
            transition_resize(r, ResizePhase.FAILED, at=self._clock.now(), message=message)
        self._dirty(r)

    def finished_members(self) -> list[Member]:
        """Members that finished the job in the current generation (GONE with a rank)."""
        return [
            m for m in self.members.values() if m.state == MemberState.GONE and m.rank is not None
        ]

    def finished(self) -> bool:
        return bool(self.finished_members()) and not self.current_members()

    def finished_step(self) -> int:
        return max((m.step for m in self.finished_members()), default=0) or self.last_good_step()

    # --- Ack --------------------------------------------------------------------

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
        d.acked = True
        d.ack_ok = inp.ok
        self._dirty(d)
        if not d.superseded:
            handler = {
                DirectiveKind.CHECKPOINT: self._ack_checkpoint,
                DirectiveKind.RENDEZVOUS: self._ack_rendezvous,
                DirectiveKind.DRAIN: self._ack_drain,
                DirectiveKind.STOP: self._ack_drain,
            }.get(d.kind)
            if handler is not None:
                handler(m, d, inp)
        self._advance()
        self._commit()

    def _ack_checkpoint(self, m: Member, d: Directive, inp: AckInput) -> None:
        r = self.active_resize()
        if (
            r is None
            or r.phase != ResizePhase.CHECKPOINTING
            or m.member_id not in r.participants
            or d.checkpoint_step != r.checkpoint_step
        ):
            return
        if not inp.ok:
            self._abort(
                r,
                f"member {m.member_id} could not checkpoint step {r.checkpoint_step}: "
                f"{inp.message or 'no reason given'}",
            )
            return
        if m.rank == 0:
            if inp.checkpoint_step != r.checkpoint_step or not inp.checkpoint_digest:
                self._abort(
                    r,
                    f"rank 0 ({m.member_id}) acked without the checkpoint of step "
                    f"{r.checkpoint_step} (got step {inp.checkpoint_step})",
                )
                return
            r.checkpoint_digest = inp.checkpoint_digest
            r.checkpoint_write_s = inp.checkpoint_write_s
        held = inp.held_at if inp.held_at else self._clock.now()
        r.held_at_latest = max(r.held_at_latest, held)
        if m.member_id not in r.acked:
            r.acked = (*r.acked, m.member_id)
        m.phase = WorkerPhase.HOLDING
        m.step = max(m.step, r.checkpoint_step)
        self._dirty(r)

    def _ack_rendezvous(self, m: Member, d: Directive, inp: AckInput) -> None:
        if inp.ok:
            if m.phase not in (WorkerPhase.RUNNING, WorkerPhase.FAILED):
                m.phase = WorkerPhase.STARTING
            return
        # A worker that cannot start would fail again on the next attempt; the
        # member leaves and may come back through the scale-up path.
        self._lose(
            [m],
            worker_failed=False,
            reason=f"{m.member_id} could not start in generation {d.generation}: {inp.message}",
        )

    def _ack_drain(self, m: Member, d: Directive, inp: AckInput) -> None:
        if m.state != MemberState.GONE:
            transition_member(m, MemberState.GONE)
            m.rank = None
            self._dirty(m)
        r = self.active_resize()
        if r is not None and m.member_id in r.leaving and m.member_id not in r.acked:
            r.acked = (*r.acked, m.member_id)
            self._dirty(r)
        self._log.info("member %s drained and left", m.member_id)

    # --- Resize -----------------------------------------------------------------

    def start_resize(self, inp: ResizeInput) -> Resize:
        existing = self.resizes.get(inp.decision_id)
        if existing is not None:
            return existing
        if inp.target_world_size < 1:
            raise InvalidArgument(f"target_world_size: must be >= 1, got {inp.target_world_size}")
        if not 0 <= inp.deadline_s < float("inf"):
            raise InvalidArgument(f"deadline_s: must be >= 0 and finite, got {inp.deadline_s}")
        # 0: the coordinator's own barrier timeout (DESIGN: heartbeat_timeout is the barrier's).
        deadline_s = inp.deadline_s or self._tuning.heartbeat_timeout_s
        min_size = inp.min_world_size or inp.target_world_size
        if min_size > inp.target_world_size:
            raise InvalidArgument(
                f"min_world_size: must be <= target_world_size ({inp.target_world_size}), "
                f"got {inp.min_world_size}"
            )
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
            deadline_s=deadline_s,
            phase=ResizePhase.WAITING_FOR_MEMBERS,
            from_generation=self.job.generation,
            started_at=now,
            phase_started_at=now,
        )
        self.resizes[r.decision_id] = r
        self._dirty(r)
        self._touch_job()
        self._log.info(
            "resize %d: world %d -> %d (deadline %.1f s)",
            r.decision_id,
            len(self._actives()),
            r.target_world_size,
            r.deadline_s,
        )
        self._advance()
        self._commit()
        return r

    def abort_resize(self, decision_id: int, reason: str) -> ResizePhase:
        r = self.resizes.get(decision_id)
        if r is None:
            raise UnknownResize(f"no resize {decision_id} in job {self.job.job_id}")
        if r.phase in (ResizePhase.WAITING_FOR_MEMBERS, ResizePhase.CHECKPOINTING):
            self._abort(r, f"aborted on request: {reason or 'no reason given'}")
            self._commit()
        # From DRAINING on the old generation cannot resume (leavers are exiting):
        # the resize is carried to completion and its phase is the answer.
        return r.phase

    def _advance(self) -> None:
        """Take every step the active resize can take now."""
        for _ in range(6):
            r = self.active_resize()
            if r is None:
                return
            before = r.phase
            if r.phase == ResizePhase.WAITING_FOR_MEMBERS:
                self._advance_waiting(r, deadline_passed=False)
            elif r.phase == ResizePhase.CHECKPOINTING:
                if set(r.participants) <= set(r.acked):
                    self._after_barrier(r)
            elif r.phase == ResizePhase.DRAINING:
                # Only a resize persisted by a coordinator that drained before the
                # rendezvous is here; this one opens g+1 together with the DRAIN.
                if self._leavers_gone(r):
                    self._open_for_resize(r)
            elif r.phase == ResizePhase.RENDEZVOUS:
                self._maybe_complete(r)
            if r.phase == before:
                return

    def _advance_waiting(self, r: Resize, *, deadline_passed: bool) -> None:
        actives = self._actives()
        standby = self._standby()
        if not actives:
            # No generation runs: the first one (or a restart after every member was lost).
            if len(standby) >= r.target_world_size or (
                deadline_passed and len(standby) >= r.min_world_size
            ):
                self._open_for_resize(r, newcomers=standby[: r.target_world_size])
            elif deadline_passed:
                self._abort(
                    r,
                    f"only {len(standby)} member(s) registered within {r.deadline_s:.1f} s; "
                    f"need at least {r.min_world_size}",
                )
            return
        n = len(actives)
        if r.target_world_size != n and not all(self._running(m) for m in actives):
            # The checkpoint step is chosen from reported steps: wait until every
            # member runs and has reported (after a restart or a recovery).
            if deadline_passed:
                self._abort(
                    r,
                    f"generation {self.job.generation} was not running within "
                    f"{r.deadline_s:.1f} s; no barrier possible",
                )
            return
        if r.target_world_size > n:
            want = r.target_world_size - n
            if len(standby) >= want:
                self._start_barrier(r, actives, standby[:want], ())
            elif deadline_passed:
                if standby and n + len(standby) >= r.min_world_size:
                    self._start_barrier(r, actives, standby, ())
                else:
                    self._abort(
                        r,
                        f"{len(standby)} of {want} newcomer(s) registered within "
                        f"{r.deadline_s:.1f} s; min world size {r.min_world_size}",
                    )
        elif r.target_world_size < n:
            leaving = choose_leaving(actives, n - r.target_world_size, r.leaving_pods)
            self._start_barrier(r, actives, [], leaving)
        else:
            transition_resize(
                r,
                ResizePhase.COMPLETED,
                at=self._clock.now(),
                message=f"already at world size {n}",
            )
            r.to_generation = self.job.generation
            self._dirty(r)

    def _start_barrier(
        self,
        r: Resize,
        participants: Sequence[Member],
        newcomers: Sequence[Member],
        leaving: Sequence[Member],
    ) -> None:
        step = choose_checkpoint_step(
            (m.step for m in participants),
            (m.steps_per_s for m in participants),
            min_lead_steps=self._tuning.checkpoint_min_lead_steps,
            lead_s=self._tuning.checkpoint_lead_s,
        )
        transition_resize(r, ResizePhase.CHECKPOINTING, at=self._clock.now())
        r.participants = tuple(m.member_id for m in participants)
        r.newcomers = tuple(m.member_id for m in newcomers)
        r.leaving = tuple(m.member_id for m in leaving)
        r.checkpoint_step = step
        self._dirty(r)
        for m in participants:
            self._send(
                m,
                DirectiveKind.CHECKPOINT,
                self.job.generation,
                reason=f"decision {r.decision_id}",
                deadline_s=r.deadline_s,
                checkpoint_step=step,
            )
        self._log.info(
            "resize %d: barrier at step %d over %d member(s), %d newcomer(s), %d leaving",
            r.decision_id,
            step,
            len(participants),
            len(newcomers),
            len(leaving),
        )

    def _after_barrier(self, r: Resize) -> None:
        ck = self._checkpoint(r.checkpoint_step, self.job.generation)
        if ck is None:
            ck = Checkpoint(
                job_id=self.job.job_id,
                step=r.checkpoint_step,
                generation=self.job.generation,
                digest=r.checkpoint_digest,
                good=False,
                write_s=r.checkpoint_write_s,
                created_at=self._clock.now(),
            )
            self.checkpoints.append(ck)
        else:
            # Rank 0 already reported it in a heartbeat (and so it is good): add the ack's facts.
            ck.digest = r.checkpoint_digest
            ck.write_s = r.checkpoint_write_s
        self._dirty(ck)
        # A shrink sends DRAIN to the leavers and RENDEZVOUS to the stayers in one unit:
        # g+1 has its own master port and store, so a leaver still holding in g cannot
        # disturb it, and waiting for the leavers' acks only lengthened the pause. The
        # resize completes once every leaver is GONE too (see _maybe_complete).
        for mid in r.leaving:
            m = self.members[mid]
            if m.state == MemberState.ACTIVE:
                transition_member(m, MemberState.DRAINING)
                self._dirty(m)
                self._send(
                    m,
                    DirectiveKind.DRAIN,
                    self.job.generation,
                    reason=f"decision {r.decision_id}: leaving",
                    deadline_s=r.deadline_s,
                )
        self._open_for_resize(r)

    def _drain_out(self, m: Member) -> None:
        """A leaver past its drain deadline is GONE as if it had acked: not a loss, since it
        is in no generation that needs it, so nothing re-forms."""
        if m.state != MemberState.DRAINING:
            return
        self._log.warning("member %s did not confirm DRAIN in time; treated as gone", m.member_id)
        transition_member(m, MemberState.GONE)
        m.rank = None
        self._supersede(m)
        self._dirty(m)

    def _leavers_gone(self, r: Resize) -> bool:
        return all(self.members[i].state == MemberState.GONE for i in r.leaving)

    def _open_for_resize(self, r: Resize, newcomers: Sequence[Member] | None = None) -> None:
        now = self._clock.now()
        first = newcomers is not None
        if first:
            stayers: list[Member] = []
            joining = list(newcomers or [])
            r.newcomers = tuple(m.member_id for m in joining)
            # 0: the newest good checkpoint on disk, periodic ones included.
            restore = 0
        else:
            stayers = [
                self.members[i]
                for i in r.participants
                if i not in r.leaving and self.members[i].state == MemberState.ACTIVE
            ]
            joining = [
                self.members[i] for i in r.newcomers if self.members[i].state == MemberState.STANDBY
            ]
            restore = r.checkpoint_step
            for ck in self.checkpoints:
                if ck.step == r.checkpoint_step and ck.generation == self.job.generation:
                    ck.good = True
                    self._dirty(ck)
        ordered = rank_order(stayers, joining)
        if not ordered:
            transition_resize(
                r, ResizePhase.FAILED, at=now, message="no member left to form a generation"
            )
            self._dirty(r)
            return
        gen = self._open_generation(
            ordered,
            restore,
            reason=f"decision {r.decision_id}",
            decision_id=r.decision_id,
            lost_steps=0,
            deadline_s=r.deadline_s,
        )
        transition_resize(r, ResizePhase.RENDEZVOUS, at=now)
        r.to_generation = gen.generation
        r.rendezvous_sent_at = now
        self._dirty(r)

    def _open_generation(
        self,
        ordered: Sequence[Member],
        restore_step: int,
        *,
        reason: str,
        decision_id: int | None,
        lost_steps: int,
        deadline_s: float,
    ) -> Generation:
        g = self.job.generation + 1
        infos = rendezvous_for(ordered, g, restore_step)
        chosen = {m.member_id for m in ordered}
        for m in self.members.values():
            if m.rank is not None and m.member_id not in chosen:
                m.rank = None
                if m.state == MemberState.ACTIVE:
                    transition_member(m, MemberState.STANDBY)
                self._dirty(m)
        for m, info in zip(ordered, infos, strict=True):
            transition_member(m, MemberState.ACTIVE)
            m.rank = info.rank
            m.first_step_at = None
            m.startup = Breakdown()
            self._supersede(m)
            self._dirty(m)
            self._send(
                m,
                DirectiveKind.RENDEZVOUS,
                g,
                reason=reason,
                deadline_s=deadline_s,
                rendezvous=info,
            )
        gen = Generation(
            job_id=self.job.job_id,
            generation=g,
            world_size=len(ordered),
            member_ids=tuple(m.member_id for m in ordered),
            master_endpoint=infos[0].master_endpoint,
            trainer_endpoints=infos[0].trainer_endpoints,
            restore_step=restore_step,
            created_at=self._clock.now(),
            reason=reason,
            decision_id=decision_id,
            lost_steps=lost_steps,
        )
        self.generations[g] = gen
        self._dirty(gen)
        self.job.generation = g
        self._touch_job()
        self._log.info(
            "generation %d: world %d, master %s, restore step %d (%s)",
            g,
            gen.world_size,
            gen.master_endpoint,
            restore_step,
            reason,
        )
        return gen

    def _maybe_complete(self, r: Resize) -> None:
        gen = self.generations.get(r.to_generation)
        if gen is None or self.job.generation != r.to_generation:
            return
        ms = [self.members[i] for i in gen.member_ids]
        if any(m.first_step_at is None or m.reported_generation != gen.generation for m in ms):
            return
        # The scaler lowers the replicas right after COMPLETED: a leaver still draining
        # would be killed before it acked.
        if not self._leavers_gone(r):
            return
        pause, breakdown = measure_pause(
            held_at_latest=r.held_at_latest,
            checkpoint_write_s=r.checkpoint_write_s,
            rendezvous_sent_at=r.rendezvous_sent_at,
            first_steps_at=[m.first_step_at or 0.0 for m in ms],
            startups=[m.startup for m in ms],
        )
        r.pause_s = pause
        r.breakdown = breakdown
        transition_resize(
            r,
            ResizePhase.COMPLETED,
            at=self._clock.now(),
            message=f"generation {gen.generation} runs with {gen.world_size} member(s)",
        )
        self._dirty(r)
        self._log.info(
            "resize %d completed: generation %d, world %d, pause %.3f s",
            r.decision_id,
            gen.generation,
            gen.world_size,
            pause,
        )

    def _abort(self, r: Resize, message: str, *, resume: bool = True) -> None:
        if r.phase == ResizePhase.CHECKPOINTING:
            for mid in r.participants:
                m = self.members[mid]
                self._supersede(m, [DirectiveKind.CHECKPOINT])
                if resume and m.state == MemberState.ACTIVE:
                    self._send(
                        m,
                        DirectiveKind.RESUME,
                        self.job.generation,
                        reason=f"decision {r.decision_id} aborted",
                        deadline_s=self._tuning.heartbeat_timeout_s,
                    )
        transition_resize(r, ResizePhase.ABORTED, at=self._clock.now(), message=message)
        self._dirty(r)
        self._log.warning("resize %d aborted: %s", r.decision_id, message)

    # --- failures -------------------------------------------------------------

    def _lose(self, members: Sequence[Member], *, worker_failed: bool, reason: str) -> None:
        """Members (or only their workers) are lost: abort or fail what depended on
        them, and re-form the generation from the last good checkpoint if it broke."""
        gen_broken = False
        lost: list[str] = []
        for m in members:
            if m.state == MemberState.GONE:
                continue
            if m.state == MemberState.ACTIVE and m.rank is not None:
                gen_broken = True
            if not (worker_failed and m.state == MemberState.ACTIVE):
                transition_member(m, MemberState.GONE)
                m.rank = None
                self._supersede(m)
            self._dirty(m)
            lost.append(m.member_id)
            self._metrics.members_lost.inc()
            self._log.warning("member %s lost: %s", m.member_id, reason)
        if not lost:
            return
        r = self.active_resize()
        if r is not None:
            if r.phase == ResizePhase.WAITING_FOR_MEMBERS and gen_broken:
                self._abort(r, f"member(s) {', '.join(lost)} lost: {reason}")
            elif r.phase == ResizePhase.CHECKPOINTING and any(
                i in r.participants or i in r.newcomers for i in lost
            ):
                self._abort(
                    r,
                    f"member(s) {', '.join(lost)} lost during the barrier: {reason}",
                    resume=not gen_broken,
                )
            elif r.phase == ResizePhase.DRAINING:
                # The resize re-forms the generation itself, without the lost ones.
                gen_broken = False
            elif r.phase == ResizePhase.RENDEZVOUS and any(
                i in self.generations[r.to_generation].member_ids for i in lost
            ):
                transition_resize(
                    r,
                    ResizePhase.FAILED,
                    at=self._clock.now(),
                    message=f"member(s) {', '.join(lost)} lost while generation "
                    f"{r.to_generation} formed: {reason}",
                )
                self._dirty(r)
                gen_broken = True
        if gen_broken:
            self._recover(reason)

    def _recover(self, reason: str) -> None:
        g = self.job.generation
        reached = max(
            (m.step for m in self.members.values() if m.reported_generation == g), default=0
        )
        survivors = self._actives()
        # Rank 0 reports every checkpoint it writes (periodic ones included), so the newest
        # good one the coordinator knows is the one the survivors restore: named exactly.
        known = self.last_good_step()
        lost_steps = max(0, reached - known)
        if not survivors:
            self._log.error(
                "generation %d lost every member (%s); the next Resize forms a new one", g, reason
            )
            for m in self.members.values():
                # A finished member keeps its rank: that is how a finished job shows.
                if m.rank is not None and m.state != MemberState.GONE:
                    m.rank = None
                    self._dirty(m)
            return
        self._open_generation(
            survivors,
            known,
            reason=f"recovery: {reason}",
            decision_id=None,
            lost_steps=lost_steps,
            deadline_s=self._tuning.heartbeat_timeout_s,
        )
        self.job.lost_steps_total += lost_steps
        self._metrics.lost_steps.inc(lost_steps)
        self._touch_job()
        self._log.warning(
            "unplanned loss: generation %d re-formed with %d member(s) from the checkpoint of "
            "step %d; %d step(s) lost (reached %d)",
            self.job.generation,
            len(survivors),
            known,
            lost_steps,
            reached,
        )

    def tick(self, stalled_s: float = 0.0) -> None:
        """Check heartbeat timeouts and deadlines; called periodically.

        ``stalled_s``: how much later than planned this tick runs (the event loop was
        blocked or the process starved). Nobody could be heard during that time, so every
        heartbeat timeout and deadline moves by it; otherwise a stall longer than
        heartbeat_timeout_s would declare every member lost at once."""
        now, mono = self._clock.now(), self._clock.monotonic()
        if stalled_s > 0:
            self._credit_stall(stalled_s, mono)
        silent = [
            m
            for m in self.members.values()
            if m.state != MemberState.GONE
            and mono - m.last_seen_mono > self._tuning.heartbeat_timeout_s
        ]
        if silent:
            self._lose(
                silent,
                worker_failed=False,
                reason=f"no heartbeat for {self._tuning.heartbeat_timeout_s:.1f} s",
            )
        overdue_drains = [
            self.members[d.member_id]
            for d in self.directives.values()
            if d.pending
            and d.kind == DirectiveKind.DRAIN
            and d.deadline_at is not None
            and now > d.deadline_at
        ]
        for m in overdue_drains:
            self._drain_out(m)
        if overdue_drains:
            # The last leaver gone may complete a resize whose g+1 already runs, before its
            # phase deadline could fail it.
            self._advance()
        r = self.active_resize()
        if r is not None and now >= r.phase_deadline_at:
            self._on_deadline(r)
        overdue = [
            self.members[d.member_id]
            for d in self.directives.values()
            if d.pending and d.deadline_at is not None and now > d.deadline_at
        ]
        if overdue:
            self._lose(overdue, worker_failed=False, reason="a directive was not acknowledged")
        self._advance()
        self._commit()

    def _credit_stall(self, stalled_s: float, mono: float) -> None:
        for m in self.members.values():
            if m.state != MemberState.GONE:
                # Never past now: a heartbeat handled just before this tick is simply recent.
                m.last_seen_mono = min(mono, m.last_seen_mono + stalled_s)
        for d in self.directives.values():
            if d.pending and d.deadline_at is not None:
                d.deadline_at += stalled_s
                self._dirty(d)
        r = self.active_resize()
        if r is not None:
            r.phase_started_at += stalled_s
            self._dirty(r)
        self._log.debug("stall of %.2f s credited to every timeout and deadline", stalled_s)

    def _on_deadline(self, r: Resize) -> None:
        if r.phase == ResizePhase.WAITING_FOR_MEMBERS:
            self._advance_waiting(r, deadline_passed=True)
        elif r.phase == ResizePhase.CHECKPOINTING:
            missing = [i for i in r.participants if i not in r.acked]
            self._abort(
                r,
                f"barrier deadline ({r.deadline_s:.1f} s) passed; no ack of CHECKPOINT "
                f"step {r.checkpoint_step} from {', '.join(missing)}",
            )
        elif r.phase == ResizePhase.DRAINING:
            for mid in r.leaving:
                self._drain_out(self.members[mid])
            self._open_for_resize(r)
        elif r.phase == ResizePhase.RENDEZVOUS:
            # The leavers' DRAIN went out with the RENDEZVOUS, so their deadline is this
            # one: a leaver that never acked must not fail a g+1 that runs.
            for mid in r.leaving:
                self._drain_out(self.members[mid])
            self._maybe_complete(r)
            if r.phase.final:
                return
            gen = self.generations[r.to_generation]
            late = [
                self.members[i] for i in gen.member_ids if self.members[i].first_step_at is None
            ]
            unacked = [
                m
                for m in late
                if any(
                    d.kind == DirectiveKind.RENDEZVOUS
                    and d.generation == gen.generation
                    and d.pending
                    for d in self._pending(m.member_id)
                )
            ]
            transition_resize(
                r,
                ResizePhase.FAILED,
                at=self._clock.now(),
                message=f"generation {gen.generation} not running after {r.deadline_s:.1f} s: "
                f"no first step from {', '.join(m.member_id for m in late)}",
            )
            self._dirty(r)
            if unacked:
                self._lose(unacked, worker_failed=False, reason="RENDEZVOUS not acknowledged")

    # --- restart --------------------------------------------------------------

    def recover_after_restart(self) -> None:
        """Apply the restart rules: give every member a fresh sync timeout to come
        back, abort a resize that had not passed its barrier, carry on one that had."""
        now, mono = self._clock.now(), self._clock.monotonic()
        for m in self.members.values():
            m.last_seen_mono = mono
            m.phase = WorkerPhase.UNSPECIFIED
        # Deadlines kept running while nobody could ack: the downtime is not the
        # members' fault, so each pending directive gets a full timeout again.
        for d in self.directives.values():
            if d.pending and d.deadline_at is not None:
                d.deadline_at = max(d.deadline_at, now + self._tuning.heartbeat_timeout_s)
                self._dirty(d)
        r = self.active_resize()
        if r is not None and r.phase in (
            ResizePhase.WAITING_FOR_MEMBERS,
            ResizePhase.CHECKPOINTING,
        ):
            self._abort(r, "the coordinator restarted before the barrier completed")
        elif r is not None:
            r.phase_started_at = max(r.phase_started_at, now)
            self._dirty(r)
            self._log.info(
                "resize %d: carried on after restart in phase %s", r.decision_id, r.phase.name
            )
        self._commit()

    # --- views ----------------------------------------------------------------

    def resize_view(self, decision_id: int) -> ResizeView:
        r = self.resizes.get(decision_id)
        if r is None:
            raise UnknownResize(f"no resize {decision_id} in job {self.job.job_id}")
        return self._resize_view(r)

    def _resize_view(self, r: Resize) -> ResizeView:
        g = r.to_generation or r.from_generation
        gen = self.generations.get(g)
        lost = gen.lost_steps if gen is not None and gen.decision_id != r.decision_id else 0
        return ResizeView(
            decision_id=r.decision_id,
            phase=r.phase,
            generation=g,
            world_size=gen.world_size if gen is not None else 0,
            checkpoint_step=r.checkpoint_step,
            pause_s=r.pause_s,
            breakdown=r.breakdown,
            lost_steps=lost,
            message=r.message,
        )

    def status(self) -> JobView:
        current = self.current_members()
        running = [m for m in current if m.reported_generation == self.job.generation]
        finished = {m.member_id for m in self.finished_members()}
        # A finished member is listed (GONE, phase IDLE, its rank and final step): the
        # convention that says the job ended rather than lost its members.
        members = tuple(
            MemberView(
                member_id=m.member_id,
                pod_name=m.pod_name,
                pod_index=m.pod_index,
                pod_uid=m.pod_uid,
                host=m.host,
                state=m.state,
                rank=m.rank or 0,
                phase=WorkerPhase.IDLE if m.member_id in finished else m.phase,
                step=m.step,
                samples_per_s=0.0 if m.member_id in finished else m.samples_per_s,
                last_heartbeat_at=m.last_heartbeat_at,
            )
            for m in sorted(self.members.values(), key=lambda m: (m.pod_index, m.registered_at))
            if m.state != MemberState.GONE or m.member_id in finished
        )
        lead = min(running, key=lambda m: m.step) if running else None
        done = lead is None and self.finished()
        if done:
            lead = max(self.finished_members(), key=lambda m: m.step)
        r = self.active_resize()
        return JobView(
            job_id=self.job.job_id,
            generation=self.job.generation,
            world_size=len(current),
            members=members,
            # After a restart a finished member's step is forgotten; its final checkpoint is not.
            step=self.finished_step() if done else (lead.step if lead else 0),
            epoch=lead.epoch if lead else 0,
            samples_consumed=lead.samples_consumed if lead else 0,
            samples_per_s=sum(m.samples_per_s for m in running),
            last_checkpoint_step=self.last_good_step(),
            active_resize=self._resize_view(r) if r is not None else None,
            lost_steps_total=self.job.lost_steps_total,
            finished=done,
        )


class Coordinator:
    """Every job's runtime, the indexes from member and decision ids to jobs, and
    the periodic tick."""

    def __init__(
        self,
        store: CoordinatorStore,
        clock: Clock,
        tuning: Tuning,
        metrics: CoordinatorMetrics | None = None,
    ) -> None:
        self._store = store
        self._clock = clock
        self.tuning = tuning
        self.metrics = metrics or CoordinatorMetrics()
        self.jobs: dict[str, JobRuntime] = {}
        self._member_job: dict[str, str] = {}
        self._decision_job: dict[int, str] = {}

    def load(self) -> None:
        """Reload every job from the store and apply the restart rules."""
        for snap in self._store.load_all():
            self._install(
                JobRuntime.from_snapshot(snap, self._store, self._clock, self.tuning, self.metrics)
            )
        for rt in self.jobs.values():
            rt.recover_after_restart()
        logger.info("loaded %d job(s) from the store", len(self.jobs))

    def _install(self, rt: JobRuntime) -> None:
        self.jobs[rt.job.job_id] = rt
        for mid in rt.members:
            self._member_job[mid] = rt.job.job_id
        for did in rt.resizes:
            self._decision_job[did] = rt.job.job_id

    def _reload(self, job_id: str) -> JobRuntime | None:
        old = self.jobs.pop(job_id, None)
        for snap in self._store.load_all():
            if snap.job.job_id == job_id:
                rt = JobRuntime.from_snapshot(
                    snap, self._store, self._clock, self.tuning, self.metrics
                )
                rt.recover_after_restart()
                self._install(rt)
                if old is not None:
                    old.notifier.notify()  # ends streams bound to the discarded runtime
                return rt
        if old is not None:
            old.notifier.notify()
        return None

    def job(self, job_id: str, *, create: bool = False) -> JobRuntime:
        rt = self.jobs.get(job_id)
        if rt is not None and rt.broken:
            rt = self._reload(job_id)
        if rt is None:
            if not create:
                raise UnknownJob(f"job {job_id!r} is not known to the coordinator")
            _validate_job_id(job_id)
            rt = JobRuntime(
                JobRecord(job_id=job_id), self._store, self._clock, self.tuning, self.metrics
            )
            self.jobs[job_id] = rt
        return rt

    def job_of_member(self, member_id: str) -> JobRuntime:
        job_id = self._member_job.get(member_id)
        if job_id is None:
            raise UnknownMember(f"member {member_id!r} is not known; register first")
        return self.job(job_id)

    def register(self, inp: RegisterInput) -> RegisterResult:
        for name, value in (
            ("pod_name", inp.pod_name),
            ("host", inp.host),
            ("launcher_id", inp.launcher_id),
        ):
            if not value:
                raise InvalidArgument(f"{name}: required, got ''")
        if not 0 < inp.free_port <= 65535:
            raise InvalidArgument(f"free_port: must be in 1..65535, got {inp.free_port}")
        rt = self.job(inp.job_id, create=True)
        res = rt.register(inp)
        self._member_job[res.member_id] = inp.job_id
        return res

    def heartbeat(self, inp: HeartbeatInput) -> int:
        return self.job_of_member(inp.member_id).heartbeat(inp)

    def ack(self, inp: AckInput) -> None:
        self.job_of_member(inp.member_id).ack(inp)

    def start_resize(self, inp: ResizeInput) -> JobRuntime:
        owner = self._decision_job.get(inp.decision_id)
        if owner is not None and owner != inp.job_id:
            raise InvalidArgument(
                f"decision_id {inp.decision_id} belongs to job {owner}, not {inp.job_id}"
            )
        rt = self.job(inp.job_id, create=True)
        rt.start_resize(inp)
        self._decision_job[inp.decision_id] = inp.job_id
        return rt

    def abort_resize(self, decision_id: int, job_id: str, reason: str) -> ResizePhase:
        owner = self._decision_job.get(decision_id)
        if owner is None or (job_id and owner != job_id):
            raise UnknownResize(f"no resize {decision_id} for job {job_id!r}")
        return self.job(owner).abort_resize(decision_id, reason)

    def tick(self, stalled_s: float = 0.0) -> None:
        if stalled_s > 0:
            logger.warning(
                "the coordinator stalled %.2f s: heartbeat timeouts and deadlines of %d job(s) "
                "moved by as much",
                stalled_s,
                len(self.jobs),
            )
        for job_id in list(self.jobs):
            try:
                self.job(job_id).tick(stalled_s)
            except Exception:
                # One job's failure (a store outage) must not stop the others' checks.
                logger.exception("tick of job %s failed", job_id)

    async def run(self) -> None:
        """Tick until cancelled, measuring how late each tick is.

        A tick more than one interval late means the loop did not run (blocked, or the
        process starved on a loaded machine); the lateness is handed to the tick, which
        does not count it against anyone. Shorter jitter is ignored."""
        interval = self.tuning.tick_interval_s
        last = self._clock.monotonic()
        while True:
            await self._clock.sleep(interval)
            now = self._clock.monotonic()
            late = now - last - interval
            self.tick(late if late > interval else 0.0)
            last = self._clock.monotonic()


def _validate_job_id(job_id: str) -> None:
    ns, sep, name = job_id.partition("/")
    if not sep or not ns or not name or "/" in name or len(job_id) > 253:
        raise InvalidArgument(f"job_id: expected 'namespace/name', got {job_id!r}")
