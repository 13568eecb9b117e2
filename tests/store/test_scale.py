"""The store's costs that must not grow with the history or the fleet, on both engines:
reads of open decisions go through the partial index, start-up works in batches."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from tests.store.test_repo import JOB, T0, Factory, decide, make_job, move, own, tx
from tide.base.errors import InvalidArgument
from tide.services.scaler import store as repo
from tide.services.scaler.store import DecisionState as S
from tide.services.store.models.scaler import OPEN_PREDICATE, OPEN_STATES

pytestmark = pytest.mark.integration


def test_open_states_are_the_lifecycles_non_final_states() -> None:
    assert set(OPEN_STATES) == {s.value for s in S} - {s.value for s in repo.FINAL_STATES}
    assert OPEN_PREDICATE == "state IN ('PENDING', 'PREPARING', 'ACTUATING')"


@contextmanager
def captured(engine: sa.Engine) -> Iterator[list[tuple[str, Any]]]:
    """The SQL statements (and their parameters) run on ``engine`` meanwhile."""
    seen: list[tuple[str, Any]] = []

    def listen(conn: Any, cursor: Any, stmt: str, params: Any, ctx: Any, many: bool) -> None:
        seen.append((stmt, params))

    sa.event.listen(engine, "before_cursor_execute", listen)
    try:
        yield seen
    finally:
        sa.event.remove(engine, "before_cursor_execute", listen)


def plan_of(engine: sa.Engine, stmt: str, params: Any) -> str:
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            rows = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {stmt}", params).all()
            return "\n".join(str(r[-1]) for r in rows)
        # A handful of rows is a seq scan's job; forbidding it asks whether the
        # partial index's predicate matches the query at all.
        conn.exec_driver_sql("SET enable_seqscan = off")
        rows = conn.exec_driver_sql(f"EXPLAIN {stmt}", params).all()
        return "\n".join(str(r[0]) for r in rows)


def only_select(seen: list[tuple[str, Any]]) -> tuple[str, Any]:
    (found,) = [(s, p) for s, p in seen if s.lstrip().upper().startswith("SELECT")]
    return found


@pytest.mark.parametrize(
    "read",
    [
        pytest.param(lambda s: repo.active_decision(s, JOB), id="active_decision"),
        pytest.param(repo.non_final_decisions, id="non_final_decisions"),
        pytest.param(repo.active_decisions, id="active_decisions"),
    ],
)
def test_reads_of_open_decisions_use_the_partial_index(
    factory: Factory, engine: sa.Engine, read: Callable[[Session], Any]
) -> None:
    make_job(factory)
    epoch = own(factory)
    for i in range(20):
        d = decide(factory, epoch, at=T0 + timedelta(minutes=i))
        move(factory, d.id, S.ABORTED, epoch, at=T0 + timedelta(minutes=i, seconds=1))
    open_one = decide(factory, epoch, at=T0 + timedelta(hours=1))
    with captured(engine) as seen:
        tx(factory, read)
    stmt, params = only_select(seen)
    assert "ix_decisions_open" in plan_of(engine, stmt, params)
    assert tx(factory, lambda s: repo.active_decision(s, JOB)) == open_one
    assert tx(factory, repo.active_decisions) == {JOB: open_one}
    assert tx(factory, repo.non_final_decisions) == [open_one]


def test_jobs_are_acquired_in_one_batch(factory: Factory, engine: sa.Engine) -> None:
    jobs = [f"ml/j{i:03d}" for i in range(30)]
    for j in jobs:
        make_job(factory, j)
    own(factory, jobs[0], owner="old")
    with captured(engine) as seen:
        epochs = tx(
            factory,
            lambda s: repo.acquire_jobs_ownership(s, [*jobs, "ml/gone"], "new", now=T0),
        )
    # One UPDATE and one SELECT, whatever the number of jobs.
    assert len([s for s, _ in seen if s.lstrip().upper().startswith(("UPDATE", "SELECT"))]) == 2
    assert epochs == {j: (2 if j == jobs[0] else 1) for j in jobs}
    job = tx(factory, lambda s: repo.get_job(s, jobs[0]))
    assert (job.owner_id, job.owner_epoch) == ("new", 2)
    # The batch's epochs fence like a single acquire's.
    with pytest.raises(repo.StaleEpoch):
        decide(factory, 1, job_id=jobs[0])
    assert decide(factory, 2, job_id=jobs[0]).state is S.PENDING
    assert tx(factory, lambda s: repo.acquire_jobs_ownership(s, [], "new", now=T0)) == {}


def test_last_completed_decisions_of_many_jobs(factory: Factory, engine: sa.Engine) -> None:
    jobs = ["ml/a", "ml/b", "ml/c"]
    for j in jobs:
        make_job(factory, j)
    epochs = {j: own(factory, j) for j in jobs}
    want = {}
    for j in jobs[:2]:
        for i in range(3):
            at = T0 + timedelta(minutes=i)
            d = decide(factory, epochs[j], job_id=j, at=at)
            move(factory, d.id, S.PREPARING, epochs[j], at)
            move(factory, d.id, S.ACTUATING, epochs[j], at)
            want[j] = move(factory, d.id, S.COMPLETED, epochs[j], at)
        # A newer aborted one is not the last completed.
        d = decide(factory, epochs[j], job_id=j, at=T0 + timedelta(hours=1))
        move(factory, d.id, S.ABORTED, epochs[j], T0 + timedelta(hours=1))
    with captured(engine) as seen:
        got = tx(factory, lambda s: repo.last_completed_decisions(s, jobs))
    assert len([s for s, _ in seen if s.lstrip().upper().startswith("SELECT")]) == 2
    assert got == want
    assert tx(factory, lambda s: repo.last_completed_decisions(s, [])) == {}


def test_retention_deletes_old_final_decisions_with_their_events_in_batches(
    factory: Factory,
) -> None:
    from tests.store.test_repo import count
    from tide.services.store.models.scaler import Decision, DecisionEvent

    make_job(factory)
    epoch = own(factory)
    for i in range(5):
        d = decide(factory, epoch, at=T0 + timedelta(minutes=i))
        move(factory, d.id, S.ABORTED, epoch, at=T0 + timedelta(minutes=i, seconds=1))
    running = decide(factory, epoch, at=T0 + timedelta(minutes=10))
    cut = T0 + timedelta(hours=1)
    assert tx(factory, lambda s: repo.delete_decisions_before(s, cut, limit=3)) == 3
    assert tx(factory, lambda s: repo.delete_decisions_before(s, cut, limit=3)) == 2
    assert tx(factory, lambda s: repo.delete_decisions_before(s, cut, limit=3)) == 0
    # The one still running stays, with its event; nothing of the others is left.
    assert tx(factory, repo.non_final_decisions) == [running]
    assert (count(factory, Decision), count(factory, DecisionEvent)) == (1, 1)
    with pytest.raises(InvalidArgument, match="limit"):
        tx(factory, lambda s: repo.delete_decisions_before(s, cut, limit=0))


def test_rollup_retention_in_batches_oldest_first(factory: Factory) -> None:
    rows = [
        repo.RollupRecord(j, T0 + timedelta(minutes=m), 50.0, 50.0, 50.0, 1, 1)
        for j in ("ml/a", "ml/b")
        for m in range(3)
    ]
    tx(factory, lambda s: repo.write_rollups(s, rows))
    cut = T0 + timedelta(minutes=2)
    assert tx(factory, lambda s: repo.delete_rollups_before(s, cut, limit=3)) == 3
    assert tx(factory, lambda s: repo.delete_rollups_before(s, cut, limit=3)) == 1
    left = tx(factory, lambda s: repo.rollups_between(s, "ml/a", T0, T0 + timedelta(hours=1)))
    assert [r.minute for r in left] == [cut]
