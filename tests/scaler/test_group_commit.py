"""``DecisionStore.transition``'s group commit on both engines: concurrent transitions are
written together, each caller gets its own record or error, a batch that fails whole is
written move by move, and one decision's transitions apply in the order called."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa

from tide.services.scaler.store import DecisionRecord, DecisionState, DecisionStore, transitions
from tide.services.scaler.store import DecisionState as S
from tide.services.scaler.store.rows import JOBS
from tide.services.store import db
from tide.services.store.failures import StaleWrite
from tide.services.testing.clock import FakeClock

from .service_rig import T0

pytestmark = pytest.mark.component


@pytest.fixture
async def store(scaler_db_url: str) -> AsyncIterator[DecisionStore]:
    s = DecisionStore(db.make_engine(scaler_db_url), "scaler-a", FakeClock(T0))
    try:
        yield s
    finally:
        s.close()
        s.engine.dispose()


@pytest.fixture
def turns(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The decision ids of every batch the writer writes (a lone move takes the single path)."""
    seen: list[list[int]] = []
    real = transitions.transition_decisions

    def spy(session: Any, moves: Any) -> Any:
        seen.append([m.decision_id for m in moves])
        return real(session, moves)

    monkeypatch.setattr(transitions, "transition_decisions", spy)
    return seen


async def _decisions(store: DecisionStore, n: int, prefix: str = "ns/j") -> list[DecisionRecord]:
    jobs = [f"{prefix}{k}" for k in range(n)]
    for j in jobs:
        await store.upsert_job(j, min_replicas=1, max_replicas=8)
    await store.acquire_many(jobs)
    out = await store.create_many(
        [
            {
                "job_id": j,
                "from_replicas": 2,
                "to_replicas": 4,
                "reason": "SUSTAINED_HIGH_UTILIZATION",
                "trigger": "POLICY",
                "message": "m",
                "inputs": {},
            }
            for j in jobs
        ]
    )
    assert all(isinstance(d, DecisionRecord) for d in out)
    return [d for d in out if isinstance(d, DecisionRecord)]


async def _outcomes(calls: list[Any]) -> list[Any]:
    return list(await asyncio.gather(*calls, return_exceptions=True))


async def _take_over(store: DecisionStore, job_id: str) -> None:
    other = DecisionStore(store.engine, "scaler-b", store.clock)
    await other.acquire(job_id)


async def test_concurrent_transitions_are_one_batch_and_each_gets_its_own(
    store: DecisionStore, turns: list[list[int]]
) -> None:
    ds = await _decisions(store, 6)
    await _take_over(store, ds[4].job_id)  # its epoch here is stale now
    changed = dataclasses.replace(ds[3], state=S.PREPARING)  # not the row's state
    out = await _outcomes(
        [
            store.transition(ds[0], S.PREPARING, "plan"),
            store.transition(ds[1], S.PREPARING, "plan"),
            store.transition(ds[2], S.ABORTED, "gone", check_state=False, error="e"),
            store.transition(changed, S.ACTUATING, "act"),
            store.transition(ds[4], S.PREPARING, "plan"),
            store.transition(ds[5], S.COMPLETED, "skip"),
        ]
    )
    assert turns == [[d.id for d in ds]]
    assert [type(r).__name__ for r in out] == [
        "DecisionRecord",
        "DecisionRecord",
        "DecisionRecord",
        "DecisionChanged",
        "StaleEpoch",
        "InvalidTransition",
    ]
    assert str(out[3]) == (
        f"decision {ds[3].id} of job {ds[3].job_id}: expected PREPARING, found PENDING"
    )
    assert "epoch 1 is stale, owned by 'scaler-b' at epoch 2" in str(out[4])
    assert (out[2].state, out[2].error, out[2].version) == (S.ABORTED, "e", 2)
    for d, r in zip(ds[:3], out[:3], strict=True):
        got = await store.get_decision(d.id)
        assert got.decision == r
        assert [e.state for e in got.events] == [S.PENDING, r.state]
    for d in ds[3:]:
        got = await store.get_decision(d.id)
        assert (got.decision.state, len(got.events)) == (S.PENDING, 1)
    assert (await store.get_job(ds[2].job_id)).last_resize_ended_at is not None


async def test_a_lone_transition_takes_the_single_path(
    store: DecisionStore, turns: list[list[int]]
) -> None:
    (d,) = await _decisions(store, 1)
    moved = await store.transition(d, S.PREPARING, "plan")
    assert moved.state is S.PREPARING and turns == []


async def test_a_batch_refused_whole_is_written_move_by_move(
    store: DecisionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch refused as a whole after its writes (rows that kept changing): its
    transaction rolls back, each move is written alone and gets what it would have,
    the refused ones their errors, and no event is lost or written twice."""
    ds = await _decisions(store, 5)
    await _take_over(store, ds[1].job_id)
    real = transitions.transition_decisions
    failed: list[int] = []

    def broken(session: Any, moves: Any) -> Any:
        real(session, moves)
        failed.append(len(moves))
        raise StaleWrite("transition 5 decision(s): their state kept changing")

    monkeypatch.setattr(transitions, "transition_decisions", broken)
    out = await _outcomes(
        [
            store.transition(ds[0], S.PREPARING, "plan"),
            store.transition(ds[1], S.PREPARING, "plan"),
            store.transition(dataclasses.replace(ds[2], state=S.ACTUATING), S.COMPLETED, "x"),
            store.transition(ds[3], S.PREPARING, "plan"),
            store.transition(ds[4], S.FAILED, "boom", check_state=False, error="boom"),
        ]
    )
    assert failed and failed[0] == 5
    assert [type(r).__name__ for r in out] == [
        "DecisionRecord",
        "StaleEpoch",
        "DecisionChanged",
        "DecisionRecord",
        "DecisionRecord",
    ]
    for d, want in zip(ds, [S.PREPARING, S.PENDING, S.PENDING, S.PREPARING, S.FAILED], strict=True):
        got = await store.get_decision(d.id)
        assert got.decision.state is want
        assert [e.state for e in got.events] == (
            [S.PENDING] if want is S.PENDING else [S.PENDING, want]
        )


async def test_a_store_failure_of_a_batch_reaches_every_caller_and_nothing_is_written_again(
    store: DecisionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store failure past the retries (the connection lost at the commit) may hide a
    commit that landed: written again, each move would read DecisionChanged, which the
    controller records as FAILED. Every caller gets StoreUnavailable, the single path's
    answer, and reads its row back; here the commit did not land and nothing moved."""
    ds = await _decisions(store, 3)
    real = transitions.transition_decisions
    alone: list[int] = []
    real_alone = store._move_alone

    def broken(session: Any, moves: Any) -> Any:
        real(session, moves)
        raise sa.exc.OperationalError("COMMIT", {}, Exception("server closed the connection"))

    async def spy_alone(m: transitions.Move) -> DecisionRecord:
        alone.append(m.decision_id)
        return await real_alone(m)

    monkeypatch.setattr(transitions, "transition_decisions", broken)
    monkeypatch.setattr(store, "_move_alone", spy_alone)
    out = await _outcomes([store.transition(d, S.PREPARING, "plan") for d in ds])
    assert [type(r).__name__ for r in out] == ["StoreUnavailable"] * 3, out
    assert alone == []
    for d in ds:
        got = await store.get_decision(d.id)
        assert got.decision.state is S.PENDING
        assert [e.state for e in got.events] == [S.PENDING]


async def test_a_caller_cancelled_before_its_turn_is_not_written_and_none_waits_for_ever(
    store: DecisionStore,
) -> None:
    """Cancelled before its turn, a move is dropped (as a call cancelled in the executor's
    queue never ran); the writer cancelled, every caller still queued is cancelled."""
    ds = await _decisions(store, 3)
    first = asyncio.ensure_future(store.transition(ds[0], S.PREPARING, "plan"))
    dropped = asyncio.ensure_future(store.transition(ds[1], S.PREPARING, "plan"))
    await asyncio.sleep(0)  # both queued; the writer has not taken its turn
    dropped.cancel()
    assert (await first).state is S.PREPARING
    with pytest.raises(asyncio.CancelledError):
        await dropped
    assert (await store.get_decision(ds[1].id)).decision.state is S.PENDING

    # Two moves of one job: the second waits for the next turn, and the writer is cancelled.
    moved = asyncio.ensure_future(store.transition(ds[2], S.PREPARING, "plan"))
    waiting = asyncio.ensure_future(
        store.transition(dataclasses.replace(ds[2], state=S.PREPARING), S.ACTUATING, "go")
    )
    await asyncio.sleep(0)
    writer = store._mover
    assert writer is not None
    writer.cancel()
    await asyncio.gather(moved, waiting, return_exceptions=True)
    assert waiting.cancelled()
    assert store._moves == []


async def test_one_decisions_transitions_apply_in_the_order_called(
    store: DecisionStore, turns: list[list[int]]
) -> None:
    """Two moves of one decision queued together (the driver never does, the writer
    guards it): the second waits for the next turn, after the first is written."""
    a, b = await _decisions(store, 2)
    prepared = dataclasses.replace(a, state=S.PREPARING)
    acting = dataclasses.replace(a, state=S.ACTUATING)
    out = await _outcomes(
        [
            store.transition(a, S.PREPARING, "plan"),
            store.transition(prepared, S.ACTUATING, "act"),
            store.transition(b, S.PREPARING, "plan"),
            store.transition(acting, S.COMPLETED, "done", generation=1),
        ]
    )
    assert all(isinstance(r, DecisionRecord) for r in out), out
    assert turns == [[a.id, b.id]]  # then a's second and third moves, each alone
    got = await store.get_decision(a.id)
    assert [e.state for e in got.events] == [S.PENDING, S.PREPARING, S.ACTUATING, S.COMPLETED]
    assert [e.detail for e in got.events][1:] == ["plan", "act", "done"]


async def test_many_concurrent_lifecycles_lose_nothing(store: DecisionStore) -> None:
    """A burst of decisions driven to their end at once, as the controller does: every
    transition written once, in order, whatever batches the writer formed."""
    ds = await _decisions(store, 40, prefix="ns/burst")

    async def life(d: DecisionRecord) -> DecisionRecord:
        for state in (S.PREPARING, S.ACTUATING):
            d = await store.transition(d, state, state.value)
        return await store.transition(d, S.COMPLETED, "done", generation=2, to_replicas=4)

    ends = await asyncio.gather(*(life(d) for d in ds))
    assert all(e.state is S.COMPLETED and e.version == 4 for e in ends)
    page = await store.list_decisions(states=(DecisionState.COMPLETED,), page_size=100)
    assert len(page.decisions) == 40
    for d in ds[:5]:
        got = await store.get_decision(d.id)
        assert [e.state for e in got.events] == [S.PENDING, S.PREPARING, S.ACTUATING, S.COMPLETED]
    assert {(await store.get_job(d.job_id)).current_replicas for d in ds} == {4}


async def test_a_job_row_another_transaction_holds_holds_its_move_only(
    store: DecisionStore, turns: list[list[int]], scaler_db_url: str
) -> None:
    """PostgreSQL: a stuck transaction holds one job's row. The turn does not wait for
    it (up to lock_timeout_s, at each of the unit of work's attempts): the other moves
    are written and answered while it is held, and that job's move is written alone,
    by the single path, once the row is let go."""
    if store.engine.dialect.name != "postgresql":
        pytest.skip("on SQLite a turn's BEGIN IMMEDIATE holds the whole database")
    ds = await _decisions(store, 3)
    jobs = JOBS
    # Stuck for as long as the test says: no idle-in-transaction timeout ends it.
    other = db.make_engine(scaler_db_url, db.DbSettings(idle_in_transaction_timeout_s=0))
    with other.connect() as stuck:
        stuck.execute(
            sa.select(jobs.c.job_id).where(jobs.c.job_id == ds[1].job_id).with_for_update()
        )
        calls = [asyncio.ensure_future(store.transition(d, S.PREPARING, "plan")) for d in ds]
        # Well below lock_timeout_s (10 s): a turn that waited for the lock answers none.
        others = await asyncio.wait_for(asyncio.gather(calls[0], calls[2]), timeout=8.0)
        assert [r.state for r in others] == [S.PREPARING, S.PREPARING]
        assert not calls[1].done()
        stuck.rollback()
    other.dispose()
    held = await asyncio.wait_for(calls[1], timeout=30.0)
    assert held.state is S.PREPARING
    assert turns == [[d.id for d in ds]]  # one batch; the held move went alone
    for d in ds:
        got = await store.get_decision(d.id)
        assert [e.state for e in got.events] == [S.PENDING, S.PREPARING]


async def test_a_lone_move_on_a_held_job_row_holds_no_other_jobs_moves(
    store: DecisionStore, turns: list[list[int]], scaler_db_url: str
) -> None:
    """PostgreSQL: a turn of one move takes the single path, whose check_epoch waits for
    the job's row. Written beside the next turns, it holds none of them: the moves of
    other jobs queued after it are answered while a stuck transaction holds its row
    (the reviewer's repro: before, they waited up to lock_timeout_s at each attempt)."""
    if store.engine.dialect.name != "postgresql":
        pytest.skip("on SQLite a write's BEGIN IMMEDIATE holds the whole database")
    ds = await _decisions(store, 3)
    # Stuck for as long as the test says: no idle-in-transaction timeout ends it.
    other = db.make_engine(scaler_db_url, db.DbSettings(idle_in_transaction_timeout_s=0))
    with other.connect() as stuck:
        stuck.execute(
            sa.select(JOBS.c.job_id).where(JOBS.c.job_id == ds[0].job_id).with_for_update()
        )
        pid = stuck.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        lone = asyncio.ensure_future(store.transition(ds[0], S.PREPARING, "plan"))
        with other.connect() as look:  # until its single path waits for the row
            blocked = sa.text(
                "SELECT count(*) FROM pg_stat_activity WHERE :p = ANY(pg_blocking_pids(pid))"
            )
            while not look.execute(blocked, {"p": pid}).scalar_one():
                look.rollback()
                await asyncio.sleep(0.01)
        assert not lone.done()
        later = [store.transition(d, S.PREPARING, "plan") for d in ds[1:]]
        # Well below lock_timeout_s (10 s): behind the lone move they would answer none.
        others = await asyncio.wait_for(asyncio.gather(*later), timeout=8.0)
        assert [r.state for r in others] == [S.PREPARING, S.PREPARING]
        assert not lone.done()
        stuck.rollback()
    other.dispose()
    held = await asyncio.wait_for(lone, timeout=30.0)
    assert held.state is S.PREPARING
    assert turns == [[ds[1].id, ds[2].id]]  # the lone move took the single path
    for d in ds:
        got = await store.get_decision(d.id)
        assert [e.state for e in got.events] == [S.PENDING, S.PREPARING]


async def test_a_jobs_move_queued_while_its_last_is_written_alone_applies_after_it(
    store: DecisionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A move written alone runs beside the next turns; its job's next move waits in the
    queue until it is written, then is applied after it, while other jobs' moves go on."""
    a, b = await _decisions(store, 2)
    entered, gate = asyncio.Event(), asyncio.Event()
    real_alone = store._move_alone

    async def held(m: transitions.Move) -> DecisionRecord:
        if m.decision_id == a.id and m.state is S.PREPARING:
            entered.set()
            await gate.wait()  # a's first move stays in flight until the test lets it go
        return await real_alone(m)

    monkeypatch.setattr(store, "_move_alone", held)
    first = asyncio.ensure_future(store.transition(a, S.PREPARING, "plan"))
    await asyncio.wait_for(entered.wait(), timeout=10.0)
    assert a.job_id in store._alone
    second = asyncio.ensure_future(
        store.transition(dataclasses.replace(a, state=S.PREPARING), S.ACTUATING, "act")
    )
    assert (await asyncio.wait_for(store.transition(b, S.PREPARING, "plan"), 10.0)).version == 2
    assert not first.done() and not second.done()
    assert (await store.get_decision(a.id)).decision.state is S.PENDING
    gate.set()
    moved = await asyncio.wait_for(asyncio.gather(first, second), timeout=10.0)
    assert [r.state for r in moved] == [S.PREPARING, S.ACTUATING]
    got = await store.get_decision(a.id)
    assert [e.state for e in got.events] == [S.PENDING, S.PREPARING, S.ACTUATING]
    assert store._alone == {}


async def test_a_move_written_alone_in_a_loop_that_is_gone_holds_none_of_its_job(
    store: DecisionStore,
) -> None:
    """A move written alone in a loop that is gone (tests run a loop each) is never
    answered there: the next loop's writer must not keep that job's moves waiting."""
    (d,) = await _decisions(store, 1)

    def gone_loops_task() -> asyncio.Task[None]:
        loop = asyncio.new_event_loop()
        try:
            task = loop.create_task(asyncio.sleep(0))
            loop.run_until_complete(task)
            return task
        finally:
            loop.close()

    store._alone[d.job_id] = await asyncio.to_thread(gone_loops_task)
    moved = await asyncio.wait_for(store.transition(d, S.PREPARING, "plan"), timeout=10.0)
    assert moved.state is S.PREPARING
    assert store._alone == {}
