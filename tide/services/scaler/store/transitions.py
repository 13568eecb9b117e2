"""Many decisions' lifecycle transitions in one transaction: ``transition_decision``'s
checks and writes for a batch, in a constant number of statements whatever its size.

When a thousand jobs tip together their decisions move together too: three
transitions each, one transaction each, were the burst's bound on PostgreSQL
(thousands of round trips; docs/scaler.md, "Group commit of transitions").
``DecisionStore.transition`` queues concurrent calls and writes each turn's queue
here: one read of the rows, one fencing UPDATE of all their jobs, one UPDATE of the
rows (compiled once and executed for each, guarded by the state it was read in), one
read of the rows written, one INSERT of all the events and one UPDATE of the jobs that
reach an end (compiled once too).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from sqlalchemy import (
    Boolean,
    ColumnElement,
    bindparam,
    case,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session

from tide.base.errors import InvalidArgument
from tide.services.scaler.errors import DecisionChanged, DecisionNotFound
from tide.services.scaler.store.decisions import (
    EVENTS,
    check_transition_args,
    transition_decision,
)
from tide.services.scaler.store.jobs import check_epochs_unless_locked
from tide.services.scaler.store.records import (
    DECISION_LIFECYCLE,
    FINAL_STATES,
    DecisionRecord,
    DecisionState,
)
from tide.services.scaler.store.rows import DECISIONS, JOBS, aware, decision_record
from tide.services.store.failures import StaleWrite

logger = logging.getLogger(__name__)

# The store's writer takes at most this many moves a turn. A turn of n binds n values in
# the first read's and the read back's `id IN` lists and 2n in the fencing UPDATE's
# `(job_id, owner_epoch) IN`: these bound it, against SQLite's 32,766 and PostgreSQL's
# 65,535 bound parameters a statement. The rest are executemany: run a move at a time,
# or (SQLite's INSERT) paged by SQLAlchemy under the limit.
MAX_BATCH = 1000


class NotBatched(Exception):
    """In a batch's answers: this move was not written, as its job's row was held by
    another transaction (or the job is not found); the caller writes it alone, and it
    gets the single path's answer from that."""


@dataclass(frozen=True, slots=True)
class Move:
    """One ``transition_decision`` call's arguments (None: the column is kept)."""

    decision_id: int
    state: DecisionState
    detail: str
    epoch: int
    now: datetime
    expected: DecisionState | None = None
    error: str | None = None
    pause_s: float | None = None
    lost_steps: int | None = None
    generation: int | None = None
    to_replicas: int | None = None


def transition_alone(session: Session, m: Move) -> DecisionRecord:
    """``m`` written alone, by the single path (``decisions.transition_decision``)."""
    return transition_decision(
        session,
        m.decision_id,
        m.state,
        detail=m.detail,
        epoch=m.epoch,
        now=m.now,
        expected=m.expected,
        error=m.error,
        pause_s=m.pause_s,
        lost_steps=m.lost_steps,
        generation=m.generation,
        to_replicas=m.to_replicas,
    )


def transition_decisions(
    session: Session, moves: Sequence[Move]
) -> list[DecisionRecord | Exception]:
    """:func:`decisions.transition_decision` for each of ``moves`` in the caller's
    transaction; each gets the record it would have got alone, or in its place the
    error it would have raised (DecisionNotFound, StaleEpoch, DecisionChanged,
    InvalidTransition, InvalidArgument), nothing written for it. The checks run in
    the single path's order, so an item with several faults gets the same one.

    A move whose job's row another transaction holds (or whose job is not found) gets
    :class:`NotBatched`, nothing written for it: the caller writes it alone, so that one
    stuck transaction holds that move only, not the batch.

    At most one move per job (hence per decision): two of one decision would have to
    apply in order, two final ones of one job would both update its row, and a job
    fenced at two epochs is ambiguous. Such a batch raises InvalidArgument: the whole
    batch fails and the caller writes each move alone. A row
    moved by another writer between the first read and the write raises StaleWrite, and
    the unit of work runs the batch again from its first read (past its attempts, the
    caller writes each move alone)."""
    n = len(moves)
    if n > MAX_BATCH:
        raise InvalidArgument(f"at most {MAX_BATCH} transitions a batch, got {n}")
    out: list[DecisionRecord | Exception | None] = [None] * n
    todo: list[int] = []
    for i, m in enumerate(moves):
        try:
            aware("now", m.now)
            DecisionState(m.state)
        except (InvalidArgument, ValueError) as exc:
            out[i] = exc
            continue
        todo.append(i)
    table = DECISIONS
    seen = {
        int(r.id): (str(r.job_id), DecisionState(r.state))
        for r in session.execute(
            select(table.c.id, table.c.job_id, table.c.state).where(
                table.c.id.in_({moves[i].decision_id for i in todo})
            )
        )
    }
    epochs: dict[str, int] = {}
    found: list[int] = []
    for i in todo:
        m = moves[i]
        if m.decision_id not in seen:
            out[i] = DecisionNotFound(f"decision {m.decision_id} not found")
            continue
        job_id = seen[m.decision_id][0]
        if job_id in epochs:
            raise InvalidArgument(f"two transitions of job {job_id} in one batch")
        epochs[job_id] = m.epoch
        found.append(i)
    # One UPDATE for every job (check_epochs): it locks the jobs' rows on PostgreSQL,
    # as check_epoch does for one, so the states read above hold unless a writer came
    # between the read and the lock; the guarded UPDATE below sees that. A job whose row
    # another transaction holds is skipped, not waited for: its move is written alone.
    stale, unsure = check_epochs_unless_locked(session, epochs)
    pending: list[int] = []
    for i in found:
        job_id = seen[moves[i].decision_id][0]
        refused = stale.get(job_id)
        if refused is not None:
            out[i] = refused
        elif job_id in unsure:
            out[i] = NotBatched(f"job {job_id}: its row is held by another transaction")
        else:
            pending.append(i)
    written: dict[int, Any] = {}
    ready: list[int] = []
    for i in pending:
        m = moves[i]
        job_id, was = seen[m.decision_id]
        try:
            if m.expected is not None and DecisionState(m.expected) is not was:
                raise DecisionChanged(
                    f"decision {m.decision_id} of job {job_id}:"
                    f" expected {DecisionState(m.expected)}, found {was}"
                )
            DECISION_LIFECYCLE.check(
                was, DecisionState(m.state), what=f"{m.decision_id} of job {job_id}"
            )
            check_transition_args(m.pause_s, m.lost_steps, m.generation, m.to_replicas)
        except Exception as exc:  # the single path's refusals, before any write
            out[i] = exc
            continue
        ready.append(i)
    if ready:
        for row in _update_rows(
            session, [(moves[i], seen[moves[i].decision_id][1]) for i in ready]
        ):
            written[int(row.id)] = row
    done = [i for i in range(n) if moves[i].decision_id in written and out[i] is None]
    if done:
        session.execute(
            insert(EVENTS),
            [
                {
                    "decision_id": moves[i].decision_id,
                    "state": written[moves[i].decision_id].state,
                    "at": moves[i].now,
                    "detail": moves[i].detail,
                    "owner_epoch": moves[i].epoch,
                }
                for i in done
            ],
        )
    ends = [i for i in done if DecisionState(moves[i].state) in FINAL_STATES]
    if ends:
        _update_jobs_on_end(session, [(written[moves[i].decision_id], moves[i]) for i in ends])
    for i in done:
        m = moves[i]
        logger.info(
            "decision %d of job %s: %s -> %s (%s)",
            m.decision_id,
            seen[m.decision_id][0],
            seen[m.decision_id][1],
            DecisionState(m.state),
            m.detail,
            extra={"job_id": seen[m.decision_id][0], "decision_id": m.decision_id},
        )
        out[i] = decision_record(written[m.decision_id])
    assert all(r is not None for r in out)
    return [r for r in out if r is not None]


def _kept(name: str) -> ColumnElement[Any]:
    """The decision's column ``name`` set to its move's value, or kept where that is None
    (the single path leaves a None keyword out)."""
    c = DECISIONS.c[name]
    return func.coalesce(bindparam(f"m_{name}", type_=c.type), c)


# One statement for every move of a batch, executed many times (executemany: psycopg
# sends them in one pipeline, sqlite3 loops in C). Built and compiled once: a VALUES list
# of the moves was compiled anew for every batch, about half of a batch's CPU (10,000
# bound values coerced and named). Each row is guarded by the state it was read in.
_UPDATE_ROW: Final = (
    update(DECISIONS)
    .where(
        DECISIONS.c.id == bindparam("m_id", type_=DECISIONS.c.id.type),
        DECISIONS.c.state == bindparam("m_old", type_=DECISIONS.c.state.type),
    )
    .values(
        state=bindparam("m_new", type_=DECISIONS.c.state.type),
        updated_at=bindparam("m_now", type_=DECISIONS.c.updated_at.type),
        # The ORM's version counter (Decision.version_id_col), kept as it would.
        version=DECISIONS.c.version + 1,
        error=_kept("error"),
        pause_s=_kept("pause_s"),
        lost_steps=_kept("lost_steps"),
        generation=_kept("generation"),
        to_replicas=_kept("to_replicas"),
        ended_at=_kept("ended_at"),
    )
)

_READ_ROWS: Final = select(DECISIONS).where(DECISIONS.c.id.in_(bindparam("ids", expanding=True)))


def _update_rows(session: Session, items: Sequence[tuple[Move, DecisionState]]) -> list[Any]:
    """Every move's row updated (one statement, executed for each move), each guarded by
    the state it was read in, then the rows read back in one SELECT (an executemany
    returns no rows on SQLite).

    A row that no longer holds the state read fails the whole batch with StaleWrite: the
    unit of work runs it again from its first read, as the single path reads the row
    again. On PostgreSQL only a writer between the first read and the fencing UPDATE's
    lock can have moved it; on SQLite the first read already holds the write lock."""
    params = [
        {
            "m_id": m.decision_id,
            "m_old": was.value,
            "m_new": DecisionState(m.state).value,
            "m_now": m.now,
            "m_error": m.error,
            "m_pause_s": m.pause_s,
            "m_lost_steps": m.lost_steps,
            "m_generation": m.generation,
            "m_to_replicas": m.to_replicas,
            "m_ended_at": m.now if DecisionState(m.state) in FINAL_STATES else None,
        }
        for m, was in items
    ]
    result = session.connection().execute(_UPDATE_ROW, params)
    assert isinstance(result, CursorResult)
    if result.rowcount != len(items):
        raise StaleWrite(
            f"transition {len(items) - result.rowcount} of {len(items)} decision(s):"
            " changed between their read and the write"
        )
    return list(session.execute(_READ_ROWS, {"ids": [m.decision_id for m, _ in items]}).all())


# The jobs whose decision reached an end: decisions._update_job_on_end for each, one
# statement executed many times (one row per job: a batch has one move per job).
_UPDATE_JOB_ON_END: Final = (
    update(JOBS)
    .where(JOBS.c.job_id == bindparam("e_job_id", type_=JOBS.c.job_id.type))
    .values(
        last_resize_ended_at=bindparam("e_now", type_=JOBS.c.last_resize_ended_at.type),
        updated_at=bindparam("e_now", type_=JOBS.c.updated_at.type),
        version=JOBS.c.version + 1,
        current_replicas=case(
            (
                bindparam("e_completed", type_=Boolean),
                bindparam("e_to_replicas", type_=JOBS.c.current_replicas.type),
            ),
            else_=JOBS.c.current_replicas,
        ),
        # A generation only moves forward, whoever reported it first.
        generation=case(
            (
                bindparam("e_completed", type_=Boolean)
                & (JOBS.c.generation < bindparam("e_generation", type_=JOBS.c.generation.type)),
                bindparam("e_generation", type_=JOBS.c.generation.type),
            ),
            else_=JOBS.c.generation,
        ),
    )
)


def _update_jobs_on_end(session: Session, ended: Sequence[tuple[Any, Move]]) -> None:
    """``decisions._update_job_on_end`` for every job whose decision reached an end."""
    session.connection().execute(
        _UPDATE_JOB_ON_END,
        [
            {
                "e_job_id": row.job_id,
                "e_now": m.now,
                "e_completed": DecisionState(m.state) is DecisionState.COMPLETED,
                "e_to_replicas": row.to_replicas,
                "e_generation": row.generation,
            }
            for row, m in ended
        ],
    )
