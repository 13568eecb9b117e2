"""Sharded ingest (services/scaler/partials.py): the same stream of reports, split across
replicas that ship partial aggregates to the job's owner, gives the owner the windows,
coverage and rollups that one replica given every report holds."""

from __future__ import annotations

import random

import pytest

from services.scaler.ingest import IngestEngine, IngestSettings
from services.scaler.members import Member
from services.scaler.shards import assign, shard_of
from services.testing.clock import FakeClock
from services.testing.members import InMemoryMemberRegistry
from tests.scaler.support import report

pytestmark = pytest.mark.component

T0 = 1_800_000_000.0
JOBS = [f"ns/j{k}" for k in range(6)]
NODES = 12  # two per job; node n holds job n // 2
REPLICAS = ["r0", "r1", "r2"]
SHARDS = 8


def engine(clock: FakeClock) -> IngestEngine:
    reg = InMemoryMemberRegistry()
    for k, job in enumerate(JOBS):
        reg.set_members(job, [Member(f"j{k}-p{i}", f"j{k}-p{i}") for i in range(4)])
    # Staggered slot grids of 2 s buckets, the production default: the shipped slots
    # must land on the owner's grid.
    return IngestEngine(
        IngestSettings(stale_after_s=5.0), reg, clock, window_shape=lambda _j: (2.0, 3)
    )


def pods_of(node: int) -> list[str]:
    k = node // 2
    return [f"j{k}-p{(node % 2) * 2 + i // 4}" for i in range(8)]


def test_sharded_windows_match_a_single_replica() -> None:
    clock = FakeClock(T0)
    single = engine(clock)
    replicas = {r: engine(clock) for r in REPLICAS}
    owner_of = {j: assign(SHARDS, REPLICAS)[shard_of(j, SHARDS)] for j in JOBS}
    assert len(set(owner_of.values())) > 1  # the jobs are spread over replicas
    for name, e in replicas.items():
        e.forward = lambda job, me=name: owner_of[job] != me
    rng = random.Random(5)
    streams = {(r, n): replicas[r].open_stream() for r in REPLICAS for n in range(NODES)}
    single_streams = [single.open_stream() for _ in range(NODES)]
    # Each node reports to one replica, and moves to another now and then (a reconnect
    # behind the Service); some nodes stop reporting (stale coverage).
    at = {n: rng.choice(REPLICAS) for n in range(NODES)}
    silent = {3, 8}
    for sec in range(40):
        for n in range(NODES):
            if n in silent and sec >= 20:
                continue
            if rng.random() < 0.05:
                at[n] = rng.choice(REPLICAS)
            t = T0 + sec + rng.uniform(0.0, 0.99)
            utils = [rng.uniform(0.0, 100.0) for _ in range(8)]
            r = report(f"n{n}", sec + 1, utils=utils, pods=pods_of(n), t=t)
            single.process(single_streams[n], r)
            replicas[at[n]].process(streams[(at[n], n)], r)
        clock.advance(1.0)
        if sec % 3 == 2:  # a shipment every few seconds, to each job's owner
            for name, e in replicas.items():
                for p in e.take_partials():
                    replicas[owner_of[p.job_id]].merge_partials(name, [p])
    for name, e in replicas.items():
        for p in e.take_partials():
            replicas[owner_of[p.job_id]].merge_partials(name, [p])

    now = clock.now()
    for job in JOBS:
        owner = replicas[owner_of[job]]
        fresh = owner.fresh_gpus_of(job, now)
        assert fresh == single.fresh_gpus_of(job, now)
        assert owner.fresh_gpus(now).get(job, 0) == single.fresh_gpus(now).get(job, 0)
        want = single.window_view(job, now, 16, single.fresh_gpus_of(job, now))
        got = owner.window_view(job, now, 16, fresh)
        assert got.bucket_means == pytest.approx(want.bucket_means, nan_ok=True)
        assert (got.end_s, got.gpus_fresh) == (want.end_s, want.gpus_fresh)
    assert replicas[owner_of["ns/j1"]].fresh_gpus_of("ns/j1", now) == 8  # node 3 went quiet
    rows = sorted(
        (r.job_id, r.minute_s, r.samples, round(r.mean_pct, 9), r.min_pct, r.max_pct)
        for e in replicas.values()
        for r in e.rollups.take_complete(now + 120.0, {})
    )
    want_rows = sorted(
        (r.job_id, r.minute_s, r.samples, round(r.mean_pct, 9), r.min_pct, r.max_pct)
        for r in single.rollups.take_complete(now + 120.0, {})
    )
    assert rows == want_rows and rows
