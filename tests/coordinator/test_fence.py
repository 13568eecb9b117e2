"""The coordinator's writes fenced by its lease (tide/services/store/leases.py ``check_fence``)
on both engines: once another replica took the lease, a unit of the old leader is
refused whole (StaleLeader), the replica is told to stop, and the new leader's units
land."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from tide.base.errors import Conflict
from tide.services.coordinator.domain import JobRecord
from tide.services.coordinator.sql_store import SqlStore
from tide.services.coordinator.store import Unit
from tide.services.store import db
from tide.services.store.leases import Fence, StaleLeader, check_fence, try_lease

pytestmark = pytest.mark.integration

NAME = "tide-coordinator"
JOB = "ns/fenced"
T0 = datetime(2026, 12, 3, 10, 0, 0, tzinfo=UTC)
LEASE_S = 2.0


@pytest.fixture(params=["sqlite", pytest.param("pg", marks=pytest.mark.postgres)])
def factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    url = (
        f"sqlite:///{tmp_path / 'coord.db'}"
        if request.param == "sqlite"
        else request.getfixturevalue("pg_schema_url")
    )
    db.upgrade(url)
    engine = db.make_engine(url)
    yield db.make_session_factory(engine)
    engine.dispose()


def _take(factory: sessionmaker[Session], holder: str, now: datetime) -> Fence:
    lease = db.unit_of_work(
        factory, lambda s: try_lease(s, NAME, holder, f"{holder}:1", duration_s=LEASE_S, now=now)
    )
    assert lease.holder == holder
    return Fence(lease.name, lease.holder, lease.epoch)


def test_the_old_leaders_unit_is_refused_once_another_took_the_lease(
    factory: sessionmaker[Session],
) -> None:
    fenced: list[str] = []
    old = SqlStore(factory, lambda: T0.timestamp(), on_fenced=fenced.append)
    old.fence = _take(factory, "a", T0)
    job = JobRecord(job_id=JOB)
    old.save(Unit(job=job))

    new = SqlStore(factory, lambda: T0.timestamp())
    new.fence = _take(factory, "b", T0 + timedelta(seconds=LEASE_S))
    assert new.fence.epoch == old.fence.epoch + 1

    job.generation = 7
    version = job.version
    with pytest.raises(StaleLeader, match=r"now b \(epoch 2\)") as refused:
        old.save(Unit(job=job))
    assert isinstance(refused.value, Conflict)
    assert fenced == [str(refused.value)]
    assert job.version == version  # memory untouched: the unit did not commit

    [snap] = new.load_all()
    assert snap.job.generation == 0
    snap.job.generation = 3
    new.save(Unit(job=snap.job))
    [snap] = new.load_all()
    assert snap.job.generation == 3


def test_an_expired_lease_nobody_took_still_admits_its_holder(
    factory: sessionmaker[Session],
) -> None:
    store = SqlStore(factory, lambda: T0.timestamp())
    store.fence = _take(factory, "a", T0)
    # Its renewal is late, but no other replica leads: its writes are the only ones.
    store.save(Unit(job=JobRecord(job_id=JOB)))
    [snap] = store.load_all()
    assert snap.job.job_id == JOB


def test_a_fence_on_a_lease_never_taken_refuses(factory: sessionmaker[Session]) -> None:
    store = SqlStore(factory, lambda: T0.timestamp())
    store.fence = Fence(NAME, "a", 1)
    with pytest.raises(StaleLeader, match="nobody's"):
        store.save(Unit(job=JobRecord(job_id=JOB)))
    assert store.load_all() == []


@pytest.mark.postgres
def test_on_postgresql_a_takeover_waits_for_a_fenced_unit_in_flight(
    pg_schema_url: str,
) -> None:
    db.upgrade(pg_schema_url)
    engine = db.make_engine(pg_schema_url)
    factory = db.make_session_factory(engine)
    try:
        fence = _take(factory, "a", T0)
        later = T0 + timedelta(seconds=LEASE_S)
        with db.session_scope(factory) as session:
            check_fence(session, fence)  # the unit holds the lease row FOR SHARE
            with ThreadPoolExecutor(1) as pool:
                takeover = pool.submit(_take, factory, "b", later)
                # It cannot take the row while the unit is open, however long it waits.
                done, _ = wait([takeover], timeout=0.5)
                assert not done
                session.commit()
                assert takeover.result(timeout=10).epoch == fence.epoch + 1
        with db.session_scope(factory) as session, pytest.raises(StaleLeader):
            check_fence(session, fence)
    finally:
        engine.dispose()
