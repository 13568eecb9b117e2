"""When a follower tries the lease next: at its expiry, not up to a renew period
after it (what made a paused leader's takeover overrun its bound)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from tide.services.store.leader import LeaderElector, LeaseSettings
from tide.services.store.leases import LeaseRecord
from tide.services.testing.clock import FakeClock

pytestmark = pytest.mark.unit

T0 = datetime(2026, 12, 5, 10, 0, 0, tzinfo=UTC).timestamp()


class _Backend:
    owner_id = "b"

    async def try_lease(self, name: str, address: str, *, duration_s: float) -> LeaseRecord:
        raise AssertionError("not called")

    async def release_lease(self, name: str) -> bool:
        raise AssertionError("not called")


def _lease(holder: str, expires_in_s: float) -> LeaseRecord:
    at = datetime.fromtimestamp(T0, UTC)
    return LeaseRecord(
        name="x",
        holder=holder,
        address="",
        epoch=1,
        acquired_at=at,
        expires_at=datetime.fromtimestamp(T0 + expires_in_s, UTC),
    )


@pytest.fixture
def elector() -> LeaderElector:
    return LeaderElector(
        _Backend(),
        FakeClock(T0),
        LeaseSettings(duration_s=6.0, renew_s=2.0),
        address="b:1",
        name="x",
    )


def test_a_follower_tries_again_when_the_lease_it_saw_runs_out(elector: LeaderElector) -> None:
    assert elector._pause_s(_lease("a", 0.3)) == pytest.approx(0.35)
    assert elector._pause_s(_lease("a", 5.0)) == 2.0


def test_a_lease_expired_by_our_clock_yet_held_is_tried_every_renew_period(
    elector: LeaderElector,
) -> None:
    # The holder's clock runs ahead of ours: trying at once again would hammer the store.
    assert elector._pause_s(_lease("a", -1.0)) == 2.0
    assert elector._pause_s(None) == 2.0
    assert elector._pause_s(_lease("b", 0.3)) == 2.0
