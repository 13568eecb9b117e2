"""The scaler's repository on both engines: round trips, the decision lifecycle, fencing, pages."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from tests.store.support import tx
from tide.base.errors import Conflict, InvalidArgument, NotFound, TideError
from tide.base.lifecycle import InvalidTransition
from tide.services.scaler import store as repo
from tide.services.scaler.store import DecisionState as S
from tide.services.store.db import is_retryable, session_scope
from tide.services.store.models.scaler import Decision, DecisionEvent, Job

pytestmark = pytest.mark.integration

T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
JOB = "ml/resnet"

R = TypeVar("R")

Factory = sessionmaker[Session]


def make_job(factory: Factory, job_id: str = JOB, **kw: Any) -> repo.JobRecord:
    args: dict[str, Any] = {"min_replicas": 2, "max_replicas": 8, "now": T0} | kw
    return tx(factory, lambda s: repo.upsert_job(s, job_id, **args))


def own(factory: Factory, job_id: str = JOB, owner: str = "scaler-a") -> int:
    return tx(factory, lambda s: repo.acquire_job_ownership(s, job_id, owner, now=T0))


def decide(
    factory: Factory,
    epoch: int,
    *,
    job_id: str = JOB,
    at: datetime = T0,
    exclusive: bool = True,
    inputs: dict[str, Any] | None = None,
) -> repo.DecisionRecord:
    return tx(
        factory,
        lambda s: repo.create_decision(
            s,
            job_id=job_id,
            from_replicas=2,
            to_replicas=4,
            reason="SUSTAINED_HIGH_UTILIZATION",
            trigger="POLICY",
            message="every bucket above 80 %",
            inputs=inputs or {"current_replicas": 2},
            epoch=epoch,
            now=at,
            exclusive=exclusive,
        ),
    )


def move(
    factory: Factory, decision_id: int, state: S, epoch: int, at: datetime = T0, **kw: Any
) -> repo.DecisionRecord:
    return tx(
        factory,
        lambda s: repo.transition_decision(
            s, decision_id, state, detail=f"to {state}", epoch=epoch, now=at, **kw
        ),
    )


def count(factory: Factory, model: type[Decision] | type[DecisionEvent]) -> int:
    with session_scope(factory, write=False) as s:
        return s.scalar(sa.select(sa.func.count()).select_from(model)) or 0


# --- jobs -----------------------------------------------------------------------------------


def test_job_round_trip_and_override_merge(factory: Factory) -> None:
    created = make_job(
        factory, initial_replicas=3, gpus_per_replica=2, policy_overrides={"cooldown_s": 60.0}
    )
    assert created.current_replicas == 3
    assert created.gpus_per_replica == 2
    assert created.created_at == T0
    assert created.created_at.tzinfo is not None

    later = T0 + timedelta(minutes=5)
    updated = make_job(
        factory,
        min_replicas=1,
        max_replicas=16,
        now=later,
        initial_replicas=7,  # ignored: the job exists
        policy_overrides={"sustain_s": 120.0, "cooldown_s": None},
    )
    assert (updated.min_replicas, updated.max_replicas) == (1, 16)
    assert updated.current_replicas == 3
    assert updated.gpus_per_replica == 2  # None keeps it
    assert updated.policy_overrides == {"sustain_s": 120.0}
    assert updated.updated_at == later
    assert updated.version == created.version + 1

    got = tx(factory, lambda s: repo.get_job(s, JOB))
    assert got == updated
    make_job(factory, "ml/bert")
    assert [j.job_id for j in tx(factory, repo.list_jobs)] == ["ml/bert", JOB]


@pytest.mark.parametrize(
    ("job_id", "kw", "match"),
    [
        ("noslash", {}, "job_id"),
        ("a/b/c", {}, "job_id"),
        ("/name", {}, "job_id"),
        ("ns/", {}, "job_id"),
        (JOB, {"min_replicas": 0}, "min_replicas"),
        (JOB, {"min_replicas": 4, "max_replicas": 3}, "max_replicas"),
        (JOB, {"initial_replicas": 9}, "initial_replicas"),
        (JOB, {"gpus_per_replica": 0}, "gpus_per_replica"),
        (JOB, {"now": datetime(2026, 1, 1)}, "timezone-aware"),
    ],
)
def test_upsert_job_rejects_bad_input(
    factory: Factory, job_id: str, kw: dict[str, Any], match: str
) -> None:
    with pytest.raises(InvalidArgument, match=match):
        make_job(factory, job_id, **kw)
    assert tx(factory, repo.list_jobs) == []


def test_missing_job_is_not_found(factory: Factory) -> None:
    with pytest.raises(NotFound, match="ml/none"):
        tx(factory, lambda s: repo.get_job(s, "ml/none"))
    with pytest.raises(NotFound):
        own(factory, "ml/none")
    with pytest.raises(NotFound):
        tx(factory, lambda s: repo.last_resize_end(s, "ml/none"))


def test_pause_needs_a_reason_and_resume_clears_it(factory: Factory) -> None:
    make_job(factory)
    with pytest.raises(InvalidArgument, match="reason"):
        tx(factory, lambda s: repo.set_paused(s, JOB, paused=True, reason=" ", now=T0))
    t1 = T0 + timedelta(seconds=10)
    paused = tx(factory, lambda s: repo.set_paused(s, JOB, paused=True, reason="debug", now=t1))
    assert (paused.autoscaling_paused, paused.pause_reason, paused.paused_at) == (True, "debug", t1)
    # Pausing again changes the reason, not when the pause began.
    again = tx(
        factory,
        lambda s: repo.set_paused(s, JOB, paused=True, reason="still", now=t1 + timedelta(1)),
    )
    assert (again.pause_reason, again.paused_at) == ("still", t1)
    resumed = tx(factory, lambda s: repo.set_paused(s, JOB, paused=False, reason="", now=t1))
    assert (resumed.autoscaling_paused, resumed.pause_reason, resumed.paused_at) == (
        False,
        "",
        None,
    )


def test_observed_generation_only_moves_forward(factory: Factory) -> None:
    make_job(factory)
    tx(factory, lambda s: repo.set_job_observed(s, JOB, now=T0, generation=5, current_replicas=3))
    job = tx(factory, lambda s: repo.set_job_observed(s, JOB, now=T0, generation=4))
    assert (job.generation, job.current_replicas) == (5, 3)


def test_timestamps_come_back_as_the_same_instant_in_utc(factory: Factory) -> None:
    plus9 = timezone(timedelta(hours=9))
    local = datetime(2026, 12, 1, 21, 0, 0, 123456, tzinfo=plus9)
    job = make_job(factory, now=local)
    got = tx(factory, lambda s: repo.get_job(s, JOB))
    assert got.created_at == local == job.created_at
    assert got.created_at.utcoffset() == timedelta(0)
    assert got.created_at.microsecond == 123456


def test_version_counter_turns_a_lost_update_into_conflict(factory: Factory) -> None:
    make_job(factory)
    # Two sessions read the same version (plain, deferred transactions); the
    # second writer must not overwrite the first silently.
    with factory() as a, factory() as b:
        row_a = a.get(Job, JOB)
        row_b = b.get(Job, JOB)
        assert row_a is not None and row_b is not None
        row_a.current_replicas = 5
        a.commit()
        row_b.current_replicas = 6
        dialect = b.get_bind().dialect.name
        # PostgreSQL: the version column catches it. SQLite: the reader's snapshot
        # is stale, so its upgrade to writer fails at once (SQLITE_BUSY_SNAPSHOT),
        # a retryable error; write sessions avoid it with BEGIN IMMEDIATE.
        expected = sa.orm.exc.StaleDataError if dialect == "postgresql" else sa.exc.OperationalError
        with pytest.raises(expected) as info:
            b.commit()
        if dialect == "sqlite":
            assert is_retryable(info.value)
    assert tx(factory, lambda s: repo.get_job(s, JOB)).current_replicas == 5


# --- fencing --------------------------------------------------------------------------------


def test_each_acquire_increments_the_epoch(factory: Factory) -> None:
    make_job(factory)
    assert own(factory, owner="a") == 1
    assert own(factory, owner="b") == 2
    assert own(factory, owner="b") == 3  # a restarted owner must fence its own old writes
    job = tx(factory, lambda s: repo.get_job(s, JOB))
    assert (job.owner_epoch, job.owner_id) == (3, "b")


def test_stale_owner_cannot_create_a_decision(factory: Factory) -> None:
    make_job(factory)
    old = own(factory, owner="a")
    new = own(factory, owner="b")
    with pytest.raises(Conflict, match="stale"):
        decide(factory, old)
    assert count(factory, Decision) == 0
    assert count(factory, DecisionEvent) == 0
    assert decide(factory, new).state is S.PENDING


def test_stale_owner_cannot_move_a_decision(factory: Factory) -> None:
    make_job(factory)
    old = own(factory, owner="a")
    d = decide(factory, old)
    new = own(factory, owner="b")
    with pytest.raises(repo.StaleEpoch):
        move(factory, d.id, S.PREPARING, old)
    detail = tx(factory, lambda s: repo.get_decision(s, d.id))
    assert detail.decision.state is S.PENDING
    assert [e.state for e in detail.events] == [S.PENDING]
    # The new owner resumes it.
    assert move(factory, d.id, S.ABORTED, new, error="owner changed").state is S.ABORTED


# --- decisions ------------------------------------------------------------------------------


def test_decision_lifecycle_records_every_event(factory: Factory) -> None:
    make_job(factory)
    epoch = own(factory)
    d = decide(factory, epoch, inputs={"window": [81.0, math.nan, 90.5], "free_gpus": -1})
    assert (d.state, d.from_replicas, d.to_replicas, d.ended_at) == (S.PENDING, 2, 4, None)
    assert tx(factory, lambda s: repo.active_decision(s, JOB)) == d

    steps = [(S.PREPARING, 1), (S.ACTUATING, 2), (S.COMPLETED, 3)]
    for state, sec in steps:
        extra: dict[str, Any] = {}
        if state is S.COMPLETED:
            extra = {"pause_s": 1.25, "generation": 7, "to_replicas": 3}
        moved = move(factory, d.id, state, epoch, T0 + timedelta(seconds=sec), **extra)
        assert moved.state is state
    end = T0 + timedelta(seconds=3)
    detail = tx(factory, lambda s: repo.get_decision(s, d.id))
    assert [e.state for e in detail.events] == [S.PENDING, S.PREPARING, S.ACTUATING, S.COMPLETED]
    assert [e.at for e in detail.events] == [T0] + [T0 + timedelta(seconds=s) for _, s in steps]
    assert detail.events[-1].detail == "to COMPLETED"
    dec = detail.decision
    assert (dec.pause_s, dec.generation, dec.to_replicas, dec.ended_at) == (1.25, 7, 3, end)
    # NaN cannot be stored in JSON on PostgreSQL; an empty bucket reads back as null.
    assert dec.inputs == {"window": [81.0, None, 90.5], "free_gpus": -1}
    assert dec.final

    job = tx(factory, lambda s: repo.get_job(s, JOB))
    assert (job.current_replicas, job.generation, job.last_resize_ended_at) == (3, 7, end)
    assert tx(factory, lambda s: repo.last_resize_end(s, JOB)) == end
    assert tx(factory, lambda s: repo.active_decision(s, JOB)) is None


def test_abort_ends_the_decision_but_keeps_replicas(factory: Factory) -> None:
    make_job(factory)
    epoch = own(factory)
    d = decide(factory, epoch)
    move(factory, d.id, S.PREPARING, epoch)
    end = T0 + timedelta(seconds=30)
    aborted = move(factory, d.id, S.ABORTED, epoch, end, error="barrier deadline")
    assert (aborted.error, aborted.ended_at) == ("barrier deadline", end)
    job = tx(factory, lambda s: repo.get_job(s, JOB))
    assert (job.current_replicas, job.last_resize_ended_at) == (2, end)


def _path_to(state: S) -> list[S]:
    """The states to walk from PENDING to ``state``."""
    order = [S.PREPARING, S.ACTUATING]
    if state is S.PENDING:
        return []
    if state in order:
        return order[: order.index(state) + 1]
    return [S.PREPARING, S.ACTUATING, state]


def test_transition_table_is_enforced_for_every_pair(factory: Factory) -> None:
    make_job(factory)
    epoch = own(factory)
    checked = 0
    for start in S:
        for target in S:
            d = decide(factory, epoch, exclusive=False)
            for step in _path_to(start):
                move(factory, d.id, step, epoch)
            allowed = target in repo.DECISION_LIFECYCLE.allowed(start)
            if allowed:
                assert move(factory, d.id, target, epoch).state is target
                continue
            events_before = len(tx(factory, lambda s, i=d.id: repo.get_decision(s, i)).events)
            # Not an edge: a bug in the caller (INTERNAL), not a race or a user error.
            with pytest.raises(InvalidTransition, match=f"{start.name} -> {target.name}"):
                move(factory, d.id, target, epoch)
            after = tx(factory, lambda s, i=d.id: repo.get_decision(s, i))
            assert after.decision.state is start
            assert len(after.events) == events_before
            checked += 1
    # 36 pairs, 9 allowed edges.
    assert checked == 27
    assert not issubclass(InvalidTransition, TideError)


def test_a_decision_moved_under_the_writer_is_a_race_not_a_bug(factory: Factory) -> None:
    make_job(factory)
    epoch = own(factory)
    d = decide(factory, epoch)
    move(factory, d.id, S.PREPARING, epoch)
    # The writer read PENDING; the row is PREPARING now: DecisionChanged (a Conflict),
    # and nothing is written, although PREPARING -> ABORTED would be an edge.
    with pytest.raises(repo.DecisionChanged, match="expected PENDING, found PREPARING"):
        move(factory, d.id, S.ABORTED, epoch, expected=S.PENDING)
    assert issubclass(repo.DecisionChanged, Conflict)
    after = tx(factory, lambda s: repo.get_decision(s, d.id))
    assert after.decision.state is S.PREPARING and len(after.events) == 2
    assert move(factory, d.id, S.ACTUATING, epoch, expected=S.PREPARING).state is S.ACTUATING


def test_one_active_decision_per_job(factory: Factory) -> None:
    make_job(factory)
    make_job(factory, "ml/other")
    epoch = own(factory)
    d = decide(factory, epoch)
    with pytest.raises(repo.DecisionInProgress, match=str(d.id)):
        decide(factory, epoch)
    # Another job is not blocked.
    decide(factory, own(factory, "ml/other"), job_id="ml/other")
    move(factory, d.id, S.FAILED, epoch, error="actuator refused")
    decide(factory, epoch)


def test_a_batch_of_decisions_refuses_per_job_and_writes_the_rest(factory: Factory) -> None:
    from tide.services.scaler.store.decisions import create_decisions

    for j in ("ml/a", "ml/b", "ml/c"):
        make_job(factory, j)
    ea, eb, ec = own(factory, "ml/a"), own(factory, "ml/b"), own(factory, "ml/c")
    own(factory, "ml/b", owner="scaler-b")  # ml/b's epoch eb is stale now
    busy = decide(factory, ec, job_id="ml/c")

    def item(job_id: str) -> dict[str, Any]:
        return {
            "job_id": job_id,
            "from_replicas": 2,
            "to_replicas": 4,
            "reason": "SUSTAINED_HIGH_UTILIZATION",
            "trigger": "POLICY",
            "message": "every bucket above 80 %",
            "inputs": {"current_replicas": 2, "nan": math.nan},
        }

    at = T0 + timedelta(seconds=5)
    out = tx(
        factory,
        lambda s: create_decisions(
            s,
            [item("ml/a"), item("ml/b"), item("ml/c"), item("ml/a")],
            epochs={"ml/a": ea, "ml/b": eb, "ml/c": ec},
            now=at,
        ),
    )
    a, b, c, again = out
    assert isinstance(b, repo.StaleEpoch)
    assert isinstance(c, repo.DecisionInProgress) and str(busy.id) in str(c)
    assert isinstance(again, repo.DecisionInProgress)  # the same job twice: once
    assert isinstance(a, repo.DecisionRecord)
    # What create_decision would have written: the record, its first event, its version.
    assert (a.job_id, a.state, a.from_replicas, a.to_replicas) == ("ml/a", S.PENDING, 2, 4)
    assert a.inputs == {"current_replicas": 2, "nan": None}
    assert a.created_at == at and a.version == 1
    got = tx(factory, lambda s: repo.get_decision(s, a.id))
    assert got.decision == a
    assert [(e.state, e.detail) for e in got.events] == [(S.PENDING, a.message)]
    assert count(factory, Decision) == 2 and count(factory, DecisionEvent) == 2
    moved = move(factory, a.id, S.PREPARING, ea)
    assert moved.version == 2
    with pytest.raises(repo.DecisionInProgress):
        decide(factory, ea, job_id="ml/a")


def test_a_batch_of_decisions_fences_all_its_jobs_in_one_statement(factory: Factory) -> None:
    """The round trips of a batch do not grow with its jobs: one fencing UPDATE of
    the jobs and one read of the open decisions (bench.tick's
    1,000-job burst wrote batches of 800 with one UPDATE each before)."""
    from tide.services.scaler.store.decisions import create_decisions

    jobs = [f"ml/j{i}" for i in range(12)]
    for j in jobs:
        make_job(factory, j)
    epochs = {j: own(factory, j) for j in jobs}
    seen: list[str] = []
    engine = factory.kw["bind"]

    def note(_c: Any, _cur: Any, statement: str, *_a: Any) -> None:
        seen.append(statement.split(None, 1)[0].upper())

    sa.event.listen(engine, "before_cursor_execute", note)
    try:
        out = tx(
            factory,
            lambda s: create_decisions(
                s,
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
                ],
                epochs=epochs,
                now=T0,
            ),
        )
    finally:
        sa.event.remove(engine, "before_cursor_execute", note)
    assert all(isinstance(d, repo.DecisionRecord) for d in out)
    assert seen.count("UPDATE") == 1
    # (The INSERTs: one statement each on PostgreSQL; SQLite's driver runs a
    # RETURNING insert row by row, in-process, no round trip.)
    assert seen.count("SELECT") == 1


def test_non_final_decisions_lists_what_a_restart_must_resume(factory: Factory) -> None:
    ids: dict[str, int] = {}
    for i, state in enumerate([S.PENDING, S.PREPARING, S.ACTUATING, S.COMPLETED, S.FAILED]):
        job_id = f"ml/j{i}"
        make_job(factory, job_id)
        epoch = own(factory, job_id)
        d = decide(factory, epoch, job_id=job_id, at=T0 + timedelta(seconds=i))
        for step in _path_to(state):
            move(factory, d.id, step, epoch)
        ids[state] = d.id
    pending = tx(factory, repo.non_final_decisions)
    assert [d.id for d in pending] == [ids[S.PENDING], ids[S.PREPARING], ids[S.ACTUATING]]


def test_missing_decision_is_not_found(factory: Factory) -> None:
    make_job(factory)
    with pytest.raises(repo.DecisionNotFound):
        tx(factory, lambda s: repo.get_decision(s, 12345))
    with pytest.raises(repo.DecisionNotFound):
        move(factory, 12345, S.PREPARING, own(factory))


# --- pagination -----------------------------------------------------------------------------


def _seed_many(factory: Factory, n: int) -> list[repo.DecisionRecord]:
    make_job(factory, "ml/a")
    make_job(factory, "ml/b")
    epochs = {"ml/a": own(factory, "ml/a"), "ml/b": own(factory, "ml/b")}
    out: list[repo.DecisionRecord] = []
    with session_scope(factory) as s:
        for i in range(n):
            job_id = "ml/a" if i % 3 else "ml/b"
            # Groups of 4 share a timestamp, so the id tiebreak is exercised.
            at = T0 + timedelta(seconds=i // 4)
            out.append(
                repo.create_decision(
                    s,
                    job_id=job_id,
                    from_replicas=2,
                    to_replicas=3,
                    reason="MANUAL",
                    trigger="MANUAL",
                    message=f"#{i}",
                    inputs={},
                    epoch=epochs[job_id],
                    now=at,
                    exclusive=False,
                )
            )
    return out


def _all_pages(factory: Factory, page_size: int, **filters: Any) -> list[repo.DecisionRecord]:
    seen: list[repo.DecisionRecord] = []
    token = ""
    for _ in range(10_000):
        page = tx(
            factory,
            lambda s, t=token: repo.list_decisions(s, page_size=page_size, page_token=t, **filters),
        )
        assert len(page.decisions) <= page_size
        seen.extend(page.decisions)
        token = page.next_page_token
        if not token:
            return seen
    raise AssertionError("pagination did not end")


def test_pagination_returns_every_decision_exactly_once_newest_first(factory: Factory) -> None:
    made = _seed_many(factory, 250)
    seen = _all_pages(factory, page_size=7)
    assert len(seen) == 250
    assert {d.id for d in seen} == {d.id for d in made}
    keys = [(d.created_at, d.id) for d in seen]
    assert keys == sorted(keys, reverse=True)

    # An exact multiple of the page size ends without an empty extra page.
    assert len(_all_pages(factory, page_size=125)) == 250
    last = tx(factory, lambda s: repo.list_decisions(s, page_size=250))
    assert last.next_page_token == ""


def test_pagination_with_filters(factory: Factory) -> None:
    made = _seed_many(factory, 60)
    since, until = T0 + timedelta(seconds=3), T0 + timedelta(seconds=10)
    expected = {d.id for d in made if d.job_id == "ml/a" and since <= d.created_at < until}
    seen = _all_pages(factory, page_size=4, job_id="ml/a", since=since, until=until)
    assert [d.id for d in seen] == sorted(expected, reverse=True)

    epoch = tx(factory, lambda s: repo.get_job(s, "ml/b")).owner_epoch
    finished = [d for d in made if d.job_id == "ml/b"][:5]
    for d in finished:
        move(factory, d.id, S.ABORTED, epoch)
    aborted = _all_pages(factory, page_size=2, states=[S.ABORTED])
    assert sorted(d.id for d in aborted) == sorted(d.id for d in finished)


def test_bad_page_arguments_are_invalid(factory: Factory) -> None:
    _seed_many(factory, 10)
    first = tx(factory, lambda s: repo.list_decisions(s, page_size=3, job_id="ml/a"))
    assert first.next_page_token
    for size in (0, 1001):
        with pytest.raises(InvalidArgument, match="page_size"):
            tx(factory, lambda s, n=size: repo.list_decisions(s, page_size=n))
    with pytest.raises(InvalidArgument, match="different filters"):
        tx(factory, lambda s: repo.list_decisions(s, page_token=first.next_page_token))
    for garbage in ("!!!", "eyJ0IjoxfQ", first.next_page_token[:-3]):
        with pytest.raises(InvalidArgument, match="page_token"):
            tx(factory, lambda s, t=garbage: repo.list_decisions(s, page_token=t))
