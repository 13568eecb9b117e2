"""The leader lease in SQL (tide/services/scaler/leases.py) on both engines, at the
level of its transactions (the contract every backend keeps, and the elector over
it, are in test_lease_contract.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.orm import Session, sessionmaker

from tide.base.errors import ConfigError, InvalidArgument
from tide.services.scaler.leases import LeaseSettings
from tide.services.store import db
from tide.services.store.leases import LeaseRecord, read_lease, release_lease, try_lease

pytestmark = pytest.mark.integration

T0 = datetime(2026, 12, 3, 10, 0, 0, tzinfo=UTC)
NAME = "tide-scaler"


@pytest.fixture
def factory(scaler_db_url: str) -> sessionmaker[Session]:
    engine = db.make_engine(scaler_db_url)
    yield db.make_session_factory(engine)
    engine.dispose()


def lease(
    factory: sessionmaker[Session], holder: str, at: float, duration_s: float = 15.0
) -> LeaseRecord:
    now = T0 + timedelta(seconds=at)
    return db.unit_of_work(
        factory, lambda s: try_lease(s, NAME, holder, f"{holder}:1", duration_s=duration_s, now=now)
    )


def test_one_holder_until_the_lease_runs_out(factory: sessionmaker[Session]) -> None:
    first = lease(factory, "a", 0)
    assert (first.holder, first.epoch) == ("a", 1)
    # b tries while a's lease runs: a keeps it, and b learns who leads.
    assert lease(factory, "b", 5).holder == "a"
    renewed = lease(factory, "a", 10)  # renewed: now good until 25
    assert (renewed.holder, renewed.epoch) == ("a", 1)
    assert lease(factory, "b", 20).holder == "a"
    taken = lease(factory, "b", 25)
    assert (taken.holder, taken.epoch, taken.address) == ("b", 2, "b:1")
    # a, back from a pause, finds it taken and does not get it back.
    assert lease(factory, "a", 26).holder == "b"


def test_a_released_lease_is_taken_at_once(factory: sessionmaker[Session]) -> None:
    lease(factory, "a", 0)
    now = T0 + timedelta(seconds=1)
    assert db.unit_of_work(factory, lambda s: release_lease(s, NAME, "a", now=now))
    assert not db.unit_of_work(factory, lambda s: release_lease(s, NAME, "b", now=now))
    assert lease(factory, "b", 1).holder == "b"
    got = db.unit_of_work(factory, lambda s: read_lease(s, NAME), write=False)
    assert got is not None and got.epoch == 2


def test_bad_lease_requests_name_the_field(factory: sessionmaker[Session]) -> None:
    with pytest.raises(InvalidArgument, match="holder"):
        lease(factory, "", 0)
    with pytest.raises(InvalidArgument, match="duration_s"):
        lease(factory, "a", 0, duration_s=0)
    with pytest.raises(ConfigError, match="lease_renew_s"):
        LeaseSettings(duration_s=10, renew_s=10)
