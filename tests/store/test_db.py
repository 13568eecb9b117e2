"""tide.services.store.db: engine settings, write transactions, and units of work that survive faults."""

from __future__ import annotations

import random
import sqlite3
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import REGISTRY
from sqlalchemy.orm import Session, sessionmaker

from tests.store.support import no_sleep, sqlite_factory
from tide.base.errors import ConfigError, Conflict, StoreUnavailable, Unavailable
from tide.services.scaler import store as repo
from tide.services.store import db
from tide.services.store.models.scaler import Job
from tide.services.testing.ports import free_port

pytestmark = pytest.mark.integration

T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
JOB = "ml/resnet"


# --- settings and engines -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"busy_timeout_s": 0}, "busy_timeout_s"),
        ({"pool_size": 0}, "pool_size"),
        ({"max_overflow": -1}, "max_overflow"),
        ({"pool_recycle_s": 0}, "pool_recycle_s"),
        ({"connect_timeout_s": 0}, "connect_timeout_s"),
        ({"pool_timeout_s": -1}, "pool_timeout_s"),
        ({"lock_timeout_s": -1}, "lock_timeout_s"),
        ({"idle_in_transaction_timeout_s": -1}, "idle_in_transaction_timeout_s"),
    ],
)
def test_bad_settings_name_the_field(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        db.DbSettings(**kw)


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"attempts": 0}, "attempts"), ({"base_delay_s": 1, "max_delay_s": 0.5}, "max_delay_s")],
)
def test_bad_retry_policy_names_the_field(kw: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        db.RetryPolicy(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "url",
    ["mysql://u@h/db", "postgresql+psycopg2://postgres@127.0.0.1/x", "not a url"],
)
def test_unsupported_urls_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError):
        db.make_engine(url)


def test_redact_url_hides_the_password() -> None:
    assert "s3cret" not in db.redact_url("postgresql+psycopg://u:s3cret@h/db")


def test_sqlite_pragmas(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'sub' / 'dir' / 'tide.db'}"  # parent folders are created
    engine = db.make_engine(url, db.DbSettings(busy_timeout_s=2.5))
    try:
        with engine.connect() as conn:

            def pragma(name: str) -> object:
                return conn.exec_driver_sql(f"PRAGMA {name}").scalar()

            assert pragma("journal_mode") == "wal"
            assert pragma("synchronous") == 2  # FULL
            assert pragma("foreign_keys") == 1
            assert pragma("busy_timeout") == 2500
    finally:
        engine.dispose()


def test_foreign_keys_are_enforced(factory: sessionmaker[Session]) -> None:
    # SQLite ignores foreign keys unless each connection turns them on.
    with pytest.raises(sa.exc.IntegrityError), db.session_scope(factory) as s:
        s.execute(
            sa.text(
                "INSERT INTO decision_events (decision_id, state, at, detail) "
                "VALUES (999, 'PENDING', '2026-12-01 12:00:00', '')"
            )
        )


def test_naive_datetimes_are_refused(factory: sessionmaker[Session]) -> None:
    with pytest.raises(sa.exc.StatementError, match="naive"), db.session_scope(factory) as s:
        s.add(
            Job(
                job_id=JOB,
                min_replicas=1,
                max_replicas=1,
                current_replicas=1,
                gpus_per_replica=1,
                policy_overrides={},
                autoscaling_paused=False,
                pause_reason="",
                generation=0,
                owner_epoch=0,
                owner_id="",
                created_at=datetime(2026, 1, 1),
                updated_at=T0,
            )
        )


# --- transactions ---------------------------------------------------------------------------


@pytest.fixture
def lite(tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    factory = sqlite_factory(tmp_path)
    yield factory
    bind = factory.kw["bind"]
    bind.dispose()


def _other_writer_blocked(tmp_path: Path) -> bool:
    """Whether another connection cannot take the write lock right now."""
    raw = sqlite3.connect(tmp_path / "tide.db", timeout=0, isolation_level=None)
    try:
        raw.execute("BEGIN IMMEDIATE")
        raw.execute("ROLLBACK")
        return False
    except sqlite3.OperationalError as exc:
        assert "locked" in str(exc)
        return True
    finally:
        raw.close()


def test_write_sessions_take_the_write_lock_at_begin(
    lite: sessionmaker[Session], tmp_path: Path
) -> None:
    with db.session_scope(lite, write=True) as s:
        s.execute(sa.text("SELECT 1"))  # a read only: the lock must already be held
        assert _other_writer_blocked(tmp_path)
    assert not _other_writer_blocked(tmp_path)
    with db.session_scope(lite, write=False) as s:
        s.execute(sa.text("SELECT count(*) FROM jobs"))
        assert not _other_writer_blocked(tmp_path)


def test_session_scope_rolls_back_on_error(factory: sessionmaker[Session]) -> None:
    with pytest.raises(RuntimeError), db.session_scope(factory) as s:
        repo.upsert_job(s, JOB, min_replicas=1, max_replicas=2, now=T0)
        raise RuntimeError("boom")
    with db.session_scope(factory, write=False) as s:
        assert repo.list_jobs(s) == []


def test_deferred_read_then_write_fails_where_immediate_waits(
    lite: sessionmaker[Session],
) -> None:
    """Why writers use BEGIN IMMEDIATE: the control experiment, deterministic."""
    with db.session_scope(lite) as s:
        repo.upsert_job(s, JOB, min_replicas=1, max_replicas=9, now=T0)
    # A deferred transaction reads, another writer commits, the first tries to write.
    with (
        pytest.raises(sa.exc.OperationalError, match="locked"),
        db.session_scope(lite, write=False) as a,
    ):
        repo.get_job(a, JOB)
        with db.session_scope(lite) as b:
            repo.set_job_observed(b, JOB, now=T0, current_replicas=5)
        repo.set_job_observed(a, JOB, now=T0, current_replicas=6)


def test_concurrent_sqlite_writers_never_see_database_is_locked(tmp_path: Path) -> None:
    """Threads doing read-modify-write transactions: all succeed, no update is lost."""
    factory = sqlite_factory(tmp_path, busy_timeout_s=10.0)
    with db.session_scope(factory) as s:
        repo.upsert_job(s, JOB, min_replicas=1, max_replicas=10_000, now=T0)
    threads_n, per_thread = 4, 40
    errors: list[BaseException] = []
    start = threading.Barrier(threads_n)

    def work() -> None:
        try:
            start.wait(timeout=10)
            for _ in range(per_thread):
                with db.session_scope(factory, write=True) as s:
                    current = repo.get_job(s, JOB).current_replicas
                    repo.set_job_observed(s, JOB, now=T0, current_replicas=current + 1)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    try:
        assert errors == []
        with db.session_scope(factory, write=False) as s:
            assert repo.get_job(s, JOB).current_replicas == 1 + threads_n * per_thread
    finally:
        factory.kw["bind"].dispose()


# --- units of work --------------------------------------------------------------------------


def test_unit_of_work_retries_a_busy_database_then_succeeds(tmp_path: Path) -> None:
    factory = sqlite_factory(tmp_path, busy_timeout_s=0.05)
    holder = sqlite3.connect(tmp_path / "tide.db", timeout=0, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    sleeps: list[float] = []
    attempts: list[int] = []

    def release_on_first_backoff(seconds: float) -> None:
        sleeps.append(seconds)
        if holder.in_transaction:
            holder.execute("ROLLBACK")

    def fn(s: Session) -> repo.JobRecord:
        attempts.append(1)
        return repo.upsert_job(s, JOB, min_replicas=1, max_replicas=2, now=T0)

    try:
        job = db.unit_of_work(
            factory, fn, sleep=release_on_first_backoff, rng=random.Random(1), what="test"
        )
    finally:
        holder.close()
        factory.kw["bind"].dispose()
    # BEGIN IMMEDIATE runs at fn's first statement; it timed out once, then fn ran again.
    assert (len(attempts), len(sleeps)) == (2, 1)
    assert job.job_id == JOB
    assert 0 <= sleeps[0] <= db.DEFAULT_RETRY.base_delay_s


def test_unit_of_work_gives_up_with_unavailable(tmp_path: Path) -> None:
    factory = sqlite_factory(tmp_path, busy_timeout_s=0.02)
    holder = sqlite3.connect(tmp_path / "tide.db", timeout=0, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    sleeps: list[float] = []
    policy = db.RetryPolicy(attempts=4, base_delay_s=0.1, max_delay_s=0.3)
    try:
        with pytest.raises(Unavailable, match="after 4 attempts"):
            db.unit_of_work(factory, repo.list_jobs, retry=policy, sleep=sleeps.append)
    finally:
        holder.close()
        factory.kw["bind"].dispose()
    assert len(sleeps) == 3
    assert all(0 <= d <= cap for d, cap in zip(sleeps, (0.1, 0.2, 0.3), strict=True))


def _failures(cause: str) -> float:
    value = REGISTRY.get_sample_value("tide_store_failures_total", {"cause": cause})
    return value or 0.0


def test_no_postgres_to_connect_to_is_store_unavailable_after_retries() -> None:
    """A refused connection ran nothing: retried, then UNAVAILABLE to the caller
    (before, the driver's error escaped as INTERNAL and ended background tasks)."""
    engine = db.make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/none")
    factory = db.make_session_factory(engine)
    sleeps: list[float] = []
    before = _failures("connection_failed")
    try:
        with pytest.raises(StoreUnavailable, match="after 3 attempts"):
            db.unit_of_work(
                factory, repo.list_jobs, retry=db.RetryPolicy(attempts=3), sleep=sleeps.append
            )
    finally:
        engine.dispose()
    assert len(sleeps) == 2
    assert _failures("connection_failed") == before + 1


def test_a_read_only_sqlite_store_is_unavailable_not_retried(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'tide.db'}"
    db.upgrade(url)
    # The URI form opens the file read-only even for root (a full or read-only volume).
    ro = db.make_engine(f"sqlite:///file:{tmp_path / 'tide.db'}?mode=ro&uri=true")
    sleeps: list[float] = []
    try:
        with pytest.raises(StoreUnavailable, match="cannot be written"):
            db.unit_of_work(
                db.make_session_factory(ro),
                lambda s: s.execute(sa.text("CREATE TABLE t (a INTEGER)")),
                sleep=sleeps.append,
            )
    finally:
        ro.dispose()
    assert sleeps == []


def test_unit_of_work_does_not_retry_logic_errors(factory: sessionmaker[Session]) -> None:
    calls: list[int] = []

    def fn(s: Session) -> None:
        calls.append(1)
        s.execute(sa.text("INSERT INTO jobs (job_id) VALUES ('ml/incomplete')"))

    with pytest.raises(sa.exc.IntegrityError):
        db.unit_of_work(factory, fn, sleep=no_sleep)
    assert calls == [1]


def test_unit_of_work_reruns_after_a_version_conflict(factory: sessionmaker[Session]) -> None:
    with db.session_scope(factory) as s:
        repo.upsert_job(s, JOB, min_replicas=1, max_replicas=9, now=T0)
    seen_versions: list[int] = []
    sleeps: list[float] = []

    def fn(s: Session) -> repo.JobRecord:
        row = s.get(Job, JOB)
        assert row is not None
        seen_versions.append(row.version)
        if len(seen_versions) == 1:
            # Another writer moves the version after our read (same transaction
            # here, so that it is deterministic on both engines).
            s.execute(repo.JOBS.update().values(version=repo.JOBS.c.version + 1))
        return repo.set_job_observed(s, JOB, now=T0, current_replicas=4)

    job = db.unit_of_work(factory, fn, sleep=sleeps.append)
    assert seen_versions == [1, 1]  # the first run rolled back, its bump with it
    assert len(sleeps) == 1
    assert job.current_replicas == 4


def test_unit_of_work_gives_up_on_versions_that_keep_moving(
    factory: sessionmaker[Session],
) -> None:
    with db.session_scope(factory) as s:
        repo.upsert_job(s, JOB, min_replicas=1, max_replicas=9, now=T0)
    runs: list[int] = []

    def fn(s: Session) -> None:
        runs.append(1)
        row = s.get(Job, JOB)
        assert row is not None
        s.execute(repo.JOBS.update().values(version=repo.JOBS.c.version + 1))
        row.current_replicas = 4
        s.flush()

    policy = db.RetryPolicy(attempts=3, base_delay_s=0.0, max_delay_s=0.0)
    with pytest.raises(db.StaleWrite) as info:
        db.unit_of_work(factory, fn, retry=policy, sleep=lambda _s: None)
    assert isinstance(info.value, Conflict)
    assert len(runs) == 3


def test_unit_of_work_never_retries_a_fencing_conflict(factory: sessionmaker[Session]) -> None:
    with db.session_scope(factory) as s:
        repo.upsert_job(s, JOB, min_replicas=1, max_replicas=9, now=T0)
        stale = repo.acquire_job_ownership(s, JOB, "a", now=T0)
        repo.acquire_job_ownership(s, JOB, "b", now=T0)

    def fn(s: Session) -> repo.DecisionRecord:
        return repo.create_decision(
            s,
            job_id=JOB,
            from_replicas=1,
            to_replicas=2,
            reason="MANUAL",
            trigger="MANUAL",
            message="",
            inputs={},
            epoch=stale,
            now=T0,
        )

    with pytest.raises(repo.StaleEpoch):
        db.unit_of_work(factory, fn, sleep=no_sleep)


def test_a_unit_of_work_runs_with_the_short_switch_interval(
    lite: sessionmaker[Session],
) -> None:
    # tide/services/common/gil.py: a worker thread running SQL gets the GIL back quickly.
    from tide.services.common.gil import SWITCH

    seen: list[int] = []
    db.unit_of_work(lite, lambda _s: seen.append(SWITCH.busy), write=False)
    assert seen == [1]
    assert SWITCH.busy == 0
