"""Jobs: create and update, pause, observed state, and the fencing epoch.

Fencing: a scaler takes a job with :func:`acquire_job_ownership`, which bumps
the job's ``owner_epoch``; every decision write passes that epoch and runs
``UPDATE jobs ... WHERE owner_epoch = :mine`` in its own transaction before
writing (:func:`check_epoch`), so a scaler that lost the job fails with
:class:`StaleEpoch` and writes nothing. On PostgreSQL that UPDATE also locks
the job's row, which serialises all decision writes of one job; on SQLite
BEGIN IMMEDIATE does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, select, tuple_, update
from sqlalchemy.orm import Session

from tide.base.errors import InvalidArgument
from tide.services.scaler.errors import JobNotFound, StaleEpoch
from tide.services.scaler.store.records import JobRecord
from tide.services.scaler.store.rows import (
    JOBS,
    aware,
    execute,
    flush,
    job_record,
    json_copy,
    validate_job_id,
)
from tide.services.store.models.scaler import Job

logger = logging.getLogger(__name__)


def upsert_job(
    session: Session,
    job_id: str,
    *,
    min_replicas: int,
    max_replicas: int,
    now: datetime,
    initial_replicas: int | None = None,
    gpus_per_replica: int | None = None,
    policy_overrides: Mapping[str, Any] | None = None,
) -> JobRecord:
    """Create a job, or update its bounds and overrides.

    ``policy_overrides`` merges into the stored overrides; a key mapped to
    None removes that override. ``initial_replicas`` (default: min_replicas)
    and the default of one GPU per replica apply only to a new job; an
    existing job keeps its current replicas even outside new bounds (the
    scaler resizes it through a decision).
    """
    validate_job_id(job_id)
    aware("now", now)
    if min_replicas < 1:
        raise InvalidArgument(f"min_replicas must be >= 1, got {min_replicas}")
    if max_replicas < min_replicas:
        raise InvalidArgument(
            f"max_replicas must be >= min_replicas, got {max_replicas} < {min_replicas}"
        )
    if gpus_per_replica is not None and gpus_per_replica < 1:
        raise InvalidArgument(f"gpus_per_replica must be >= 1, got {gpus_per_replica}")
    row = session.get(Job, job_id)
    if row is None:
        current = min_replicas if initial_replicas is None else initial_replicas
        if not (min_replicas <= current <= max_replicas):
            raise InvalidArgument(
                f"initial_replicas must be within [{min_replicas}, {max_replicas}], got {current}"
            )
        row = Job(
            job_id=job_id,
            min_replicas=min_replicas,
            max_replicas=max_replicas,
            current_replicas=current,
            gpus_per_replica=gpus_per_replica or 1,
            policy_overrides=json_copy(
                _merge_overrides({}, policy_overrides), f"policy overrides of job {job_id}"
            ),
            autoscaling_paused=False,
            pause_reason="",
            paused_at=None,
            generation=0,
            last_resize_ended_at=None,
            owner_epoch=0,
            owner_id="",
            created_at=now,
            updated_at=now,
        )
        session.add(row)
        logger.info("job %s created with %d replicas", job_id, current, extra={"job_id": job_id})
    else:
        row.min_replicas = min_replicas
        row.max_replicas = max_replicas
        if gpus_per_replica is not None:
            row.gpus_per_replica = gpus_per_replica
        if policy_overrides:
            row.policy_overrides = json_copy(
                _merge_overrides(row.policy_overrides, policy_overrides),
                f"policy overrides of job {job_id}",
            )
        row.updated_at = now
    flush(session, f"upsert job {job_id}")
    return job_record(row)


def _merge_overrides(old: Mapping[str, Any], new: Mapping[str, Any] | None) -> dict[str, Any]:
    merged = dict(old)
    for key, value in (new or {}).items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged


def _get_job_row(session: Session, job_id: str) -> Job:
    row = session.get(Job, job_id)
    if row is None:
        raise JobNotFound(f"job {job_id!r} not found")
    return row


def get_job(session: Session, job_id: str) -> JobRecord:
    return job_record(_get_job_row(session, job_id))


def list_jobs(session: Session) -> list[JobRecord]:
    return [job_record(r) for r in session.scalars(select(Job).order_by(Job.job_id))]


def set_paused(
    session: Session, job_id: str, *, paused: bool, reason: str, now: datetime
) -> JobRecord:
    """Pause or resume autoscaling of a job; pausing needs a reason, resuming clears it."""
    aware("now", now)
    if paused and not reason.strip():
        raise InvalidArgument(f"pausing job {job_id}: reason must not be empty")
    row = _get_job_row(session, job_id)
    if paused:
        # Pausing a paused job updates the reason but keeps when it began.
        row.paused_at = row.paused_at if row.autoscaling_paused else now
        row.pause_reason = reason
    else:
        row.paused_at = None
        row.pause_reason = ""
    row.autoscaling_paused = paused
    row.updated_at = now
    flush(session, f"set paused={paused} on job {job_id}")
    # Logged by the caller once the unit commits: a refused write paused nothing.
    return job_record(row)


def set_job_observed(
    session: Session,
    job_id: str,
    *,
    now: datetime,
    current_replicas: int | None = None,
    generation: int | None = None,
) -> JobRecord:
    """Record what the coordinator or actuator observed (replicas, generation), unfenced.

    A generation only moves forward: an older report arriving late is ignored.
    """
    aware("now", now)
    row = _get_job_row(session, job_id)
    if current_replicas is not None:
        if current_replicas < 0:
            raise InvalidArgument(f"current_replicas must be >= 0, got {current_replicas}")
        row.current_replicas = current_replicas
    if generation is not None and generation > row.generation:
        row.generation = generation
    row.updated_at = now
    flush(session, f"record observed state of job {job_id}")
    return job_record(row)


def acquire_job_ownership(session: Session, job_id: str, owner_id: str, *, now: datetime) -> int:
    """Make ``owner_id`` the one scaler acting on the job; returns the new epoch.

    The epoch always increases, also when the same owner re-acquires (after a
    restart its in-flight writes from before must not land).
    """
    aware("now", now)
    if not owner_id:
        raise InvalidArgument("owner_id must not be empty")
    table = JOBS
    stmt = (
        update(table)
        .where(table.c.job_id == job_id)
        .values(
            owner_epoch=table.c.owner_epoch + 1,
            owner_id=owner_id,
            updated_at=now,
            version=table.c.version + 1,
        )
    )
    if execute(session, stmt) != 1:
        raise JobNotFound(f"job {job_id!r} not found")
    epoch = session.scalar(select(table.c.owner_epoch).where(table.c.job_id == job_id))
    assert epoch is not None
    # The ORM identity map may hold the job with the old epoch; drop it.
    cached = session.get(Job, job_id, populate_existing=True)
    assert cached is not None
    logger.info(
        "scaler %s owns job %s at epoch %d", owner_id, job_id, epoch, extra={"job_id": job_id}
    )
    return int(epoch)


def acquire_jobs_ownership(
    session: Session, job_ids: Sequence[str], owner_id: str, *, now: datetime
) -> dict[str, int]:
    """:func:`acquire_job_ownership` for many jobs in two statements (a restarted scaler
    takes its jobs in batches, not one transaction each); returns each found job's new
    epoch. Jobs that do not exist are absent from the answer."""
    aware("now", now)
    if not owner_id:
        raise InvalidArgument("owner_id must not be empty")
    ids = sorted(set(job_ids))
    if not ids:
        return {}
    table = JOBS
    # Sorted ids: two scalers taking overlapping batches lock rows in the same order.
    execute(
        session,
        update(table)
        .where(table.c.job_id.in_(ids))
        .values(
            owner_epoch=table.c.owner_epoch + 1,
            owner_id=owner_id,
            updated_at=now,
            version=table.c.version + 1,
        ),
    )
    epochs = {
        str(r.job_id): int(r.owner_epoch)
        for r in session.execute(
            select(table.c.job_id, table.c.owner_epoch).where(table.c.job_id.in_(ids))
        )
    }
    # The ORM identity map may hold some of these jobs with their old epochs.
    session.expire_all()
    logger.info("scaler %s owns %d job(s) (batch of %d)", owner_id, len(epochs), len(ids))
    return epochs


def check_epoch(session: Session, job_id: str, epoch: int) -> None:
    """The fencing check, in the caller's transaction; locks the job row on PostgreSQL."""
    table = JOBS
    stmt = (
        update(table)
        .where(table.c.job_id == job_id, table.c.owner_epoch == epoch)
        .values(owner_epoch=table.c.owner_epoch)
    )
    if execute(session, stmt) == 1:
        return
    row = session.execute(
        select(table.c.owner_epoch, table.c.owner_id).where(table.c.job_id == job_id)
    ).one_or_none()
    if row is None:
        raise JobNotFound(f"job {job_id!r} not found")
    raise StaleEpoch(
        f"job {job_id}: epoch {epoch} is stale, owned by {row.owner_id!r} at epoch {row.owner_epoch}"
    )


def check_epochs(session: Session, epochs: Mapping[str, int]) -> dict[str, StaleEpoch]:
    """:func:`check_epoch` for many jobs in one UPDATE (one round trip, however many
    jobs: a batch of 800 creates spent most of its second in one UPDATE each on
    PostgreSQL); returns each refused job's error. Locks the jobs' rows as
    :func:`check_epoch` does; a job not found raises JobNotFound."""
    refused, unsure = _check_epochs(session, epochs, skip_locked=False)
    for job_id in unsure:
        # Not found (JobNotFound), or moved back between the statements: the single
        # check decides, in check_epoch's words.
        try:
            check_epoch(session, job_id, epochs[job_id])
        except StaleEpoch as exc:
            refused[job_id] = exc
    return refused


def check_epochs_unless_locked(
    session: Session, epochs: Mapping[str, int]
) -> tuple[dict[str, StaleEpoch], set[str]]:
    """:func:`check_epochs` that waits for no job row another transaction holds: returns
    the refused jobs' errors and the jobs it did not check, those locked by another
    transaction on PostgreSQL or not found (a job the single check must decide). A
    batch of transitions writes those alone: one stuck transaction holding one job's
    row would otherwise hold every decision of the batch, up to ``lock_timeout_s``
    and again at each of the unit of work's attempts. On SQLite the transaction's
    BEGIN IMMEDIATE already holds the whole database."""
    refused, unsure = _check_epochs(session, epochs, skip_locked=True)
    return refused, set(unsure)


def _check_epochs(
    session: Session, epochs: Mapping[str, int], *, skip_locked: bool
) -> tuple[dict[str, StaleEpoch], list[str]]:
    """The refused jobs' errors, and the jobs (in order) not matched at their epoch whose owner
    read holds that epoch still (or that are not found): locked (with ``skip_locked``),
    moved back, or missing."""
    if not epochs:
        return {}, []
    table = JOBS
    pairs = sorted(epochs.items())
    fenced: ColumnElement[bool] = tuple_(table.c.job_id, table.c.owner_epoch).in_(pairs)
    if skip_locked:
        # The rows locked here are the ones the UPDATE then writes (ours already);
        # SKIP LOCKED never waits. SQLite renders no FOR UPDATE.
        fenced = table.c.job_id.in_(
            select(table.c.job_id).where(fenced).with_for_update(skip_locked=True)
        )
    matched = set(
        session.execute(
            update(table)
            .where(fenced)
            .values(owner_epoch=table.c.owner_epoch)
            .returning(table.c.job_id)
        ).scalars()
    )
    missed = [(job_id, epoch) for job_id, epoch in pairs if job_id not in matched]
    if not missed:
        return {}, []
    # The refused jobs' owners in one read, not one each: a batch of transitions
    # after a takeover is refused whole. A plain read waits for no lock.
    owners = {
        str(r.job_id): (int(r.owner_epoch), str(r.owner_id))
        for r in session.execute(
            select(table.c.job_id, table.c.owner_epoch, table.c.owner_id).where(
                table.c.job_id.in_([job_id for job_id, _ in missed])
            )
        )
    }
    refused: dict[str, StaleEpoch] = {}
    unsure: list[str] = []
    for job_id, epoch in missed:
        owner = owners.get(job_id)
        if owner is None or owner[0] == epoch:
            unsure.append(job_id)
            continue
        refused[job_id] = StaleEpoch(
            f"job {job_id}: epoch {epoch} is stale, owned by {owner[1]!r} at epoch {owner[0]}"
        )
    return refused, unsure
