"""The coordinator's store in SQL (SQLite or PostgreSQL).

Repository functions take the session; :class:`SqlStore` opens one transaction
per unit at the edge, through :func:`tide.services.store.db.unit_of_work` (retried on
dropped connections and lock timeouts). ORM rows never leave this module.

Versioned rows (job, member, resize) are compare-and-set: a row whose stored
version differs from the one the coordinator last wrote raises Conflict.

With leader election (docs/coordinator.md, "Standby replicas") every unit is
fenced: it first reads the lease row and is refused (StaleLeader) unless this
replica still holds the lease at the epoch it was elected with, so a leader
paused past its lease writes nothing after a standby took over.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from tide.base.errors import Conflict
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
)
from tide.services.coordinator.store import JobSnapshot, Unit
from tide.services.store.db import unit_of_work, utc_from_epoch
from tide.services.store.leases import Fence, StaleLeader, check_fence
from tide.services.store.models.coordinator import (
    CoordCheckpoint,
    CoordDirective,
    CoordGeneration,
    CoordJob,
    CoordMember,
    CoordResize,
)


def _dt(seconds: float) -> datetime:
    return utc_from_epoch(seconds)


def _opt_dt(seconds: float | None) -> datetime | None:
    return utc_from_epoch(seconds) if seconds else None


def _secs(value: datetime | None) -> float:
    return value.timestamp() if value is not None else 0.0


def _cas(kind: str, key: object, row: Any, given: int) -> None:
    stored = 0 if row is None else int(row.version)
    if stored != given:
        raise Conflict(
            f"{kind} {key} was changed by another writer (version {stored}, expected {given})"
        )


def _set(row: Any, values: dict[str, Any]) -> None:
    for k, v in values.items():
        setattr(row, k, v)


# --- writers ------------------------------------------------------------------


def save_job(session: Session, job: JobRecord, now: float) -> CoordJob:
    row = session.get(CoordJob, job.job_id)
    _cas("job", job.job_id, row, job.version)
    if row is None:
        row = CoordJob(job_id=job.job_id)
        session.add(row)
    _set(
        row,
        {
            "generation": job.generation,
            "directive_seq": job.directive_seq,
            "lost_steps_total": job.lost_steps_total,
            "failure": job.failure or None,
            "failed_at": _opt_dt(job.failed_at),
            "updated_at": _dt(now),
        },
    )
    return row


def save_member(session: Session, m: Member) -> CoordMember:
    row = session.get(CoordMember, m.member_id)
    _cas("member", m.member_id, row, m.version)
    if row is None:
        row = CoordMember(member_id=m.member_id)
        session.add(row)
    _set(
        row,
        {
            "job_id": m.job_id,
            "pod_name": m.pod_name,
            "pod_index": m.pod_index,
            "pod_uid": m.pod_uid,
            "host": m.host,
            "launcher_id": m.launcher_id,
            "free_port": m.free_port,
            "state": m.state.name,
            "rank": m.rank,
            "registered_at": _dt(m.registered_at),
        },
    )
    return row


def save_resize(session: Session, r: Resize) -> CoordResize:
    row = session.get(CoordResize, r.decision_id)
    _cas("resize", r.decision_id, row, r.version)
    if row is None:
        row = CoordResize(decision_id=r.decision_id)
        session.add(row)
    b = r.breakdown
    _set(
        row,
        {
            "job_id": r.job_id,
            "target_world_size": r.target_world_size,
            "min_world_size": r.min_world_size,
            "leaving_pods": list(r.leaving_pods),
            "deadline_s": r.deadline_s,
            "phase": r.phase.name,
            "from_generation": r.from_generation,
            "to_generation": r.to_generation,
            "checkpoint_step": r.checkpoint_step,
            "participants": list(r.participants),
            "newcomers": list(r.newcomers),
            "leaving": list(r.leaving),
            "acked": list(r.acked),
            "started_at": _dt(r.started_at),
            "phase_started_at": _dt(r.phase_started_at),
            "held_at_latest": _opt_dt(r.held_at_latest),
            "rendezvous_sent_at": _opt_dt(r.rendezvous_sent_at),
            "finished_at": _opt_dt(r.finished_at),
            "checkpoint_digest": r.checkpoint_digest,
            "checkpoint_write_s": r.checkpoint_write_s,
            "pause_s": r.pause_s,
            "breakdown": {
                "barrier_s": b.barrier_s,
                "checkpoint_write_s": b.checkpoint_write_s,
                "worker_restart_s": b.worker_restart_s,
                "group_init_s": b.group_init_s,
                "restore_s": b.restore_s,
            },
            "message": r.message,
        },
    )
    return row


def save_generation(session: Session, g: Generation) -> None:
    row = session.get(CoordGeneration, (g.job_id, g.generation))
    if row is None:
        row = CoordGeneration(job_id=g.job_id, generation=g.generation)
        session.add(row)
    _set(
        row,
        {
            "world_size": g.world_size,
            "member_ids": list(g.member_ids),
            "master_endpoint": g.master_endpoint,
            "trainer_endpoints": list(g.trainer_endpoints),
            "restore_step": g.restore_step,
            "created_at": _dt(g.created_at),
            "reason": g.reason,
            "decision_id": g.decision_id,
            "lost_steps": g.lost_steps,
            "reached_step": g.reached_step,
            "restored_step": g.restored_step,
        },
    )


def save_checkpoint(session: Session, c: Checkpoint) -> None:
    row = session.get(CoordCheckpoint, (c.job_id, c.step, c.generation))
    if row is None:
        row = CoordCheckpoint(job_id=c.job_id, step=c.step, generation=c.generation)
        session.add(row)
    _set(
        row,
        {
            "digest": c.digest,
            "good": c.good,
            "write_s": c.write_s,
            "created_at": _dt(c.created_at),
        },
    )


def save_directive(session: Session, d: Directive) -> None:
    row = session.get(CoordDirective, (d.job_id, d.directive_id))
    if row is None:
        row = CoordDirective(job_id=d.job_id, directive_id=d.directive_id)
        session.add(row)
    rv = d.rendezvous
    _set(
        row,
        {
            "seq": d.seq,
            "member_id": d.member_id,
            "kind": d.kind.name,
            "generation": d.generation,
            "checkpoint_step": d.checkpoint_step,
            "rendezvous": None
            if rv is None
            else {
                "generation": rv.generation,
                "world_size": rv.world_size,
                "rank": rv.rank,
                "master_endpoint": rv.master_endpoint,
                "trainer_endpoints": list(rv.trainer_endpoints),
                "restore_step": rv.restore_step,
                "prepared": rv.prepared,
                "start_delay_s": rv.start_delay_s,
            },
            "deadline_at": _opt_dt(d.deadline_at),
            "reason": d.reason,
            "acked": d.acked,
            "ack_ok": d.ack_ok,
            "superseded": d.superseded,
            "created_at": _dt(d.created_at),
        },
    )


def save_unit(session: Session, unit: Unit, now: float) -> dict[int, int]:
    """Write ``unit``; returns the new version of each versioned object, by id()."""
    versioned: list[tuple[object, Any]] = []
    if unit.job is not None:
        versioned.append((unit.job, save_job(session, unit.job, now)))
    # Members before directives and resizes only for readability: the ORM orders
    # the INSERTs by foreign key anyway (the job row first).
    for m in unit.members:
        versioned.append((m, save_member(session, m)))
    for r in unit.resizes:
        versioned.append((r, save_resize(session, r)))
    for g in unit.generations:
        save_generation(session, g)
    for c in unit.checkpoints:
        save_checkpoint(session, c)
    for d in unit.directives:
        save_directive(session, d)
    session.flush()
    return {id(obj): int(row.version) for obj, row in versioned}


# --- readers ------------------------------------------------------------------


def _member(row: CoordMember) -> Member:
    return Member(
        member_id=row.member_id,
        job_id=row.job_id,
        pod_name=row.pod_name,
        pod_index=row.pod_index,
        pod_uid=row.pod_uid,
        host=row.host,
        launcher_id=row.launcher_id,
        free_port=row.free_port,
        state=MemberState[row.state],
        registered_at=_secs(row.registered_at),
        rank=row.rank,
        version=row.version,
    )


#: What a coordinator before the one-step shrink stored while its leavers drained after
#: the barrier and before g+1 opened. Loaded as CHECKPOINTING, such a resize meets the
#: restart rule of a resize whose generation had not opened: it is aborted with a
#: message, the stayers resume in g, and leavers already gone are lost and the job
#: re-forms without them from the barrier's checkpoint. Marking it FAILED at load
#: (as before) left the stayers holding at the barrier with nothing to release them.
_LEGACY_DRAINING = "DRAINING"


def _phase(name: str) -> ResizePhase:
    return ResizePhase.CHECKPOINTING if name == _LEGACY_DRAINING else ResizePhase[name]


def _resize(row: CoordResize) -> Resize:
    b = row.breakdown or {}
    return Resize(
        decision_id=row.decision_id,
        job_id=row.job_id,
        target_world_size=row.target_world_size,
        min_world_size=row.min_world_size,
        leaving_pods=tuple(row.leaving_pods),
        deadline_s=row.deadline_s,
        phase=_phase(row.phase),
        from_generation=row.from_generation,
        started_at=_secs(row.started_at),
        phase_started_at=_secs(row.phase_started_at),
        to_generation=row.to_generation,
        checkpoint_step=row.checkpoint_step,
        participants=tuple(row.participants),
        newcomers=tuple(row.newcomers),
        leaving=tuple(row.leaving),
        acked=tuple(row.acked),
        held_at_latest=_secs(row.held_at_latest),
        checkpoint_digest=row.checkpoint_digest,
        checkpoint_write_s=row.checkpoint_write_s,
        rendezvous_sent_at=_secs(row.rendezvous_sent_at),
        finished_at=_secs(row.finished_at),
        pause_s=row.pause_s,
        breakdown=Breakdown(**{k: float(v) for k, v in b.items()}),
        message=row.message,
        version=row.version,
    )


def _directive(row: CoordDirective) -> Directive:
    rv = row.rendezvous
    return Directive(
        job_id=row.job_id,
        directive_id=row.directive_id,
        member_id=row.member_id,
        kind=DirectiveKind[row.kind],
        generation=row.generation,
        created_at=_secs(row.created_at),
        seq=row.seq,
        checkpoint_step=row.checkpoint_step,
        rendezvous=None
        if rv is None
        else RendezvousInfo(
            generation=int(rv["generation"]),
            world_size=int(rv["world_size"]),
            rank=int(rv["rank"]),
            master_endpoint=str(rv["master_endpoint"]),
            trainer_endpoints=tuple(rv["trainer_endpoints"]),
            restore_step=int(rv["restore_step"]),
            # Rows written before overlap mode have no such key.
            prepared=bool(rv.get("prepared", False)),
            # ...nor rows written before restart backoff.
            start_delay_s=float(rv.get("start_delay_s", 0.0)),
        ),
        deadline_at=_secs(row.deadline_at) or None,
        reason=row.reason,
        acked=row.acked,
        ack_ok=row.ack_ok,
        superseded=row.superseded,
    )


def load_job(session: Session, job_id: str) -> JobSnapshot | None:
    job = session.get(CoordJob, job_id)
    if job is None:
        return None
    members = session.scalars(select(CoordMember).where(CoordMember.job_id == job_id)).all()
    gens = session.scalars(
        select(CoordGeneration)
        .where(CoordGeneration.job_id == job_id)
        .order_by(CoordGeneration.generation)
    ).all()
    cks = session.scalars(
        select(CoordCheckpoint)
        .where(CoordCheckpoint.job_id == job_id)
        .order_by(CoordCheckpoint.step, CoordCheckpoint.generation)
    ).all()
    resizes = session.scalars(
        select(CoordResize).where(CoordResize.job_id == job_id).order_by(CoordResize.started_at)
    ).all()
    directives = session.scalars(
        select(CoordDirective).where(CoordDirective.job_id == job_id).order_by(CoordDirective.seq)
    ).all()
    return JobSnapshot(
        job=JobRecord(
            job_id=job.job_id,
            generation=job.generation,
            directive_seq=job.directive_seq,
            lost_steps_total=job.lost_steps_total,
            failure=job.failure or "",
            failed_at=_secs(job.failed_at) if job.failed_at is not None else None,
            version=job.version,
        ),
        members=[_member(r) for r in members],
        generations=[
            Generation(
                job_id=r.job_id,
                generation=r.generation,
                world_size=r.world_size,
                member_ids=tuple(r.member_ids),
                master_endpoint=r.master_endpoint,
                trainer_endpoints=tuple(r.trainer_endpoints),
                restore_step=r.restore_step,
                created_at=_secs(r.created_at),
                reason=r.reason,
                decision_id=r.decision_id,
                lost_steps=r.lost_steps,
                reached_step=r.reached_step,
                restored_step=r.restored_step,
            )
            for r in gens
        ],
        checkpoints=[
            Checkpoint(
                job_id=r.job_id,
                step=r.step,
                generation=r.generation,
                digest=r.digest,
                good=r.good,
                write_s=r.write_s,
                created_at=_secs(r.created_at),
            )
            for r in cks
        ],
        resizes=[_resize(r) for r in resizes],
        directives=[_directive(r) for r in directives],
    )


def load_all(session: Session) -> list[JobSnapshot]:
    ids = session.scalars(select(CoordJob.job_id).order_by(CoordJob.job_id)).all()
    return [snap for snap in (load_job(session, i) for i in ids) if snap is not None]


class SqlStore:
    """CoordinatorStore over a session factory (see tide.services.store.db)."""

    def __init__(
        self,
        factory: sessionmaker[Session],
        now: Callable[[], float],
        *,
        on_fenced: Callable[[str], None] | None = None,
    ) -> None:
        self._factory = factory
        self._now = now
        #: The lease every write is checked against; None without leader election.
        self.fence: Fence | None = None
        #: Called with the reason when a write is fenced off: the replica must stop.
        self._on_fenced = on_fenced

    def save(self, unit: Unit) -> None:
        now = self._now()
        fence = self.fence

        def work(s: Session) -> dict[int, int]:
            if fence is not None:
                check_fence(s, fence)
            return save_unit(s, unit, now)

        try:
            versions = unit_of_work(
                self._factory,
                work,
                what=f"coordinator unit of job {unit.job.job_id if unit.job else '?'}",
            )
        except StaleLeader as exc:
            if self._on_fenced is not None:
                self._on_fenced(str(exc))
            raise
        # Only after the commit: a retried or failed unit leaves memory untouched.
        objs: list[JobRecord | Member | Resize] = [*unit.members, *unit.resizes]
        if unit.job is not None:
            objs.append(unit.job)
        for obj in objs:
            obj.version = versions[id(obj)]

    def load_all(self) -> list[JobSnapshot]:
        return unit_of_work(self._factory, load_all, write=False, what="load coordinator state")
