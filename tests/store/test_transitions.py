"""Transitions written as a batch (``transitions.transition_decisions``) on both engines:
each move gets what ``transition_decision`` alone gives it, the database ends up as the
single path leaves it, and the statements do not grow with the batch."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from tests.store.support import tx
from tide.base.errors import InvalidArgument
from tide.services.scaler import store as repo
from tide.services.scaler.store import DecisionState as S
from tide.services.scaler.store.rows import DECISIONS
from tide.services.scaler.store.transitions import (
    Move,
    NotBatched,
    transition_alone,
    transition_decisions,
)
from tide.services.store.db import DbSettings, make_engine, session_scope, unit_of_work
from tide.services.store.models.scaler import Decision, DecisionEvent, Job

pytestmark = pytest.mark.integration

T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
T1 = T0 + timedelta(seconds=7)

Factory = sessionmaker[Session]


def _job(factory: Factory, job_id: str, owner: str = "scaler-a") -> int:
    tx(factory, lambda s: repo.upsert_job(s, job_id, min_replicas=1, max_replicas=8, now=T0))
    return tx(factory, lambda s: repo.acquire_job_ownership(s, job_id, owner, now=T0))


def _decide(factory: Factory, job_id: str, epoch: int, *path: S) -> repo.DecisionRecord:
    d = tx(
        factory,
        lambda s: repo.create_decision(
            s,
            job_id=job_id,
            from_replicas=2,
            to_replicas=4,
            reason="SUSTAINED_HIGH_UTILIZATION",
            trigger="POLICY",
            message="m",
            inputs={},
            epoch=epoch,
            now=T0,
        ),
    )
    for state in path:
        d = tx(
            factory,
            lambda s, st=state, i=d.id: repo.transition_decision(
                s, i, st, detail="setup", epoch=epoch, now=T0
            ),
        )
    return d


def _snapshot(s: Session) -> tuple[list[Any], list[Any], list[Any]]:
    """Every row the transitions write, but the events' ids (a rolled-back sequence
    value is not given back on PostgreSQL)."""
    decisions = [tuple(r) for r in s.execute(sa.select(Decision.__table__).order_by("id"))]
    events = s.execute(
        sa.select(
            DecisionEvent.decision_id,
            DecisionEvent.state,
            DecisionEvent.at,
            DecisionEvent.detail,
            DecisionEvent.owner_epoch,
        ).order_by(DecisionEvent.decision_id, DecisionEvent.id)
    )
    jobs = [tuple(r) for r in s.execute(sa.select(Job.__table__).order_by("job_id"))]
    return decisions, [tuple(r) for r in events], jobs


def _same(a: repo.DecisionRecord | Exception, b: repo.DecisionRecord | Exception) -> bool:
    if isinstance(a, Exception) or isinstance(b, Exception):
        return type(a) is type(b) and str(a) == str(b)
    return a == b


def test_a_batch_gives_each_move_what_it_gets_alone(factory: Factory) -> None:
    """Good moves, a state changed under its caller, a stale epoch (also with a changed
    state: the epoch is checked first, as alone), a decision not found, an edge the table
    lacks and a bad argument: the same record or error each, and the same rows."""
    epochs = {j: _job(factory, j) for j in ("ml/a", "ml/b", "ml/c", "ml/d", "ml/e", "ml/f")}
    epochs |= {j: _job(factory, j) for j in ("ml/g", "ml/h", "ml/i")}
    a = _decide(factory, "ml/a", epochs["ml/a"])
    b = _decide(factory, "ml/b", epochs["ml/b"], S.PREPARING, S.ACTUATING)
    c = _decide(factory, "ml/c", epochs["ml/c"], S.PREPARING)
    d = _decide(factory, "ml/d", epochs["ml/d"])
    e = _decide(factory, "ml/e", epochs["ml/e"])
    f = _decide(factory, "ml/f", epochs["ml/f"], S.PREPARING, S.ACTUATING)
    g = _decide(factory, "ml/g", epochs["ml/g"], S.PREPARING)
    h = _decide(factory, "ml/h", epochs["ml/h"], S.PREPARING, S.ACTUATING)
    i = _decide(factory, "ml/i", epochs["ml/i"])
    _job(factory, "ml/d", owner="scaler-b")  # ml/d's epoch is stale now
    _job(factory, "ml/e", owner="scaler-b")
    moves = [
        Move(a.id, S.PREPARING, "plan", epochs["ml/a"], T1, expected=S.PENDING),
        Move(
            b.id,
            S.COMPLETED,
            "done",
            epochs["ml/b"],
            T1,
            expected=S.ACTUATING,
            pause_s=1.5,
            generation=3,
            to_replicas=3,
            lost_steps=2,
        ),
        Move(c.id, S.ACTUATING, "act", epochs["ml/c"], T1, expected=S.PENDING),  # changed
        Move(d.id, S.PREPARING, "plan", epochs["ml/d"], T1, expected=S.PENDING),  # stale
        Move(e.id, S.PREPARING, "plan", epochs["ml/e"], T1, expected=S.ACTUATING),
        Move(f.id, S.FAILED, "lost", epochs["ml/f"], T1, error="pods gone"),  # no check
        Move(g.id, S.COMPLETED, "skip", epochs["ml/g"], T1, expected=S.PREPARING),  # no edge
        Move(h.id, S.COMPLETED, "bad", epochs["ml/h"], T1, expected=S.ACTUATING, pause_s=-1.0),
        Move(999_999, S.PREPARING, "ghost", epochs["ml/i"], T1),
        Move(i.id, S.ABORTED, "abort", epochs["ml/i"], T1, expected=S.PENDING, error="x"),
    ]
    with session_scope(factory) as s:
        batched = transition_decisions(s, moves)
        after_batch = _snapshot(s)
        s.rollback()
    alone: list[repo.DecisionRecord | Exception] = []
    for m in moves:
        try:
            alone.append(tx(factory, lambda s, m=m: transition_alone(s, m)))
        except Exception as exc:
            alone.append(exc)
    with session_scope(factory, write=False) as s:
        after_alone = _snapshot(s)
    assert [type(r).__name__ for r in batched] == [
        "DecisionRecord",
        "DecisionRecord",
        "DecisionChanged",
        "StaleEpoch",
        "StaleEpoch",
        "DecisionRecord",
        "InvalidTransition",
        "InvalidArgument",
        "DecisionNotFound",
        "DecisionRecord",
    ]
    for x, y in zip(batched, alone, strict=True):
        assert _same(x, y), (x, y)
    assert after_batch == after_alone
    # What a completion and an abort write to the job, as alone.
    with session_scope(factory, write=False) as s:
        jb = repo.get_job(s, "ml/b")
        ji = repo.get_job(s, "ml/i")
    assert (jb.current_replicas, jb.generation, jb.last_resize_ended_at) == (3, 3, T1)
    assert ji.last_resize_ended_at == T1


def _count_statements(factory: Factory, n: int, *, stale: bool) -> dict[str, int]:
    jobs = [f"ml/n{n}-{k}" for k in range(n)]
    epochs = {j: _job(factory, j) for j in jobs}
    made = [_decide(factory, j, epochs[j], S.PREPARING, S.ACTUATING) for j in jobs]
    if stale:
        for j in jobs[::2]:
            _job(factory, j, owner="scaler-b")
    moves = [
        Move(
            d.id,
            S.COMPLETED if k % 2 else S.FAILED,
            "end",
            epochs[d.job_id],
            T1,
            expected=S.ACTUATING,
            generation=1,
        )
        for k, d in enumerate(made)
    ]
    seen: list[str] = []
    engine = factory.kw["bind"]

    def note(_c: Any, _cur: Any, statement: str, *_a: Any) -> None:
        seen.append(statement.lstrip().split(None, 1)[0].upper())

    sa.event.listen(engine, "before_cursor_execute", note)
    try:
        out = tx(factory, lambda s: transition_decisions(s, moves))
    finally:
        sa.event.remove(engine, "before_cursor_execute", note)
    assert len(out) == n
    return {k: seen.count(k) for k in set(seen)}


@pytest.mark.parametrize("stale", [False, True])
def test_a_batch_is_a_constant_number_of_statements(factory: Factory, stale: bool) -> None:
    """Read, fence, update (one statement executed for every move), read the rows back,
    insert the events, update the ended jobs (and on a refusal one read of the owners;
    SQLite adds its BEGIN): the same statements for 4 moves as for 40."""
    few = _count_statements(factory, 4, stale=stale)
    many = _count_statements(factory, 40, stale=stale)
    assert few == many
    assert sum(many.values()) <= 8, many


def test_a_batch_refuses_two_moves_of_one_job(factory: Factory) -> None:
    """The store's writer never builds one; if given, the batch fails whole (its caller
    writes each alone, in order) rather than apply them in an order not asked for."""
    epoch = _job(factory, "ml/a")
    d = _decide(factory, "ml/a", epoch)
    moves = [
        Move(d.id, S.PREPARING, "plan", epoch, T1, expected=S.PENDING),
        Move(d.id, S.ACTUATING, "act", epoch, T1, expected=S.PREPARING),
    ]
    with pytest.raises(InvalidArgument, match="two transitions"):
        tx(factory, lambda s: transition_decisions(s, moves))


def test_a_row_moved_between_the_read_and_the_write_runs_the_batch_again(
    factory: Factory,
) -> None:
    """Another writer moves one row after the batch read it (PostgreSQL: before the
    batch holds the job's lock; on SQLite the batch's first read already holds the
    write lock, so no writer can come between). The guarded UPDATE misses it, the batch
    fails with StaleWrite and the unit of work runs it again from its read: that move
    gets the DecisionChanged it gets alone, the others their records, each written once."""
    engine = factory.kw["bind"]
    if engine.dialect.name != "postgresql":
        pytest.skip("on SQLite no writer comes between a batch's read and its write")
    epochs = {j: _job(factory, j) for j in ("ml/a", "ml/b", "ml/c")}
    made = {j: _decide(factory, j, epochs[j]) for j in epochs}
    moves = [
        Move(made[j].id, S.PREPARING, "plan", epochs[j], T1, expected=S.PENDING) for j in epochs
    ]
    moved = made["ml/b"].id
    runs: list[str] = []

    def writer_between(_c: Any, _cur: Any, statement: str, *_a: Any) -> None:
        if statement.lstrip().upper().startswith("UPDATE DECISIONS") and "m_id" in statement:
            runs.append(statement)  # the batch's own, not the other writer's
            if len(runs) == 1:  # another connection, as another replica would
                with engine.connect() as other:
                    other.execute(
                        sa.update(DECISIONS)
                        .where(DECISIONS.c.id == moved)
                        .values(state=S.PREPARING.value, version=DECISIONS.c.version + 1)
                    )
                    other.commit()

    sa.event.listen(engine, "before_cursor_execute", writer_between)
    try:
        out = unit_of_work(factory, lambda s: transition_decisions(s, moves))
    finally:
        sa.event.remove(engine, "before_cursor_execute", writer_between)
    assert len(runs) == 2  # the batch ran twice
    assert [type(r).__name__ for r in out] == [
        "DecisionRecord",
        "DecisionChanged",
        "DecisionRecord",
    ]
    assert str(out[1]) == f"decision {moved} of job ml/b: expected PENDING, found PREPARING"
    with session_scope(factory, write=False) as s:
        events = s.execute(
            sa.select(DecisionEvent.decision_id, DecisionEvent.state).where(
                DecisionEvent.detail == "plan"
            )
        ).all()
    assert sorted(e.decision_id for e in events) == sorted(made[j].id for j in ("ml/a", "ml/c"))


def test_a_move_whose_job_row_another_transaction_holds_is_left_to_write_alone(
    factory: Factory,
) -> None:
    """PostgreSQL: a job's row held by another transaction is skipped, not waited for:
    its move gets NotBatched and nothing is written for it; the others are written."""
    engine = factory.kw["bind"]
    if engine.dialect.name != "postgresql":
        pytest.skip("on SQLite a batch's BEGIN IMMEDIATE holds the whole database")
    epochs = {j: _job(factory, j) for j in ("ml/a", "ml/b")}
    made = {j: _decide(factory, j, epochs[j]) for j in epochs}
    moves = [
        Move(made[j].id, S.PREPARING, "plan", epochs[j], T1, expected=S.PENDING) for j in epochs
    ]
    # Stuck for as long as the test says: no idle-in-transaction timeout ends it.
    other = make_engine(
        engine.url.render_as_string(hide_password=False),
        DbSettings(idle_in_transaction_timeout_s=0),
    )
    with other.connect() as stuck:
        stuck.execute(sa.select(Job.job_id).where(Job.job_id == "ml/b").with_for_update())
        out = tx(factory, lambda s: transition_decisions(s, moves))
        stuck.rollback()
    other.dispose()
    assert isinstance(out[0], repo.DecisionRecord) and out[0].state is S.PREPARING
    assert isinstance(out[1], NotBatched)
    with session_scope(factory, write=False) as s:
        assert repo.get_decision(s, made["ml/b"].id).decision.state is S.PENDING
