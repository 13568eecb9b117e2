"""Decisions: create one, move it along the lifecycle with its event row, read them back."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, cast

from sqlalchemy import (
    ColumnElement,
    Table,
    case,
    delete,
    insert,
    literal_column,
    select,
    update,
)
from sqlalchemy.orm import Session
from sqlalchemy.orm.util import identity_key

from tide.base.errors import InvalidArgument
from tide.services.scaler.errors import (
    DecisionChanged,
    DecisionInProgress,
    DecisionNotFound,
    JobNotFound,
    StaleEpoch,
)
from tide.services.scaler.store.jobs import check_epoch, check_epochs
from tide.services.scaler.store.records import (
    DECISION_LIFECYCLE,
    FINAL_STATES,
    DecisionDetailRecord,
    DecisionRecord,
    DecisionState,
)
from tide.services.scaler.store.rows import (
    DECISIONS,
    JOBS,
    aware,
    check_limit,
    decision_record,
    event_record,
    execute,
    json_copy,
)
from tide.services.store.failures import StaleWrite
from tide.services.store.models.scaler import OPEN_STATES, Decision, DecisionEvent, Job

logger = logging.getLogger(__name__)

EVENTS: Table = cast(Table, DecisionEvent.__table__)


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
    aware("now", now)
    if from_replicas < 0 or to_replicas < 0:
        raise InvalidArgument(f"replicas must be >= 0, got from={from_replicas} to={to_replicas}")
    if not reason:
        raise InvalidArgument("reason must not be empty")
    if not trigger:
        raise InvalidArgument("trigger must not be empty")
    check_epoch(session, job_id, epoch)
    if exclusive:
        active = active_decision(session, job_id)
        if active is not None:
            raise DecisionInProgress(
                f"job {job_id} has decision {active.id} in state {active.state}"
            )
    (row,) = _insert_decisions(
        session,
        [
            {
                "job_id": job_id,
                "from_replicas": from_replicas,
                "to_replicas": to_replicas,
                "reason": reason,
                "trigger": trigger,
                "message": message,
                "inputs": inputs,
                "requested_by": requested_by,
            }
        ],
        epochs={job_id: epoch},
        now=now,
    )
    return row


def create_decisions(
    session: Session,
    items: Sequence[Mapping[str, Any]],
    *,
    epochs: Mapping[str, int],
    now: datetime,
) -> list[DecisionRecord | DecisionInProgress | StaleEpoch]:
    """:func:`create_decision` for many jobs in the caller's transaction, each
    ``items`` entry its keywords but ``epoch`` and ``now``: the same checks (the fencing
    UPDATE of all the jobs in one statement, ``check_epochs``; the exclusivity check
    in one read of the open decisions of all of them) and then one multi-row INSERT of
    the decisions and one of their first events, instead of two ORM flushes per
    decision. A job refused (a stale epoch, a decision
    in flight, or the same job twice) gets its error in its place and nothing written;
    a job not found or an invalid item raises for the whole batch."""
    aware("now", now)
    out: list[DecisionRecord | DecisionInProgress | StaleEpoch | None] = []
    ok: list[tuple[int, Mapping[str, Any]]] = []
    for kw in items:
        if kw["from_replicas"] < 0 or kw["to_replicas"] < 0:
            raise InvalidArgument(
                f"replicas must be >= 0, got from={kw['from_replicas']} to={kw['to_replicas']}"
            )
        if not kw["reason"] or not kw["trigger"]:
            raise InvalidArgument("reason and trigger must not be empty")
    stale = check_epochs(session, {kw["job_id"]: epochs[kw["job_id"]] for kw in items})
    for n, kw in enumerate(items):
        exc = stale.get(kw["job_id"])
        out.append(exc)
        if exc is None:
            ok.append((n, kw))
    busy = {
        str(job_id): (int(did), str(state))
        for job_id, did, state in session.execute(
            select(Decision.job_id, Decision.id, Decision.state).where(
                Decision.job_id.in_({kw["job_id"] for _, kw in ok}), _open()
            )
        )
    }
    placed: list[tuple[int, Mapping[str, Any]]] = []
    for n, kw in ok:
        job_id = kw["job_id"]
        active = busy.get(job_id)
        if active is not None:
            out[n] = DecisionInProgress(
                f"job {job_id} has decision {active[0]} in state {active[1]}"
            )
            continue
        busy[job_id] = (0, DecisionState.PENDING.value)  # the same job twice: once
        placed.append((n, kw))
    written = _insert_decisions(session, [kw for _, kw in placed], epochs=epochs, now=now)
    for (n, _), record in zip(placed, written, strict=True):
        out[n] = record
    return [r for r in out if r is not None]


def _insert_decisions(
    session: Session,
    items: Sequence[Mapping[str, Any]],
    *,
    epochs: Mapping[str, int],
    now: datetime,
) -> list[DecisionRecord]:
    """Write PENDING decisions and their first events: one multi-row INSERT of each
    (Core, RETURNING the rows), whatever the number of decisions. The caller checked
    the epochs and the exclusivity."""
    if not items:
        return []
    rows = [
        {
            "job_id": kw["job_id"],
            "from_replicas": kw["from_replicas"],
            "to_replicas": kw["to_replicas"],
            "reason": kw["reason"],
            "trigger": kw["trigger"],
            "message": kw["message"],
            "inputs": json_copy(kw["inputs"], f"inputs of a decision for job {kw['job_id']}"),
            "state": DecisionState.PENDING.value,
            "error": "",
            "pause_s": 0.0,
            "lost_steps": 0,
            "generation": 0,
            "requested_by": kw.get("requested_by", ""),
            "created_at": now,
            "updated_at": now,
            "ended_at": None,
            # The ORM's version counter starts at 1 (Decision.version_id_col).
            "version": 1,
        }
        for kw in items
    ]
    table = DECISIONS
    written = session.execute(
        insert(table).returning(*table.c, sort_by_parameter_order=True), rows
    ).all()
    session.execute(
        insert(EVENTS),
        [
            {
                "decision_id": row.id,
                "state": row.state,
                "at": now,
                "detail": row.message,
                "owner_epoch": epochs[row.job_id],
            }
            for row in written
        ],
    )
    for row in written:
        logger.info(
            "decision %d for job %s: %d -> %d (%s, %s)",
            row.id,
            row.job_id,
            row.from_replicas,
            row.to_replicas,
            row.reason,
            row.trigger,
            extra={"job_id": row.job_id, "decision_id": row.id},
        )
    return [decision_record(row) for row in written]


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
    expected: DecisionState | None = None,
) -> DecisionRecord:
    """Move a decision along one edge of DECISION_LIFECYCLE and record the event.

    ``expected`` is the state the caller read: a row found in another state
    changed under it (a race) and raises :class:`DecisionChanged`; an edge the
    table does not have, from the state the row really holds, is a bug and
    raises tide.base.lifecycle.InvalidTransition.

    Reaching a final state stamps ``ended_at`` and the job's
    ``last_resize_ended_at`` (cooldown counts from any ending, aborts too);
    COMPLETED also sets the job's current replicas to ``to_replicas`` and
    its generation. ``to_replicas`` may be lowered on the way (a grow that
    proceeds with the newcomers that arrived).

    Core statements, not the ORM: a read of the row's job and state, the fencing
    UPDATE, one UPDATE of the row guarded by the state read (RETURNING the row), one
    INSERT of the event, and on a final state one UPDATE of the job. The ORM's get,
    refresh and flush were most of a decision's store time (docs/scaler.md).
    """
    aware("now", now)
    new_state = DecisionState(new_state)
    table = DECISIONS
    seen = session.execute(
        select(table.c.job_id, table.c.state).where(table.c.id == decision_id)
    ).one_or_none()
    if seen is None:
        raise DecisionNotFound(f"decision {decision_id} not found")
    job_id = str(seen.job_id)
    # The fencing UPDATE locks the job row on PostgreSQL: every writer of the job's
    # decisions takes it first, so the state read above holds unless one came between.
    check_epoch(session, job_id, epoch)
    old_state = DecisionState(seen.state)
    for _ in range(2):
        if expected is not None and DecisionState(expected) is not old_state:
            raise DecisionChanged(
                f"decision {decision_id} of job {job_id}: expected {DecisionState(expected)},"
                f" found {old_state}"
            )
        DECISION_LIFECYCLE.check(old_state, new_state, what=f"{decision_id} of job {job_id}")
        check_transition_args(pause_s, lost_steps, generation, to_replicas)
        values: dict[str, Any] = {
            "state": new_state.value,
            "updated_at": now,
            # The ORM's version counter (Decision.version_id_col), kept as it would.
            "version": table.c.version + 1,
        }
        for name, value in (
            ("error", error),
            ("pause_s", pause_s),
            ("lost_steps", lost_steps),
            ("generation", generation),
            ("to_replicas", to_replicas),
        ):
            if value is not None:
                values[name] = value
        if new_state in FINAL_STATES:
            values["ended_at"] = now
        row = session.execute(
            update(table)
            .where(table.c.id == decision_id, table.c.state == old_state.value)
            .values(**values)
            .returning(*table.c)
        ).one_or_none()
        if row is not None:
            break
        # Another writer moved it between the read and the lock: once more, as it is now.
        old_state = DecisionState(
            session.execute(select(table.c.state).where(table.c.id == decision_id)).scalar_one()
        )
    else:
        raise StaleWrite(f"transition decision {decision_id}: its state kept changing")
    session.execute(
        insert(EVENTS).values(
            decision_id=decision_id, state=row.state, at=now, detail=detail, owner_epoch=epoch
        )
    )
    _expire(session, Decision, decision_id)
    if new_state in FINAL_STATES:
        _update_job_on_end(session, row, new_state, now)
    logger.info(
        "decision %d of job %s: %s -> %s (%s)",
        decision_id,
        job_id,
        old_state,
        new_state,
        detail,
        extra={"job_id": job_id, "decision_id": decision_id},
    )
    return decision_record(row)


def check_transition_args(
    pause_s: float | None, lost_steps: int | None, generation: int | None, to_replicas: int | None
) -> None:
    if pause_s is not None and (not math.isfinite(pause_s) or pause_s < 0):
        raise InvalidArgument(f"pause_s must be finite and >= 0, got {pause_s}")
    if lost_steps is not None and lost_steps < 0:
        raise InvalidArgument(f"lost_steps must be >= 0, got {lost_steps}")
    if generation is not None and generation < 0:
        raise InvalidArgument(f"generation must be >= 0, got {generation}")
    if to_replicas is not None and to_replicas < 0:
        raise InvalidArgument(f"to_replicas must be >= 0, got {to_replicas}")


def _expire(session: Session, cls: type[Any], key: Any) -> None:
    """A Core write bypassed the identity map: an object of the row this session holds
    is expired (read again when next used); none is loaded for it."""
    obj = session.identity_map.get(identity_key(cls, key))
    if obj is not None:
        session.expire(obj)


def _update_job_on_end(session: Session, row: Any, state: DecisionState, now: datetime) -> None:
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
    execute(session, update(table).where(table.c.job_id == row.job_id).values(**values))
    _expire(session, Job, row.job_id)


def active_decision(session: Session, job_id: str) -> DecisionRecord | None:
    """The job's decision that is not final yet, if any (the newest if, wrongly, several).

    Reads the partial index ix_decisions_open: a few rows, however long the history."""
    row = session.scalars(
        select(Decision)
        .where(Decision.job_id == job_id, _open())
        .order_by(Decision.created_at.desc(), Decision.id.desc())
        .limit(1)
    ).first()
    return None if row is None else decision_record(row)


def active_decisions(session: Session) -> dict[str, DecisionRecord]:
    """Every job's decision that is not final (the newest per job): one query, off the
    partial index, whatever the number of jobs or the history's size."""
    return {d.job_id: d for d in _open_rows(session)}


def last_completed_decisions(session: Session, job_ids: Sequence[str]) -> dict[str, DecisionRecord]:
    """Each job's newest COMPLETED decision, for many jobs in two queries: a correlated
    subquery per job walks that job's (job_id, created_at) index backwards."""
    if not job_ids:
        return {}
    newest = (
        select(Decision.id)
        .where(Decision.job_id == Job.job_id, Decision.state == DecisionState.COMPLETED.value)
        .order_by(Decision.created_at.desc(), Decision.id.desc())
        .limit(1)
        .correlate(Job)
        .scalar_subquery()
    )
    ids = [
        i
        for i in session.scalars(select(newest).where(Job.job_id.in_(sorted(set(job_ids)))))
        if i is not None
    ]
    if not ids:
        return {}
    return {
        r.job_id: decision_record(r)
        for r in session.scalars(select(Decision).where(Decision.id.in_(ids)))
    }


def _open() -> ColumnElement[bool]:
    # Literal values, not bound parameters: the planners match the partial index's
    # predicate (OPEN_PREDICATE) against these terms, and SQLite only matches equal terms.
    return Decision.state.in_([literal_column(f"'{s}'") for s in OPEN_STATES])


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
        decision=decision_record(row), events=tuple(event_record(e) for e in events)
    )


def non_final_decisions(session: Session) -> list[DecisionRecord]:
    """Every decision a restarted scaler must resume or abort, oldest first."""
    return _open_rows(session)


def _open_rows(session: Session) -> list[DecisionRecord]:
    """Every open decision, oldest first. Sorted here, not by SQL: an ORDER BY lets
    SQLite's planner prefer walking the whole (created_at, id) index over reading
    the few rows of the partial index and sorting them."""
    rows = [decision_record(r) for r in session.scalars(select(Decision).where(_open()))]
    return sorted(rows, key=lambda d: (d.created_at, d.id))


def delete_decisions_before(session: Session, before: datetime, *, limit: int) -> int:
    """Retention: delete up to ``limit`` final decisions created before ``before``, oldest
    first, with their events; returns how many decisions went. A decision that is not
    final is kept whatever its age: a restarted scaler must still resume it."""
    aware("before", before)
    check_limit(limit)
    final: list[ColumnElement[str]] = [literal_column(f"'{s.value}'") for s in FINAL_STATES]
    ids = list(
        session.scalars(
            select(Decision.id)
            .where(Decision.created_at < before, Decision.state.in_(final))
            .order_by(Decision.created_at, Decision.id)
            .limit(limit)
        )
    )
    if not ids:
        return 0
    # Events first and explicitly: the foreign key cascades too, but only where the
    # engine enforces it (SQLite needs its pragma).
    session.connection().execute(delete(DecisionEvent).where(DecisionEvent.decision_id.in_(ids)))
    session.connection().execute(delete(Decision).where(Decision.id.in_(ids)))
    return len(ids)


def last_resize_end(session: Session, job_id: str) -> datetime | None:
    """When the job's last decision reached a final state; None if none ever did."""
    value = session.scalar(select(Job.last_resize_ended_at).where(Job.job_id == job_id))
    if value is None and session.get(Job, job_id) is None:
        raise JobNotFound(f"job {job_id!r} not found")
    return value
