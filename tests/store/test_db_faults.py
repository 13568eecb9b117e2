"""tide.services.store.db under real faults: killed PostgreSQL connections, serialization
failures, lock waits, takeovers racing writes, and two SQLite processes."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from tests.store.support import no_sleep, sqlite_factory
from tests.support.pg import with_search_path
from tests.support.poll import wait_for
from tide.base.errors import Unavailable
from tide.services.scaler import store as repo
from tide.services.store import db

pytestmark = pytest.mark.integration

T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
JOB = "ml/resnet"


# --- PostgreSQL faults ----------------------------------------------------------------------


@pytest.fixture
def pg_factory(pg_admin: sa.Engine, pg_url: str) -> Iterator[sessionmaker[Session]]:
    schema = f"store_uow_{random.getrandbits(48):012x}"
    with pg_admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    url = with_search_path(pg_url, schema)
    db.upgrade(url)
    engine = db.make_engine(url)
    try:
        yield db.make_session_factory(engine)
    finally:
        engine.dispose()
        with pg_admin.connect() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.mark.postgres
def test_unit_of_work_survives_a_killed_postgres_connection(
    pg_factory: sessionmaker[Session], pg_admin: sa.Engine
) -> None:
    with db.session_scope(pg_factory) as s:
        repo.upsert_job(s, JOB, min_replicas=1, max_replicas=9, now=T0)
        epoch = repo.acquire_job_ownership(s, JOB, "scaler-a", now=T0)
    pids: list[int] = []
    sleeps: list[float] = []

    def fn(s: Session) -> repo.DecisionRecord:
        pid = s.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        pids.append(pid)
        decision = repo.create_decision(
            s,
            job_id=JOB,
            from_replicas=1,
            to_replicas=2,
            reason="MANUAL",
            trigger="MANUAL",
            message="",
            inputs={},
            epoch=epoch,
            now=T0,
        )
        if len(pids) == 1:
            # The server drops this session mid-transaction, as on a failover.
            with pg_admin.connect() as admin:
                killed = admin.execute(
                    sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}
                ).scalar_one()
            assert killed
            s.execute(sa.text("SELECT 1"))
        return decision

    decision = db.unit_of_work(pg_factory, fn, sleep=sleeps.append, what="test decision")
    assert len(pids) == 2 and pids[0] != pids[1]
    assert len(sleeps) == 1
    with db.session_scope(pg_factory, write=False) as s:
        page = repo.list_decisions(s)
        # The first attempt's insert died with its transaction: exactly one decision.
        assert [d.id for d in page.decisions] == [decision.id]
        assert len(repo.get_decision(s, decision.id).events) == 1


@pytest.mark.postgres
def test_unit_of_work_retries_a_serialization_failure(pg_factory: sessionmaker[Session]) -> None:
    with db.session_scope(pg_factory) as s:
        repo.upsert_job(s, JOB, min_replicas=1, max_replicas=99, now=T0)
    attempts: list[int] = []

    def fn(s: Session) -> int:
        current = repo.get_job(s, JOB).current_replicas
        if not attempts:
            # A concurrent transaction changes the row after our snapshot was taken.
            with db.session_scope(pg_factory) as other:
                repo.set_job_observed(other, JOB, now=T0, current_replicas=current + 10)
        attempts.append(current)
        s.execute(
            repo.JOBS.update().where(repo.JOBS.c.job_id == JOB).values(current_replicas=current + 1)
        )
        return current + 1

    result = db.unit_of_work(
        pg_factory, fn, isolation_level="REPEATABLE READ", sleep=lambda _s: None
    )
    # Attempt 1 saw 1 and failed with SQLSTATE 40001; attempt 2 saw the other write.
    assert attempts == [1, 11]
    assert result == 12


@pytest.mark.postgres
def test_fencing_holds_when_a_takeover_races_a_decision_write(
    pg_factory: sessionmaker[Session], pg_admin: sa.Engine
) -> None:
    """READ COMMITTED race: the old owner's fenced write waits for the takeover, then fails."""
    with db.session_scope(pg_factory) as s:
        repo.upsert_job(s, JOB, min_replicas=1, max_replicas=9, now=T0)
        old_epoch = repo.acquire_job_ownership(s, JOB, "scaler-a", now=T0)
    outcome: list[BaseException | repo.DecisionRecord] = []

    def old_owner_writes() -> None:
        try:
            with db.session_scope(pg_factory) as s:
                outcome.append(
                    repo.create_decision(
                        s,
                        job_id=JOB,
                        from_replicas=1,
                        to_replicas=2,
                        reason="MANUAL",
                        trigger="MANUAL",
                        message="",
                        inputs={},
                        epoch=old_epoch,
                        now=T0,
                    )
                )
        except BaseException as exc:
            outcome.append(exc)

    with db.session_scope(pg_factory) as takeover:
        new_epoch = repo.acquire_job_ownership(takeover, JOB, "scaler-b", now=T0)
        writer = threading.Thread(target=old_owner_writes)
        writer.start()
        # Poll until the old owner's fencing UPDATE is queued behind our row lock.
        wait_for(lambda: _lock_waiters(pg_admin) > 0, timeout_s=10, what="fenced write to block")
    writer.join(timeout=10)
    assert not writer.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], repo.StaleEpoch), outcome
    assert new_epoch == old_epoch + 1
    with db.session_scope(pg_factory, write=False) as s:
        assert repo.list_decisions(s).decisions == ()


def _lock_waiters(admin: sa.Engine) -> int:
    with admin.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE wait_event_type = 'Lock' AND datname = current_database() "
                    "AND query LIKE 'UPDATE jobs SET owner_epoch=jobs.owner_epoch%'"
                )
            ).scalar_one()
        )


@pytest.mark.postgres
def test_a_pooled_connection_killed_while_idle_is_replaced_without_a_retry(
    pg_factory: sessionmaker[Session], pg_admin: sa.Engine
) -> None:
    def backend_pid(s: Session) -> int:
        return int(s.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())

    first = db.unit_of_work(pg_factory, backend_pid, sleep=no_sleep)
    with pg_admin.connect() as admin:
        assert admin.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": first}).scalar()
    wait_for(lambda: not _backend_alive(pg_admin, first), timeout_s=10, what="backend to go away")
    # pool_pre_ping notices at checkout: no failed attempt, hence no backoff.
    second = db.unit_of_work(pg_factory, backend_pid, sleep=no_sleep)
    assert second != first


def _backend_alive(admin: sa.Engine, pid: int) -> bool:
    with admin.connect() as conn:
        return bool(
            conn.execute(
                sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p"), {"p": pid}
            ).scalar_one()
        )


def _increment_in_process(url: str, n: int, barrier: Any, results: Any) -> None:
    """Child process: n read-modify-write transactions; reports how many failed."""
    engine = db.make_engine(url, db.DbSettings(busy_timeout_s=10.0))
    factory = db.make_session_factory(engine)
    barrier.wait(timeout=60)  # both past their imports: now they really contend
    failed = 0
    for _ in range(n):
        try:
            with db.session_scope(factory, write=True) as s:
                current = repo.get_job(s, JOB).current_replicas
                repo.set_job_observed(s, JOB, now=T0, current_replicas=current + 1)
        except sa.exc.OperationalError:
            failed += 1
    engine.dispose()
    results.put(failed)


def test_two_sqlite_processes_writing_never_see_database_is_locked(tmp_path: Path) -> None:
    import multiprocessing

    factory = sqlite_factory(tmp_path)
    with db.session_scope(factory) as s:
        repo.upsert_job(s, JOB, min_replicas=1, max_replicas=10_000, now=T0)
    url = str(factory.kw["bind"].url)
    per_process = 40
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_increment_in_process, args=(url, per_process, barrier, results))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    try:
        failures = [results.get(timeout=90) for _ in procs]
        for p in procs:
            p.join(timeout=30)
        assert [p.exitcode for p in procs] == [0, 0]
        assert failures == [0, 0]
        with db.session_scope(factory, write=False) as s:
            assert repo.get_job(s, JOB).current_replicas == 1 + 2 * per_process
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        factory.kw["bind"].dispose()


@pytest.mark.postgres
def test_a_migration_slower_than_the_idle_bound_is_not_ended_by_it(
    pg_admin: sa.Engine, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A migration's Python between statements (alembic loading revisions) on a starved node:
    the session's idle-in-transaction bound must not end the upgrade."""
    from alembic import command

    schema = f"store_mig_{random.getrandbits(48):012x}"
    with pg_admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    url = with_search_path(pg_url, schema)
    real = command.upgrade

    def starved(cfg: Any, revision: str) -> None:
        cfg.attributes["connection"].exec_driver_sql("SELECT 1")
        threading.Event().wait(1.0)  # idle inside the migration's transaction, past the bound
        real(cfg, revision)

    monkeypatch.setattr(command, "upgrade", starved)
    try:
        db.upgrade(url, settings=db.DbSettings(idle_in_transaction_timeout_s=0.3))
        assert db.current_revision(url) is not None
    finally:
        with pg_admin.connect() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.mark.postgres
def test_postgres_session_timeouts_are_set(pg_factory: sessionmaker[Session]) -> None:
    url = pg_factory.kw["bind"].url.render_as_string(hide_password=False)
    engine = db.make_engine(
        url, db.DbSettings(lock_timeout_s=2.5, idle_in_transaction_timeout_s=30)
    )
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SHOW lock_timeout").scalar() == "2500ms"
            assert conn.exec_driver_sql("SHOW idle_in_transaction_session_timeout").scalar() == (
                "30s"
            )
            conn.rollback()  # the pool's reset must not undo them either
            assert conn.exec_driver_sql("SHOW lock_timeout").scalar() == "2500ms"
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_a_write_stuck_behind_a_lock_fails_over_to_retry_then_unavailable(
    pg_factory: sessionmaker[Session],
) -> None:
    with db.session_scope(pg_factory) as s:
        repo.upsert_job(s, JOB, min_replicas=1, max_replicas=9, now=T0)
    url = pg_factory.kw["bind"].url.render_as_string(hide_password=False)
    impatient = db.make_engine(url, db.DbSettings(lock_timeout_s=0.1))
    sleeps: list[float] = []
    try:
        # A stuck transaction holds the job's row lock for the whole test.
        with db.session_scope(pg_factory) as stuck:
            repo.acquire_job_ownership(stuck, JOB, "stuck", now=T0)
            with pytest.raises(Unavailable, match="lock timeout"):
                db.unit_of_work(
                    db.make_session_factory(impatient),
                    lambda s: repo.acquire_job_ownership(s, JOB, "other", now=T0),
                    retry=db.RetryPolicy(attempts=3, base_delay_s=0.0, max_delay_s=0.0),
                    sleep=sleeps.append,
                )
    finally:
        impatient.dispose()
    assert len(sleeps) == 2
