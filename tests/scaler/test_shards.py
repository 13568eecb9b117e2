"""Shard leases (tide/services/scaler/leases.py): the assignment, and replicas on one store
with a fake clock: every shard held by at most one replica at every moment, and
rebalanced when a replica joins, leaves cleanly or dies."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from tide.base.errors import ConfigError
from tide.services.scaler.leases import ShardLeases, ShardSettings, assign, shard_of
from tide.services.scaler.store import DecisionStore
from tide.services.store import db
from tide.services.testing.clock import FakeClock

SETTINGS = ShardSettings(shards=12, duration_s=3.0, renew_s=1.0)


@pytest.mark.unit
def test_assignment_spreads_shards_and_moves_only_what_it_must() -> None:
    members = ["r0", "r1", "r2"]
    before = assign(64, members)
    counts = {m: sum(1 for v in before.values() if v == m) for m in members}
    assert set(before) == set(range(64)) and min(counts.values()) >= 10
    after = assign(64, ["r0", "r1"])  # r2 leaves: only its shards move
    assert all(after[k] == m for k, m in before.items() if m != "r2")
    joined = assign(64, [*members, "r3"])  # r3 joins: shards move only to it
    assert all(joined[k] in (before[k], "r3") for k in range(64))
    assert assign(4, []) == {}
    assert shard_of("ns/job", 16) == shard_of("ns/job", 16) < 16


@pytest.mark.unit
def test_bad_shard_settings_name_the_field() -> None:
    with pytest.raises(ConfigError, match="shards=0"):
        ShardSettings(shards=0)
    with pytest.raises(ConfigError, match="shard_lease_renew_s"):
        ShardSettings(duration_s=5.0, renew_s=5.0)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def stores(scaler_db_url: str, clock: FakeClock) -> Iterator[dict[str, DecisionStore]]:
    engine = db.make_engine(scaler_db_url)
    yield {r: DecisionStore(engine, r, clock) for r in ("r0", "r1", "r2")}
    engine.dispose()


def replica(stores: dict[str, DecisionStore], clock: FakeClock, name: str) -> ShardLeases:
    return ShardLeases(stores[name], clock, SETTINGS, address=f"{name}:1")


def assert_exclusive(replicas: list[ShardLeases]) -> None:
    owned = [r.owned_shards() for r in replicas]
    for i, a in enumerate(owned):
        for b in owned[i + 1 :]:
            assert not a & b, f"a shard owned twice: {sorted(a & b)}"


async def rounds(replicas: list[ShardLeases], clock: FakeClock, n: int, seed: int = 0) -> None:
    """``n`` rounds, each replica stepping once in a random order, a renewal apart."""
    rng = random.Random(seed)
    for _ in range(n):
        for r in rng.sample(replicas, len(replicas)):
            await r.step()
            assert_exclusive(replicas)
        clock.advance(SETTINGS.renew_s)
        assert_exclusive(replicas)


@pytest.mark.integration
async def test_replicas_share_shards_and_rebalance(
    stores: dict[str, DecisionStore], clock: FakeClock
) -> None:
    r0, r1, r2 = (replica(stores, clock, n) for n in ("r0", "r1", "r2"))
    await rounds([r0], clock, 2)
    assert r0.owned_shards() == set(range(12))
    # r1 and r2 join: r0 hands over what the assignment gives them, no shard owned twice.
    await rounds([r0, r1, r2], clock, 4, seed=1)
    want = assign(12, ["r0", "r1", "r2"])
    for r in (r0, r1, r2):
        assert r.owned_shards() == {k for k, m in want.items() if m == r.me}
    # r2 leaves cleanly: its shards are taken on the next round.
    epochs = dict(r2.held)
    await r2.leave()
    await rounds([r0, r1], clock, 1)
    assert r0.owned_shards() | r1.owned_shards() == set(range(12))
    assert all(r0.held.get(k, r1.held.get(k, (0, 0)))[0] > e for k, (e, _) in epochs.items())


@pytest.mark.integration
async def test_a_dead_replicas_shards_wait_for_its_leases_to_run_out(
    stores: dict[str, DecisionStore], clock: FakeClock
) -> None:
    r0, r1 = replica(stores, clock, "r0"), replica(stores, clock, "r1")
    await rounds([r0, r1], clock, 3)
    dead = r1.owned_shards()
    assert dead
    # r1 stops renewing (killed). Its own clock says it stops acting when its leases
    # run out; r0 takes its shards only after that.
    for _ in range(5):
        await r0.step()
        assert not (r0.owned_shards() & r1.owned_shards())
        clock.advance(SETTINGS.renew_s)
    assert r0.owned_shards() == set(range(12)) and not r1.owned_shards()
    assert r0.members == ["r0"]
