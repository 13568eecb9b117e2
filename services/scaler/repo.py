"""The scaler's repository: every read and write of jobs, decisions, events and rollups.

Functions take an open Session first and never commit: the caller owns the
transaction (``services.store.db.session_scope`` or ``unit_of_work``), so a
state change, its event row and its fencing check commit together or not at
all. They return frozen records; ORM objects never leave this module.

Fencing: a scaler takes a job with :func:`acquire_job_ownership`, which bumps
the job's ``owner_epoch``; every decision write passes that epoch and runs
``UPDATE jobs ... WHERE owner_epoch = :mine`` in its own transaction before
writing, so a scaler that lost the job fails with :class:`StaleEpoch` and
writes nothing. On PostgreSQL that UPDATE also locks the job's row, which
serialises all decision writes of one job; on SQLite BEGIN IMMEDIATE does.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, Final, cast

from sqlalchemy import ColumnElement, Table, Update, and_, case, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session
from sqlalchemy.orm.exc import StaleDataError

from services.store.db import StaleWrite, json_dumps
from services.store.models.scaler import (
    JOB_ID_LEN,
    Decision,
    DecisionEvent,
    Job,
    UtilizationRollup,
)
from tidebase.errors import (
    Conflict,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)

logger = logging.getLogger(__name__)

# Core handles for the UPDATEs that must not go through the ORM's version check.
JOBS: Final = cast(Table, Job.__table__)
ROLLUPS: Final = cast(Table, UtilizationRollup.__table__)


class DecisionState(StrEnum):
    """Stored decision states; the names match tide.v1.DecisionState without its prefix."""

    PENDING = "PENDING"
    PREPARING = "PREPARING"
    ACTUATING = "ACTUATING"
    COMPLETED = "COMPLETED"
    ABORTED = "ABORTED"
    FAILED = "FAILED"


FINAL_STATES: Final = frozenset(
    {DecisionState.COMPLETED, DecisionState.ABORTED, DecisionState.FAILED}
)

# The one table of legal decision edges. The scaler's lifecycle reuses it.
DECISION_TRANSITIONS: Final[Mapping[DecisionState, frozenset[DecisionState]]] = {
    DecisionState.PENDING: frozenset(
        {DecisionState.PREPARING, DecisionState.ABORTED, DecisionState.FAILED}
    ),
    DecisionState.PREPARING: frozenset(
        {DecisionState.ACTUATING, DecisionState.ABORTED, DecisionState.FAILED}
    ),
    DecisionState.ACTUATING: frozenset(
        {DecisionState.COMPLETED, DecisionState.ABORTED, DecisionState.FAILED}
    ),
    DecisionState.COMPLETED: frozenset(),
    DecisionState.ABORTED: frozenset(),
    DecisionState.FAILED: frozenset(),
}

MAX_PAGE_SIZE: Final = 1000
DEFAULT_PAGE_SIZE: Final = 100


# --- errors ---------------------------------------------------------------------------------


class JobNotFound(NotFound):
    pass


class DecisionNotFound(NotFound):
    pass


class StaleEpoch(Conflict):
    """Another scaler took the job since this one acquired it; this one must stop acting on it."""


class InvalidTransition(FailedPrecondition):
    """The decision is not in a state from which the requested state can be reached."""


class DecisionInProgress(FailedPrecondition):
    """The job already has a decision that is not final."""


# --- records --------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    min_replicas: int
    max_replicas: int
    current_replicas: int
    gpus_per_replica: int
    policy_overrides: dict[str, Any]
    autoscaling_paused: bool
    pause_reason: str
    paused_at: datetime | None
    generation: int
    last_resize_ended_at: datetime | None
    owner_epoch: int
    owner_id: str
    created_at: datetime
    updated_at: datetime
    version: int


@dataclass(frozen=True)
class DecisionRecord:
    id: int
    job_id: str
    from_replicas: int
    to_replicas: int
    reason: str
    trigger: str
    message: str
    inputs: dict[str, Any]
    state: DecisionState
    error: str
    pause_s: float
    lost_steps: int
    generation: int
    requested_by: str
    created_at: datetime
    updated_at: datetime
    ended_at: datetime | None
    version: int

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES


@dataclass(frozen=True)
class DecisionEventRecord:
    id: int
    decision_id: int
    state: DecisionState
    at: datetime
    detail: str


@dataclass(frozen=True)
class DecisionDetailRecord:
    decision: DecisionRecord
    # Oldest first.
    events: tuple[DecisionEventRecord, ...]


@dataclass(frozen=True)
class DecisionPage:
    # Newest first.
    decisions: tuple[DecisionRecord, ...]
    # Empty on the last page.
    next_page_token: str


@dataclass(frozen=True)
class RollupRecord:
    """One job's GPU utilization over one minute, or over the part of it one write covers."""

    job_id: str
    # Start of the minute, aware UTC, seconds and microseconds zero.
    minute: datetime
    mean_pct: float
    min_pct: float
    max_pct: float
    samples: int
    replicas: int


@dataclass(frozen=True)
class _Cursor:
    created_at: datetime
    id: int
    # Fingerprint of the filters the token was issued for.
    filters: str


# --- conversions ----------------------------------------------------------------------------


def _job_record(row: Job) -> JobRecord:
    return JobRecord(
        job_id=row.job_id,
        min_replicas=row.min_replicas,
        max_replicas=row.max_replicas,
        current_replicas=row.current_replicas,
        gpus_per_replica=row.gpus_per_replica,
        policy_overrides=dict(row.policy_overrides),
        autoscaling_paused=row.autoscaling_paused,
        pause_reason=row.pause_reason,
        paused_at=row.paused_at,
        generation=row.generation,
        last_resize_ended_at=row.last_resize_ended_at,
        owner_epoch=row.owner_epoch,
        owner_id=row.owner_id,
        created_at=row.created_at,
        updated_at=row.updated_at,
        version=row.version,
    )


def _decision_record(row: Decision) -> DecisionRecord:
    return DecisionRecord(
        id=row.id,
        job_id=row.job_id,
        from_replicas=row.from_replicas,
        to_replicas=row.to_replicas,
        reason=row.reason,
        trigger=row.trigger,
        message=row.message,
        inputs=dict(row.inputs),
        state=DecisionState(row.state),
        error=row.error,
        pause_s=row.pause_s,
        lost_steps=row.lost_steps,
        generation=row.generation,
        requested_by=row.requested_by,
        created_at=row.created_at,
        updated_at=row.updated_at,
        ended_at=row.ended_at,
        version=row.version,
    )


def _event_record(row: DecisionEvent) -> DecisionEventRecord:
    return DecisionEventRecord(
        id=row.id,
        decision_id=row.decision_id,
        state=DecisionState(row.state),
        at=row.at,
        detail=row.detail,
    )


def _rollup_record(row: UtilizationRollup) -> RollupRecord:
    return RollupRecord(
        job_id=row.job_id,
        minute=row.minute,
        mean_pct=row.mean_pct,
        min_pct=row.min_pct,
        max_pct=row.max_pct,
        samples=row.samples,
        replicas=row.replicas,
    )


# --- validation -----------------------------------------------------------------------------


def validate_job_id(job_id: str) -> None:
    """A job id is "namespace/name", both parts non-empty, no further slash."""
    parts = job_id.split("/")
    if len(parts) != 2 or not all(parts) or len(job_id) > JOB_ID_LEN:
        raise InvalidArgument(
            f"job_id must be 'namespace/name' of at most {JOB_ID_LEN} chars, got {job_id!r}"
        )
    if any(c.isspace() for c in job_id):
        raise InvalidArgument(f"job_id must not contain whitespace, got {job_id!r}")


def _aware(name: str, value: datetime) -> datetime:
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidArgument(f"{name} must be timezone-aware, got naive {value.isoformat()}")
    return value


def _json_copy(value: Mapping[str, Any], what: str) -> dict[str, Any]:
    """The value as it will read back from the database (NaN becomes null, tuples lists)."""
    try:
        copied: dict[str, Any] = json.loads(json_dumps(dict(value)))
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{what} is not JSON-serialisable: {exc}") from exc
    return copied


def _flush(session: Session, what: str) -> None:
    try:
        session.flush()
    except StaleDataError as exc:
        raise StaleWrite(f"{what}: a concurrent writer changed the row first") from exc


def _execute(session: Session, stmt: Update) -> int:
    """Run a Core UPDATE on the session's connection; returns the matched row count."""
    result = session.connection().execute(stmt)
    assert isinstance(result, CursorResult)
    return result.rowcount


# --- jobs -----------------------------------------------------------------------------------


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
    _aware("now", now)
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
            policy_overrides=_json_copy(
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
        logger.info("job %s created with %d replicas", job_id, current)
    else:
        row.min_replicas = min_replicas
        row.max_replicas = max_replicas
        if gpus_per_replica is not None:
            row.gpus_per_replica = gpus_per_replica
        if policy_overrides:
            row.policy_overrides = _json_copy(
                _merge_overrides(row.policy_overrides, policy_overrides),
                f"policy overrides of job {job_id}",
            )
        row.updated_at = now
    _flush(session, f"upsert job {job_id}")
    return _job_record(row)


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
    return _job_record(_get_job_row(session, job_id))


def list_jobs(session: Session) -> list[JobRecord]:
    return [_job_record(r) for r in session.scalars(select(Job).order_by(Job.job_id))]


def set_paused(
    session: Session, job_id: str, *, paused: bool, reason: str, now: datetime
) -> JobRecord:
    """Pause or resume autoscaling of a job; pausing needs a reason, resuming clears it."""
    _aware("now", now)
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
    _flush(session, f"set paused={paused} on job {job_id}")
    logger.info("job %s autoscaling paused=%s (%s)", job_id, paused, reason)
    return _job_record(row)


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
    _aware("now", now)
    row = _get_job_row(session, job_id)
    if current_replicas is not None:
        if current_replicas < 0:
            raise InvalidArgument(f"current_replicas must be >= 0, got {current_replicas}")
        row.current_replicas = current_replicas
    if generation is not None and generation > row.generation:
        row.generation = generation
    row.updated_at = now
    _flush(session, f"record observed state of job {job_id}")
    return _job_record(row)


def acquire_job_ownership(session: Session, job_id: str, owner_id: str, *, now: datetime) -> int:
    """Make ``owner_id`` the one scaler acting on the job; returns the new epoch.

    The epoch always increases, also when the same owner re-acquires (after a
    restart its in-flight writes from before must not land).
    """
    _aware("now", now)
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
    if _execute(session, stmt) != 1:
        raise JobNotFound(f"job {job_id!r} not found")
    epoch = session.scalar(select(table.c.owner_epoch).where(table.c.job_id == job_id))
    assert epoch is not None
    # The ORM identity map may hold the job with the old epoch; drop it.
    cached = session.get(Job, job_id, populate_existing=True)
    assert cached is not None
    logger.info("scaler %s owns job %s at epoch %d", owner_id, job_id, epoch)
    return int(epoch)


def _check_epoch(session: Session, job_id: str, epoch: int) -> None:
    """The fencing check, in the caller's transaction; locks the job row on PostgreSQL."""
    table = JOBS
    stmt = (
        update(table)
        .where(table.c.job_id == job_id, table.c.owner_epoch == epoch)
        .values(owner_epoch=table.c.owner_epoch)
    )
    if _execute(session, stmt) == 1:
        return
    row = session.execute(
        select(table.c.owner_epoch, table.c.owner_id).where(table.c.job_id == job_id)
    ).one_or_none()
    if row is None:
        raise JobNotFound(f"job {job_id!r} not found")
    raise StaleEpoch(
        f"job {job_id}: epoch {epoch} is stale, owned by {row.owner_id!r} at epoch {row.owner_epoch}"
    )


# --- decisions ------------------------------------------------------------------------------


def create_decision(
    session: Session,
    *,
    job_id: str,
    from_replicas: int,
    to_replicas: int,
    reason: str,
    trigger: str,
    message: str,
    inputs: Mapping[str, Any],
    epoch: int,
    now: datetime,
    requested_by: str = "",
    exclusive: bool = True,
) -> DecisionRecord:
    """Persist a PENDING decision and its first event, if ``epoch`` still owns the job.

    With ``exclusive`` (the default) it refuses while the job has a decision
    that is not final: one resize at a time per job. The check is race-free
    because the fencing UPDATE serialises writers of the job.
    """
    _aware("now", now)
    if from_replicas < 0 or to_replicas < 0:
        raise InvalidArgument(f"replicas must be >= 0, got from={from_replicas} to={to_replicas}")
    if not reason:
        raise InvalidArgument("reason must not be empty")
    if not trigger:
        raise InvalidArgument("trigger must not be empty")
    _check_epoch(session, job_id, epoch)
    if exclusive:
        active = active_decision(session, job_id)
        if active is not None:
            raise DecisionInProgress(
                f"job {job_id} has decision {active.id} in state {active.state}"
            )
    row = Decision(
        job_id=job_id,
        from_replicas=from_replicas,
        to_replicas=to_replicas,
        reason=reason,
        trigger=trigger,
        message=message,
        inputs=_json_copy(inputs, f"inputs of a decision for job {job_id}"),
        state=DecisionState.PENDING.value,
        error="",
        pause_s=0.0,
        lost_steps=0,
        generation=0,
        requested_by=requested_by,
        created_at=now,
        updated_at=now,
        ended_at=None,
    )
    session.add(row)
    _flush(session, f"create decision for job {job_id}")
    session.add(DecisionEvent(decision_id=row.id, state=row.state, at=now, detail=message))
    _flush(session, f"create decision event for job {job_id}")
    logger.info(
        "decision %d for job %s: %d -> %d (%s, %s)",
        row.id,
        job_id,
        from_replicas,
        to_replicas,
        reason,
        trigger,
    )
    return _decision_record(row)


def transition_decision(
    session: Session,
    decision_id: int,
    new_state: DecisionState,
    *,
    detail: str,
    epoch: int,
    now: datetime,
    error: str | None = None,
    pause_s: float | None = None,
    lost_steps: int | None = None,
    generation: int | None = None,
    to_replicas: int | None = None,
) -> DecisionRecord:
    """Move a decision along one edge of DECISION_TRANSITIONS and record the event.

    Reaching a final state stamps ``ended_at`` and the job's
    ``last_resize_ended_at`` (cooldown counts from any ending, aborts too);
    COMPLETED also sets the job's current replicas to ``to_replicas`` and
    its generation. ``to_replicas`` may be lowered on the way (a grow that
    proceeds with the newcomers that arrived).
    """
    _aware("now", now)
    new_state = DecisionState(new_state)
    row = session.get(Decision, decision_id)
    if row is None:
        raise DecisionNotFound(f"decision {decision_id} not found")
    _check_epoch(session, row.job_id, epoch)
    # The fencing UPDATE may have waited for another writer of this job; re-read.
    session.refresh(row)
    old_state = DecisionState(row.state)
    if new_state not in DECISION_TRANSITIONS[old_state]:
        raise InvalidTransition(
            f"decision {decision_id} of job {row.job_id}: {old_state} -> {new_state} is not allowed"
        )
    if pause_s is not None and (not math.isfinite(pause_s) or pause_s < 0):
        raise InvalidArgument(f"pause_s must be finite and >= 0, got {pause_s}")
    if lost_steps is not None and lost_steps < 0:
        raise InvalidArgument(f"lost_steps must be >= 0, got {lost_steps}")
    if generation is not None and generation < 0:
        raise InvalidArgument(f"generation must be >= 0, got {generation}")
    if to_replicas is not None and to_replicas < 0:
        raise InvalidArgument(f"to_replicas must be >= 0, got {to_replicas}")
    row.state = new_state.value
    row.updated_at = now
    if error is not None:
        row.error = error
    if pause_s is not None:
        row.pause_s = pause_s
    if lost_steps is not None:
        row.lost_steps = lost_steps
    if generation is not None:
        row.generation = generation
    if to_replicas is not None:
        row.to_replicas = to_replicas
    if new_state in FINAL_STATES:
        row.ended_at = now
    session.add(DecisionEvent(decision_id=row.id, state=row.state, at=now, detail=detail))
    _flush(session, f"transition decision {decision_id}")
    if new_state in FINAL_STATES:
        _update_job_on_end(session, row, new_state, now)
    logger.info(
        "decision %d of job %s: %s -> %s (%s)",
        decision_id,
        row.job_id,
        old_state,
        new_state,
        detail,
    )
    return _decision_record(row)


def _update_job_on_end(
    session: Session, row: Decision, state: DecisionState, now: datetime
) -> None:
    table = JOBS
    values: dict[str, Any] = {
        "last_resize_ended_at": now,
        "updated_at": now,
        "version": table.c.version + 1,
    }
    if state is DecisionState.COMPLETED:
        values["current_replicas"] = row.to_replicas
        # A generation only moves forward, whoever reported it first.
        values["generation"] = case(
            (table.c.generation < row.generation, row.generation), else_=table.c.generation
        )
    _execute(session, update(table).where(table.c.job_id == row.job_id).values(**values))
    # Core bypassed the identity map; reload the job if this session holds it.
    session.get(Job, row.job_id, populate_existing=True)


def active_decision(session: Session, job_id: str) -> DecisionRecord | None:
    """The job's decision that is not final yet, if any (the newest if, wrongly, several)."""
    row = session.scalars(
        select(Decision)
        .where(Decision.job_id == job_id, Decision.state.not_in(_final_values()))
        .order_by(Decision.created_at.desc(), Decision.id.desc())
        .limit(1)
    ).first()
    return None if row is None else _decision_record(row)


def _final_values() -> list[str]:
    return [s.value for s in FINAL_STATES]


def get_decision(session: Session, decision_id: int) -> DecisionDetailRecord:
    row = session.get(Decision, decision_id)
    if row is None:
        raise DecisionNotFound(f"decision {decision_id} not found")
    events = session.scalars(
        select(DecisionEvent)
        .where(DecisionEvent.decision_id == decision_id)
        .order_by(DecisionEvent.at, DecisionEvent.id)
    )
    return DecisionDetailRecord(
        decision=_decision_record(row), events=tuple(_event_record(e) for e in events)
    )


def non_final_decisions(session: Session) -> list[DecisionRecord]:
    """Every decision a restarted scaler must resume or abort, oldest first."""
    rows = session.scalars(
        select(Decision)
        .where(Decision.state.not_in(_final_values()))
        .order_by(Decision.created_at, Decision.id)
    )
    return [_decision_record(r) for r in rows]


def last_resize_end(session: Session, job_id: str) -> datetime | None:
    """When the job's last decision reached a final state; None if none ever did."""
    value = session.scalar(select(Job.last_resize_ended_at).where(Job.job_id == job_id))
    if value is None and session.get(Job, job_id) is None:
        raise JobNotFound(f"job {job_id!r} not found")
    return value


def list_decisions(
    session: Session,
    *,
    job_id: str = "",
    since: datetime | None = None,
    until: datetime | None = None,
    states: Sequence[DecisionState] = (),
    page_size: int = DEFAULT_PAGE_SIZE,
    page_token: str = "",
) -> DecisionPage:
    """Decisions newest first, filtered, one page at a time (keyset on (created_at, id)).

    ``since`` is inclusive and ``until`` exclusive. A token only works with
    the filters it was issued for. Rows inserted while paging show up on a
    later call if they are older than the cursor, never twice.
    """
    if not (1 <= page_size <= MAX_PAGE_SIZE):
        raise InvalidArgument(f"page_size must be in 1..{MAX_PAGE_SIZE}, got {page_size}")
    state_values = sorted({DecisionState(s).value for s in states})
    fingerprint = _fingerprint(job_id, since, until, state_values)
    conditions: list[ColumnElement[bool]] = []
    if job_id:
        conditions.append(Decision.job_id == job_id)
    if since is not None:
        conditions.append(Decision.created_at >= _aware("since", since))
    if until is not None:
        conditions.append(Decision.created_at < _aware("until", until))
    if state_values:
        conditions.append(Decision.state.in_(state_values))
    if page_token:
        cursor = _decode_token(page_token)
        if cursor.filters != fingerprint:
            raise InvalidArgument("page_token was issued for different filters")
        # The plain bound lets both engines start the index range scan at the
        # cursor; the OR alone would be a filter over every newer row.
        conditions.append(Decision.created_at <= cursor.created_at)
        conditions.append(
            or_(
                Decision.created_at < cursor.created_at,
                and_(Decision.created_at == cursor.created_at, Decision.id < cursor.id),
            )
        )
    rows = list(
        session.scalars(
            select(Decision)
            .where(*conditions)
            .order_by(Decision.created_at.desc(), Decision.id.desc())
            .limit(page_size + 1)
        )
    )
    more = len(rows) > page_size
    rows = rows[:page_size]
    token = ""
    if more:
        last = rows[-1]
        token = _encode_token(_Cursor(last.created_at, last.id, fingerprint))
    return DecisionPage(decisions=tuple(_decision_record(r) for r in rows), next_page_token=token)


def _fingerprint(
    job_id: str, since: datetime | None, until: datetime | None, states: list[str]
) -> str:
    key = json.dumps(
        [
            job_id,
            None if since is None else since.timestamp(),
            None if until is None else until.timestamp(),
            states,
        ]
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _encode_token(cursor: _Cursor) -> str:
    payload = json.dumps(
        {"t": cursor.created_at.isoformat(), "i": cursor.id, "f": cursor.filters},
        separators=(",", ":"),
    )
    return base64.urlsafe_b64encode(payload.encode()).decode().rstrip("=")


def _decode_token(token: str) -> _Cursor:
    try:
        padded = token + "=" * (-len(token) % 4)
        data = json.loads(base64.urlsafe_b64decode(padded.encode()))
        created_at = datetime.fromisoformat(data["t"])
        decision_id = int(data["i"])
        filters = str(data["f"])
    except (binascii.Error, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"page_token {token[:40]!r} is not valid") from exc
    if created_at.tzinfo is None:
        raise InvalidArgument(f"page_token {token[:40]!r} is not valid")
    return _Cursor(created_at, decision_id, filters)


# --- utilization rollups --------------------------------------------------------------------


def _validate_rollup(r: RollupRecord) -> None:
    validate_job_id(r.job_id)
    _aware("minute", r.minute)
    if r.minute.second or r.minute.microsecond:
        raise InvalidArgument(
            f"rollup of job {r.job_id}: minute must be the start of a minute, "
            f"got {r.minute.isoformat()}"
        )
    values = (r.mean_pct, r.min_pct, r.max_pct)
    if not all(math.isfinite(v) and 0.0 <= v <= 100.0 for v in values):
        raise InvalidArgument(
            f"rollup of job {r.job_id} at {r.minute.isoformat()}: percentages must be "
            f"finite in 0..100, got mean={r.mean_pct} min={r.min_pct} max={r.max_pct}"
        )
    if not (r.min_pct <= r.mean_pct <= r.max_pct):
        raise InvalidArgument(
            f"rollup of job {r.job_id} at {r.minute.isoformat()}: need min <= mean <= max, "
            f"got {r.min_pct} / {r.mean_pct} / {r.max_pct}"
        )
    if r.samples < 1:
        raise InvalidArgument(f"rollup of job {r.job_id}: samples must be >= 1, got {r.samples}")
    if r.replicas < 0:
        raise InvalidArgument(f"rollup of job {r.job_id}: replicas must be >= 0, got {r.replicas}")


def merge_rollups(a: RollupRecord, b: RollupRecord) -> RollupRecord:
    """Two partial rollups of the same job and minute as one; ``b`` is the later write."""
    samples = a.samples + b.samples
    return RollupRecord(
        job_id=a.job_id,
        minute=a.minute,
        mean_pct=(a.mean_pct * a.samples + b.mean_pct * b.samples) / samples,
        min_pct=min(a.min_pct, b.min_pct),
        max_pct=max(a.max_pct, b.max_pct),
        samples=samples,
        replicas=b.replicas,
    )


def write_rollups(session: Session, rows: Iterable[RollupRecord]) -> int:
    """Add per-minute rollups; a minute already stored merges with the new part.

    Each write carries the samples that arrived since the previous write of
    that minute (a delta, not a running total): means combine weighted by
    samples, min and max widen, replicas take the newest value. Returns the
    number of (job, minute) rows written.
    """
    merged: dict[tuple[str, datetime], RollupRecord] = {}
    for r in rows:
        _validate_rollup(r)
        key = (r.job_id, r.minute)
        merged[key] = merge_rollups(merged[key], r) if key in merged else r
    if not merged:
        return 0
    values = [
        {
            "job_id": r.job_id,
            "minute": r.minute,
            "mean_pct": r.mean_pct,
            "min_pct": r.min_pct,
            "max_pct": r.max_pct,
            "samples": r.samples,
            "replicas": r.replicas,
        }
        for r in merged.values()
    ]
    table = ROLLUPS
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        pg_stmt = postgresql.insert(table)
        ex = pg_stmt.excluded
        least, greatest = "least", "greatest"
        base: Any = pg_stmt
    elif dialect == "sqlite":
        lite_stmt = sqlite.insert(table)
        ex = lite_stmt.excluded
        # SQLite's multi-argument min()/max() are scalar, like LEAST/GREATEST.
        least, greatest = "min", "max"
        base = lite_stmt
    else:
        raise FailedPrecondition(f"rollup upsert is not implemented for {dialect}")
    c = table.c
    total = c.samples + ex.samples
    stmt = base.on_conflict_do_update(
        index_elements=[c.job_id, c.minute],
        set_={
            "mean_pct": (c.mean_pct * c.samples + ex.mean_pct * ex.samples) / total,
            "min_pct": getattr(func, least)(c.min_pct, ex.min_pct),
            "max_pct": getattr(func, greatest)(c.max_pct, ex.max_pct),
            "samples": total,
            "replicas": ex.replicas,
        },
    )
    session.connection().execute(stmt, values)
    return len(values)


def rollups_between(
    session: Session, job_id: str, t0: datetime, t1: datetime
) -> list[RollupRecord]:
    """The job's rollups with t0 <= minute < t1, oldest first."""
    _aware("t0", t0)
    _aware("t1", t1)
    rows = session.scalars(
        select(UtilizationRollup)
        .where(
            UtilizationRollup.job_id == job_id,
            UtilizationRollup.minute >= t0,
            UtilizationRollup.minute < t1,
        )
        .order_by(UtilizationRollup.minute)
    )
    return [_rollup_record(r) for r in rows]


def delete_rollups_before(session: Session, before: datetime) -> int:
    """Retention: drop every rollup older than ``before``; returns how many."""
    _aware("before", before)
    table = ROLLUPS
    result = session.connection().execute(table.delete().where(table.c.minute < before))
    assert isinstance(result, CursorResult)
    return result.rowcount
