"""Many decisions' lifecycle transitions in one transaction: ``transition_decision``'s
checks and writes for a batch, in a constant number of statements whatever its size.

When a thousand jobs tip together their decisions move together too: three
transitions each, one transaction each, were the burst's bound on PostgreSQL
(thousands of round trips; docs/scaler.md, "Group commit of transitions").
``DecisionStore.transition`` queues concurrent calls and writes each turn's queue
here: one read of the rows, one fencing UPDATE of all their jobs, one UPDATE of all
the rows (each guarded by the state it was read in, RETURNING it), one INSERT of all
the events and one UPDATE of the jobs that reach an end.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    ColumnElement,
    Float,
    Integer,
    String,
    Text,
    case,
    cast,
    column,
    func,
    insert,
    select,
    update,
    values,
)
from sqlalchemy.orm import Session

from tide.base.errors import InvalidArgument
from tide.services.scaler.errors import DecisionChanged, DecisionNotFound
from tide.services.scaler.store.decisions import (
    EVENTS,
    check_transition_args,
    transition_decision,
)
from tide.services.scaler.store.jobs import check_epochs
from tide.services.scaler.store.records import (
    DECISION_LIFECYCLE,
    FINAL_STATES,
    DecisionRecord,
    DecisionState,
)
from tide.services.scaler.store.rows import DECISIONS, JOBS, aware, decision_record
from tide.services.store.db import UTCDateTime
from tide.services.store.failures import StaleWrite

logger = logging.getLogger(__name__)

# Bound parameters per statement: SQLite allows 32,766, PostgreSQL 65,535; a move
# binds 11 in the rows' UPDATE. The store's writer takes at most this many a turn.
MAX_BATCH = 1000


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

    At most one move per job (hence per decision): two of one decision would have to
    apply in order, two final ones of one job would both update its row, and a job
    fenced at two epochs is ambiguous. Such a batch raises InvalidArgument, as does a
    job not found, and a row that kept changing raises StaleWrite: the whole batch
    fails and the caller writes each move alone."""
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
    # between the read and the lock; the guarded UPDATE below sees that.
    stale = check_epochs(session, epochs)
    pending: list[int] = []
    for i in found:
        refused = stale.get(seen[moves[i].decision_id][0])
        if refused is not None:
            out[i] = refused
        else:
            pending.append(i)
    old = {moves[i].decision_id: seen[moves[i].decision_id][1] for i in pending}
    written: dict[int, Any] = {}
    for _ in range(2):
        ready: list[int] = []
        for i in pending:
            m = moves[i]
            job_id, was = seen[m.decision_id][0], old[m.decision_id]
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
        for row in _update_rows(session, [(moves[i], old[moves[i].decision_id]) for i in ready]):
            written[int(row.id)] = row
        pending = [i for i in ready if moves[i].decision_id not in written]
        if not pending:
            break
        # Another writer moved these between the read and the lock: once more, as they are now.
        old.update(
            (int(r.id), DecisionState(r.state))
            for r in session.execute(
                select(table.c.id, table.c.state).where(
                    table.c.id.in_([moves[i].decision_id for i in pending])
                )
            )
        )
    else:
        raise StaleWrite(f"transition {len(pending)} decision(s): their state kept changing")
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
            old[m.decision_id],
            DecisionState(m.state),
            m.detail,
            extra={"job_id": seen[m.decision_id][0], "decision_id": m.decision_id},
        )
        out[i] = decision_record(written[m.decision_id])
    assert all(r is not None for r in out)
    return [r for r in out if r is not None]


def _update_rows(session: Session, items: Sequence[tuple[Move, DecisionState]]) -> list[Any]:
    """One UPDATE of every row from a VALUES list (a CTE: SQLite has no column list on
    a VALUES in FROM), each guarded by the state it was read in; RETURNING the rows
    that matched. A column whose value is NULL in the list keeps its value, as the
    single path leaves out a None keyword."""
    if not items:
        return []
    table = DECISIONS
    v = (
        values(
            column("id", BigInteger),
            column("old", String),
            column("new", String),
            column("now", UTCDateTime),
            column("error", Text),
            column("pause_s", Float),
            column("lost_steps", BigInteger),
            column("generation", BigInteger),
            column("to_replicas", Integer),
            column("ended_at", UTCDateTime),
            name="v",
        )
        .data(
            [
                (
                    m.decision_id,
                    was.value,
                    DecisionState(m.state).value,
                    m.now,
                    m.error,
                    m.pause_s,
                    m.lost_steps,
                    m.generation,
                    m.to_replicas,
                    m.now if DecisionState(m.state) in FINAL_STATES else None,
                )
                for m, was in items
            ]
        )
        .cte("v")
    )

    typed = session.get_bind().dialect.name == "postgresql"

    def kept(name: str, type_: Any) -> ColumnElement[Any]:
        # PostgreSQL types a VALUES column that is NULL in every row as text: the CAST
        # says what it holds. Not on SQLite, where CAST(... AS DATETIME) would make a
        # number of the text it stores.
        value = cast(v.c[name], type_) if typed else v.c[name]
        return func.coalesce(value, table.c[name])

    stmt = (
        update(table)
        .add_cte(v)
        .where(table.c.id == v.c.id, table.c.state == v.c.old)
        .values(
            state=v.c.new,
            updated_at=v.c.now,
            # The ORM's version counter (Decision.version_id_col), kept as it would.
            version=table.c.version + 1,
            error=kept("error", Text),
            pause_s=kept("pause_s", Float),
            lost_steps=kept("lost_steps", BigInteger),
            generation=kept("generation", BigInteger),
            to_replicas=kept("to_replicas", Integer),
            ended_at=kept("ended_at", UTCDateTime),
        )
        .returning(*table.c)
    )
    return list(session.execute(stmt).all())


def _update_jobs_on_end(session: Session, ended: Sequence[tuple[Any, Move]]) -> None:
    """``decisions._update_job_on_end`` for every job whose decision reached an end, in
    one UPDATE from a VALUES list (one row per job: the batch has one move per job)."""
    table = JOBS
    v = (
        values(
            column("job_id", String),
            column("now", UTCDateTime),
            column("completed", Boolean),
            column("to_replicas", Integer),
            column("generation", BigInteger),
            name="e",
        )
        .data(
            [
                (
                    row.job_id,
                    m.now,
                    DecisionState(m.state) is DecisionState.COMPLETED,
                    row.to_replicas,
                    row.generation,
                )
                for row, m in ended
            ]
        )
        .cte("e")
    )
    session.execute(
        update(table)
        .add_cte(v)
        .where(table.c.job_id == v.c.job_id)
        .values(
            last_resize_ended_at=v.c.now,
            updated_at=v.c.now,
            version=table.c.version + 1,
            current_replicas=case((v.c.completed, v.c.to_replicas), else_=table.c.current_replicas),
            # A generation only moves forward, whoever reported it first.
            generation=case(
                (v.c.completed & (table.c.generation < v.c.generation), v.c.generation),
                else_=table.c.generation,
            ),
        )
    )
