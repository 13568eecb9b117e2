"""The contract of a leader lease backend (tide.services.scaler.leases.LeaseBackend), run
against both real ones: the lease row in SQL (DecisionStore) and the Kubernetes
Lease (tide/services/scaler/kube/lease.py) on the API server emulator, through the
official client. Then what is particular to the Lease: the fields it writes and
its 409s."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tide.base.errors import InvalidArgument
from tide.services.scaler.kube.client import raw
from tide.services.scaler.kube.lease import KubernetesLease
from tide.services.scaler.leases import LeaderElector, LeaseBackend, LeaseRecord, LeaseSettings
from tide.services.scaler.store import DecisionStore
from tide.services.store import db
from tide.services.testing.clock import FakeClock
from tide.services.testing.kube import KubeApiServer

pytestmark = pytest.mark.integration

T0 = datetime(2026, 12, 3, 10, 0, 0, tzinfo=UTC).timestamp()
NAME = "tide-scaler"
NS = "default"

Make = Callable[[str], LeaseBackend]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0)


@pytest.fixture
def kube() -> Iterator[KubeApiServer]:
    with KubeApiServer() as api:
        yield api


@pytest.fixture
def kclient(kube: KubeApiServer) -> Iterator[client.ApiClient]:
    cfg = client.Configuration()
    cfg.host = kube.host
    with client.ApiClient(cfg) as api:
        yield api


@pytest.fixture(params=["sql", "kubernetes"])
def make(request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock) -> Iterator[Make]:
    """A backend for each holder name, all on one lease."""
    if request.param == "sql":
        url = f"sqlite:///{tmp_path / 'scaler.db'}"
        db.upgrade(url)
        engine = db.make_engine(url)
        yield lambda holder: DecisionStore(engine, holder, clock)
        engine.dispose()
        return
    api: client.ApiClient = request.getfixturevalue("kclient")
    yield lambda holder: KubernetesLease(api, NS, holder, clock)


async def take(backend: LeaseBackend, duration_s: float = 15.0) -> LeaseRecord:
    return await backend.try_lease(NAME, f"{backend.owner_id}:1", duration_s=duration_s)


async def test_one_holder_until_the_lease_runs_out(make: Make, clock: FakeClock) -> None:
    a, b = make("a"), make("b")
    first = await take(a)
    assert (first.holder, first.epoch, first.address) == ("a", 1, "a:1")
    clock.advance(5)
    # b tries while a's lease runs: a keeps it, and b learns who leads.
    assert (await take(b)).holder == "a"
    clock.advance(5)
    renewed = await take(a)  # now good until 25
    assert (renewed.holder, renewed.epoch) == ("a", 1)
    clock.advance(10)
    assert (await take(b)).holder == "a"
    clock.advance(5)
    taken = await take(b)
    assert (taken.holder, taken.epoch, taken.address) == ("b", 2, "b:1")
    clock.advance(1)
    # a, back from a pause, finds it taken and does not get it back.
    back = await take(a)
    assert (back.holder, back.epoch) == ("b", 2)


async def test_a_released_lease_is_taken_at_once(make: Make, clock: FakeClock) -> None:
    a, b = make("a"), make("b")
    await take(a)
    clock.advance(1)
    assert not await b.release_lease(NAME)
    assert await a.release_lease(NAME)
    assert not await a.release_lease(NAME)
    taken = await take(b)
    assert (taken.holder, taken.epoch) == ("b", 2)


async def test_the_same_holder_after_an_expiry_gets_a_new_epoch(
    make: Make, clock: FakeClock
) -> None:
    a = make("a")
    await take(a, duration_s=3)
    clock.advance(3)
    # Its lease ran out: whatever it did meanwhile belongs to the old epoch.
    assert (await take(a, duration_s=3)).epoch == 2


async def test_of_two_taking_an_expired_lease_at_once_one_wins(
    make: Make, clock: FakeClock
) -> None:
    await take(make("a"), duration_s=2)
    clock.advance(2)
    for _ in range(5):
        b, c = make("b"), make("c")
        got = await asyncio.gather(take(b, duration_s=2), take(c, duration_s=2))
        assert got[0].holder == got[1].holder
        assert got[0].epoch == got[1].epoch
        clock.advance(2)
    final = await take(make("d"), duration_s=2)
    # One take per round, not two: a, then five winners, then d.
    assert final.epoch == 7


async def test_bad_requests_name_the_field(make: Make) -> None:
    with pytest.raises(InvalidArgument, match="duration_s"):
        await take(make("a"), duration_s=0)


async def test_electors_hand_over_when_the_leader_stops_renewing(
    make: Make, clock: FakeClock
) -> None:
    settings = LeaseSettings(duration_s=3.0, renew_s=0.2)
    a = LeaderElector(make("a"), clock, settings, address="a:1")
    b = LeaderElector(make("b"), clock, settings, address="b:1")
    events: list[str] = []

    async def elected(who: str, rec: LeaseRecord) -> None:
        events.append(f"{who} leads at epoch {rec.epoch}")

    def lost(who: str, why: str) -> None:
        events.append(f"{who} lost")

    ta = asyncio.create_task(a.run(lambda r: elected("a", r), lambda w: lost("a", w)))
    await asyncio.wait_for(a.wait_elected(), 10)
    following = asyncio.Event()

    async def follow(message: str) -> None:
        following.set()

    tb = asyncio.create_task(b.run(lambda r: elected("b", r), lambda w: lost("b", w), follow))
    try:
        await asyncio.wait_for(following.wait(), 10)
        assert a.may_act() and not b.may_act()
        assert b.follower_message().startswith("following a at a:1")
        ta.cancel()  # a stops renewing (dead, or paused)
        clock.advance(3.5)  # past a's lease: a's own view agrees it may not act
        assert not a.may_act()
        await asyncio.wait_for(b.wait_elected(), 10)
        assert events == ["a leads at epoch 1", "b leads at epoch 2"]
    finally:
        ta.cancel()
        tb.cancel()


# -- the Kubernetes Lease in particular ------------------------------------------------


def lease_object(kclient: client.ApiClient) -> dict[str, Any]:
    """The Lease as the API server has it, JSON as any tool reads it."""
    return raw(
        client.CoordinationV1Api(kclient).read_namespaced_lease(NAME, NS, _preload_content=False)
    )


async def test_the_lease_carries_what_kubernetes_tools_read(
    kclient: client.ApiClient, clock: FakeClock
) -> None:
    a = KubernetesLease(kclient, NS, "a", clock)
    await take(a, duration_s=14.5)
    spec = lease_object(kclient)["spec"]
    assert spec["holderIdentity"] == "a"
    assert spec["leaseDurationSeconds"] == 15  # whole seconds, rounded up
    assert spec["leaseTransitions"] == 0
    assert spec["renewTime"].startswith("2026-12-03T10:00:00")
    clock.advance(20)
    await take(KubernetesLease(kclient, NS, "b", clock))
    spec = lease_object(kclient)["spec"]
    assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("b", 1)
    assert spec["acquireTime"].startswith("2026-12-03T10:00:20")


async def test_a_conflict_is_read_again_never_overwritten(
    kube: KubeApiServer, kclient: client.ApiClient, clock: FakeClock
) -> None:
    a = KubernetesLease(kclient, NS, "a", clock)
    await take(a)
    clock.advance(20)

    def other_took_it(obj: dict[str, Any]) -> dict[str, Any]:
        spec = obj["spec"]
        spec.update(holderIdentity="x", renewTime=f"{spec['renewTime'][:11]}10:00:20.000000Z")
        spec["leaseTransitions"] = 1
        return obj

    # b's write hits a 409: x wrote first. b reads again and finds x leading.
    kube.conflict_next("leases", change=other_took_it)
    got = await take(KubernetesLease(kclient, NS, "b", clock))
    assert (got.holder, got.epoch) == ("x", 2)
    assert kube.stats.conflicts == 1
