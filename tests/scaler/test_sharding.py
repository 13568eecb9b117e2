"""Sharded cores in one process (tide/services/scaler/sharding.py), on one store with a fake
clock: the owner of a job acts on it and the others forward its samples and refuse its
writes naming the owner; a shard given up is stopped before it is released (its
decision in flight cancelled) and its new owner resumes it under a higher epoch;
shipments to an owner that does not answer are dropped and counted, never queued."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from tests.scaler.support import report
from tide.services.scaler.engine.core import ScalerCore
from tide.services.scaler.errors import NotOwner
from tide.services.scaler.ingest import IngestSettings
from tide.services.scaler.leases import (
    SHARD_LEASE_PREFIX,
    ShardLeases,
    ShardSettings,
    assign,
    shard_of,
)
from tide.services.scaler.partials import NodeNotice
from tide.services.scaler.policy import Reason
from tide.services.scaler.sharding import Sharding
from tide.services.scaler.store import DecisionState, DecisionStore
from tide.services.store import db
from tide.services.testing.actuators import InMemoryActuator
from tide.services.testing.clock import FakeClock
from tide.services.testing.coordinator import InMemoryCoordinator, follow_actuator
from tide.services.testing.shards import InProcessPeers
from tide.v1 import telemetry_pb2

pytestmark = pytest.mark.component

T0 = 1_800_000_000.0
SETTINGS = ShardSettings(shards=8, duration_s=3.0, renew_s=1.0)
JOBS = [f"ns/j{k}" for k in range(6)]
SHIP_S = 0.05


@dataclass
class Replica:
    name: str
    core: ScalerCore
    sharding: Sharding
    coordinator: InMemoryCoordinator

    @property
    def address(self) -> str:
        return f"{self.name}:1"


@pytest.fixture
async def world(
    scaler_db_url: str,
) -> AsyncIterator[tuple[FakeClock, InProcessPeers, dict[str, Replica]]]:
    clock = FakeClock(T0)
    engine = db.make_engine(scaler_db_url)
    peers = InProcessPeers()
    replicas: dict[str, Replica] = {}
    actuator = InMemoryActuator()  # one cluster; a coordinator each, to stall one alone
    for name in ("r0", "r1"):
        coordinator = InMemoryCoordinator(step_s=0.0)
        follow_actuator(coordinator, actuator)
        for j in JOBS:
            coordinator.set_job(j, 2)
        store = DecisionStore(engine, name, clock)
        core = ScalerCore(
            store=store,
            actuator=actuator,
            coordinator=coordinator,
            clock=clock,
            ingest=IngestSettings(stale_after_s=5.0),
        )
        leases = ShardLeases(store, clock, SETTINGS, address=f"{name}:1")
        sharding = Sharding(core, leases, peers, ship_interval_s=SHIP_S)
        replicas[name] = Replica(name, core, sharding, coordinator)
        peers.cores[f"{name}:1"] = core
    for j in JOBS:
        await replicas["r0"].core.store.upsert_job(
            j, min_replicas=1, max_replicas=4, initial_replicas=2, gpus_per_replica=1
        )
    for r in replicas.values():
        await r.core.start_sharded()
    try:
        yield clock, peers, replicas
    finally:
        for r in replicas.values():
            await r.core.close()
        engine.dispose()


async def rounds(clock: FakeClock, replicas: list[Replica], n: int) -> None:
    for _ in range(n):
        for r in replicas:
            await r.sharding.round()
        clock.advance(SETTINGS.renew_s)
    await asyncio.sleep(0.01)  # the member watches fill the registries


def owners() -> dict[str, str]:
    want = assign(SETTINGS.shards, ["r0", "r1"])
    return {j: want[shard_of(j, SETTINGS.shards)] for j in JOBS}


async def test_the_owner_acts_the_other_forwards_and_names_it(
    world: tuple[FakeClock, InProcessPeers, dict[str, Replica]],
) -> None:
    clock, peers, rs = world
    await rounds(clock, list(rs.values()), 3)
    owner_of = owners()
    assert set(owner_of.values()) == {"r0", "r1"}, owner_of
    for j, o in owner_of.items():
        other = "r1" if o == "r0" else "r0"
        assert rs[o].core.acts_on(j) and not rs[other].core.acts_on(j)
        # Taken by its owner: a newer epoch than any the other ever held.
        assert rs[o].core.store.epochs[j] > rs[other].core.store.epochs.get(j, 0)
        with pytest.raises(NotOwner, match=f"owned by {o} at {o}:1"):
            await rs[other].core.request_resize(j, 3, "by hand", "t")

    # A node of a job r1 owns streams to r0: r0 keeps no window, the owner gets both GPUs.
    j = next(j for j, o in owner_of.items() if o == "r1")
    name = j.partition("/")[2]
    pods = [f"{name}-trainer-0", f"{name}-trainer-1"]
    r0, r1 = rs["r0"], rs["r1"]
    stream = r0.core.ingest.open_stream()
    r0.core.ingest.process(stream, report("n1", 1, utils=[90.0, 80.0], pods=pods, t=clock.now()))
    assert r1.core.ingest.fresh_gpus_of(j, clock.now()) == 0
    r0.sharding.ship()
    await asyncio.gather(*r0.sharding._in_flight.values())
    assert peers.calls == [("r1:1", "r0", [j])]
    assert r1.core.ingest.fresh_gpus_of(j, clock.now()) == 2
    assert r0.core.metrics.partials_shipped._value.get() == 1
    assert r0.core.metrics.partials_shipped_bytes._value.get() > 0
    assert r1.core.metrics.partials_received._value.get() == 0  # the servicer counts it


async def test_a_dead_owner_costs_one_shipment_in_flight_and_counts_drops(
    world: tuple[FakeClock, InProcessPeers, dict[str, Replica]],
) -> None:
    clock, peers, rs = world
    await rounds(clock, list(rs.values()), 3)
    j = next(j for j, o in owners().items() if o == "r1")
    name = j.partition("/")[2]
    pods = [f"{name}-trainer-0", f"{name}-trainer-1"]
    r0 = rs["r0"]
    peers.stalled.add("r1:1")
    stream = r0.core.ingest.open_stream()
    dropped = r0.core.metrics.partials_dropped
    for seq in range(1, 4):
        r0.core.ingest.process(
            stream, report("n1", seq, utils=[50.0, 50.0], pods=pods, t=clock.now())
        )
        r0.sharding.ship()
    # One shipment waits on the dead owner; the two after it were dropped, not queued.
    assert len(r0.sharding._in_flight) == 1
    assert dropped.labels("busy")._value.get() == 2
    await asyncio.gather(*r0.sharding._in_flight.values())
    assert dropped.labels("failed")._value.get() == 1
    assert len(peers.calls) == 1


async def test_a_shard_given_up_is_stopped_before_release_and_resumed_by_its_new_owner(
    world: tuple[FakeClock, InProcessPeers, dict[str, Replica]],
) -> None:
    clock, _peers, rs = world
    r0, r1 = rs["r0"], rs["r1"]
    # r0 alone: every shard, every job.
    await rounds(clock, [r0], 2)
    assert all(r0.core.acts_on(j) for j in JOBS)
    j = next(j for j, o in owners().items() if o == "r1")
    epoch_r0 = r0.core.store.epochs[j]
    # A decision in flight at r0 that does not finish: its coordinator is slow.
    r0.coordinator.step_s = 3600.0
    d = await r0.core.request_resize(j, 3, "by hand", "t")
    task = r0.core.controller.tasks[d.id]
    await asyncio.sleep(0.05)
    assert not task.done()

    seen: list[tuple[bool, str]] = []
    stop = r0.sharding.leases.on_stop
    assert stop is not None

    async def watched(shards: set[int]) -> None:
        await stop(shards)
        # Stopped: the decision's task is over, and the shard's lease is still r0's.
        k = shard_of(j, SETTINGS.shards)
        lease = await r0.core.store.live_leases(SHARD_LEASE_PREFIX + str(k))
        seen.append((task.done(), lease[0].holder if lease else ""))

    r0.sharding.leases.on_stop = watched
    await rounds(clock, [r1, r0, r1], 1)  # r1 joins, r0 gives its shards up, r1 takes them
    assert seen and seen[0] == (True, "r0"), seen
    assert not r0.core.acts_on(j) and r1.core.acts_on(j)
    assert r1.core.store.epochs[j] > epoch_r0
    # r1 resumes the decision r0 left in flight (its coordinator is quick: it may be
    # over already), and r0's last writes were refused by the new epoch.
    for _ in range(100):
        rec = (await r1.core.store.get_decision(d.id)).decision
        if rec.state is DecisionState.COMPLETED:
            break
        if r1.core.active.get(j) != d.id:
            # Finished between the read and this check: the store says so now.
            rec = (await r1.core.store.get_decision(d.id)).decision
            assert rec.state is DecisionState.COMPLETED, rec.state
            break
        clock.advance(0.5)  # the controller's waits are on the clock
        await asyncio.sleep(0.02)
    assert rec.state is DecisionState.COMPLETED


def noticed_report(
    clock: FakeClock, job: str, seq: int, *, deadline_in_s: float
) -> telemetry_pb2.NodeReport:
    """Node n1 holds trainer 1 of ``job`` (two GPUs) and announces its termination."""
    pod = f"{job.partition('/')[2]}-trainer-1"
    r = report("n1", seq, utils=[60.0, 60.0], pods=[pod, pod], t=clock.now())
    ev = r.events.add(kind=telemetry_pb2.NodeEvent.KIND_TERMINATION_NOTICE, detail="spot")
    ev.deadline.FromNanoseconds(int((clock.now() + deadline_in_s) * 1e9))
    return r


async def shipped(r: Replica) -> None:
    """Let a shipment scheduled now run, and wait for every one in flight."""
    for _ in range(3):
        await asyncio.sleep(0)
    await asyncio.gather(*r.sharding._in_flight.values())


async def test_a_notice_seen_by_a_non_owner_is_shipped_at_once_and_applied_once(
    world: tuple[FakeClock, InProcessPeers, dict[str, Replica]],
) -> None:
    clock, peers, rs = world
    await rounds(clock, list(rs.values()), 3)
    j = next(j for j, o in owners().items() if o == "r1")
    pod = f"{j.partition('/')[2]}-trainer-1"
    r0, r1 = rs["r0"], rs["r1"]
    stream = r0.core.ingest.open_stream()
    r0.core.ingest.process(stream, noticed_report(clock, j, 1, deadline_in_s=30.0))
    # Not a ship interval later: the notice scheduled a shipment of its own.
    await shipped(r0)
    assert [(a, s, [(n.job_id, n.node, n.pods) for n in ns]) for a, s, ns in peers.notices] == [
        ("r1:1", "r0", [(j, "n1", frozenset({pod}))])
    ]
    received = r1.core.metrics.notices_received
    assert received.labels("applied")._value.get() == 1
    assert r1.core.ingest.terminating_pods(j)[0] == {pod}
    # The owner plans the preemption exactly as from its own agent stream.
    d = await r1.core.evaluate(j)
    assert (d.reason, d.to_replicas) == (Reason.NODE_TERMINATION, 1)
    dec = (await r1.core.store.list_decisions(job_id=j)).decisions[0]
    assert dec.inputs["leaving_pods"] == [pod]
    assert dec.inputs["notice_plan"]["reason"] == "NOTICE"  # 30 s: the deadline rules
    # Resent with every shipment until the deadline: applied once, counted as duplicates.
    r0.sharding.ship()
    await shipped(r0)
    assert received.labels("applied")._value.get() == 1
    assert received.labels("duplicate")._value.get() == 1
    assert r0.core.metrics.notices_shipped._value.get() == 2
    # Past the deadline it is no longer sent; the owner's copy runs out stale_after_s
    # after the last one (the node and its pod are gone by then).
    clock.advance(31.0)
    r0.sharding.ship()
    await shipped(r0)
    assert len(peers.notices) == 2
    assert r1.core.ingest.terminating_pods(j)[0] == set()


async def test_a_notice_reaches_the_jobs_new_owner_within_one_shipment(
    world: tuple[FakeClock, InProcessPeers, dict[str, Replica]],
) -> None:
    clock, _peers, rs = world
    r0, r1 = rs["r0"], rs["r1"]
    await rounds(clock, [r0], 2)  # r0 alone: it owns every job
    j = next(j for j, o in owners().items() if o == "r1")
    stream = r0.core.ingest.open_stream()
    r0.core.ingest.process(stream, noticed_report(clock, j, 1, deadline_in_s=60.0))
    await shipped(r0)
    assert not r0.sharding._in_flight  # its own job: nothing to ship
    assert r0.core.ingest.terminating_pods(j)[0]
    await rounds(clock, [r1, r0, r1], 1)  # r1 joins and takes j's shard from r0
    assert r1.core.acts_on(j) and not r0.core.acts_on(j)
    assert not r1.core.ingest.terminating_pods(j)[0]
    await rounds(clock, [r0], 1)  # r0's next round reads who holds the shard now
    r0.core.ingest.process(
        stream, report("n1", 2, utils=[60.0, 60.0], pods=[f"{j[3:]}-trainer-1"] * 2, t=clock.now())
    )
    r0.sharding.ship()  # the next shipment carries the notice still active at r0
    await shipped(r0)
    assert r1.core.metrics.notices_received.labels("applied")._value.get() == 1
    d = await r1.core.evaluate(j)
    assert d.reason is Reason.NODE_TERMINATION


async def test_a_notice_for_a_job_not_owned_is_refused_and_counted(
    world: tuple[FakeClock, InProcessPeers, dict[str, Replica]],
) -> None:
    clock, _peers, rs = world
    await rounds(clock, list(rs.values()), 3)
    j = next(j for j, o in owners().items() if o == "r1")
    notice = NodeNotice(j, "n1", telemetry_pb2.NodeEvent.KIND_CORDONED, None, frozenset({"p"}))
    assert rs["r0"].core.receive_notices([notice]) == (0, 1)
    assert rs["r0"].core.metrics.notices_received.labels("refused")._value.get() == 1
    assert not rs["r0"].core.ingest.remote_notices


async def test_an_uncordon_is_shipped_to_the_owner_at_once_and_drops_its_copy(
    world: tuple[FakeClock, InProcessPeers, dict[str, Replica]],
) -> None:
    clock, peers, rs = world
    await rounds(clock, list(rs.values()), 3)
    j = next(j for j, o in owners().items() if o == "r1")
    pod = f"{j.partition('/')[2]}-trainer-1"
    r0, r1 = rs["r0"], rs["r1"]
    stream = r0.core.ingest.open_stream()
    cordon = report("n1", 1, utils=[60.0, 60.0], pods=[pod, pod], t=clock.now())
    cordon.events.add(kind=telemetry_pb2.NodeEvent.KIND_CORDONED, detail="drain")
    r0.core.ingest.process(stream, cordon)
    await shipped(r0)
    assert r1.core.ingest.terminating_pods(j)[0] == {pod}
    clock.advance(1.0)
    back = report("n1", 2, utils=[60.0, 60.0], pods=[pod, pod], t=clock.now())
    back.events.add(kind=telemetry_pb2.NodeEvent.KIND_UNCORDONED, detail="uncordon")
    r0.core.ingest.process(stream, back)
    # Not stale_after_s (5 s) after the last resend: the uncordon ships on its own, now.
    await shipped(r0)
    withdrawn = [n for _a, _s, ns in peers.notices for n in ns if n.withdrawn]
    assert [(n.job_id, n.node, n.pods) for n in withdrawn] == [(j, "n1", frozenset({pod}))]
    assert r1.core.ingest.terminating_pods(j)[0] == set()
    assert not r1.core.ingest.remote_notices[j]
    d = await r1.core.evaluate(j)
    assert d.reason is not Reason.NODE_TERMINATION
    # Resent for the staleness limit (a lost shipment costs one interval), a duplicate
    # at the owner; past it, no longer sent.
    applied = r1.core.metrics.notices_received.labels("applied")._value.get()
    r0.sharding.ship()
    await shipped(r0)
    assert r1.core.metrics.notices_received.labels("applied")._value.get() == applied
    assert r1.core.metrics.notices_received.labels("duplicate")._value.get() >= 1
    sent = len(peers.notices)
    clock.advance(6.0)
    r0.core.ingest.process(
        stream, report("n1", 3, utils=[60.0, 60.0], pods=[pod, pod], t=clock.now())
    )
    r0.sharding.ship()
    await shipped(r0)
    assert all(not n.withdrawn for _a, _s, ns in peers.notices[sent:] for n in ns)


def test_a_withdrawal_travels_apart_from_the_notices() -> None:
    """A replica that predates ``withdrawn`` must not read an uncordon as a cordon."""
    from tide.services.scaler.peers import notice_from_proto, ship_request

    kinds = telemetry_pb2.NodeEvent
    cordon = NodeNotice("ns/a", "n1", kinds.KIND_CORDONED, None, frozenset({"p"}))
    back = NodeNotice("ns/b", "n2", kinds.KIND_UNCORDONED, None, frozenset({"q"}))
    req = ship_request("r0", [], [cordon, back])
    assert [notice_from_proto(m) for m in req.notices] == [cordon]
    assert [notice_from_proto(m) for m in req.withdrawn] == [back]


async def five_reports(r: Replica, clock: FakeClock, node: str, job: str, *, ship: bool) -> None:
    """Five reports of ``node`` to ``r``, 0.2 s apart, of the job's two trainers' GPUs:
    GPU 0 at 10..50 %, GPU 1 at 90 % (a mean of 60 %); each shipped at once with ``ship``."""
    name = job.partition("/")[2]
    pods = [f"{name}-trainer-0", f"{name}-trainer-1"]
    stream = r.core.ingest.open_stream()
    for seq in range(1, 6):
        r.core.ingest.process(
            stream, report(node, seq, utils=[10.0 * seq, 90.0], pods=pods, t=clock.now())
        )
        if ship:
            r.sharding.ship()
            await asyncio.gather(*r.sharding._in_flight.values())
        clock.advance(0.2)


async def test_a_new_owner_adds_the_slots_it_shipped_to_the_dead_one(
    world: tuple[FakeClock, InProcessPeers, dict[str, Replica]],
) -> None:
    """r1 ships its node's samples of a job to r0; r0 dies; r1 takes the shard and its
    window holds those samples, as r0's did (tests/scaler/test_replay.py: the rest)."""
    clock, peers, rs = world
    r0, r1 = rs["r0"], rs["r1"]
    await rounds(clock, [r0, r1], 3)
    j = next(j for j, o in owners().items() if o == "r0")
    # Within r0's lease: r0 takes every shipment.
    await five_reports(r1, clock, "n1", j, ship=True)
    w0 = r0.core.ingest.windows[j]
    end = w0.slot_of(clock.now()) + 1
    had = w0.means(end, 4)
    assert any(m == m for m in had), had  # r0's window holds the shipped samples
    w1 = r1.core.ingest.windows.get(j)
    assert w1 is None or all(m != m for m in w1.means(end, 4))  # r1 forwarded them all
    del peers.cores["r0:1"]  # r0 is dead: its leases run out
    await rounds(clock, [r1], 6)
    assert r1.core.acts_on(j)
    got = r1.core.ingest.windows[j].means(end, 4)
    # Every sample once: GPU 0 at 10..50 %, GPU 1 at 90 %, five reports.
    assert [m for m in had if m == m] == pytest.approx([60.0])
    assert [m for m in got if m == m] == pytest.approx([60.0])


async def test_a_shard_given_up_hands_the_old_owners_own_samples_to_the_new_one(
    world: tuple[FakeClock, InProcessPeers, dict[str, Replica]],
) -> None:
    """r0 owns a job and its node streams to r0; r0 gives the shard up to r1: r1's
    window holds those samples after r0's next shipment, each once."""
    clock, _peers, rs = world
    r0, r1 = rs["r0"], rs["r1"]
    await rounds(clock, [r0], 2)
    j = next(j for j, o in owners().items() if o == "r1")
    assert r0.core.acts_on(j)
    await five_reports(r0, clock, "n0", j, ship=False)
    w0 = r0.core.ingest.windows[j]
    end = w0.slot_of(clock.now()) + 1
    had = [m for m in w0.means(end, 4) if m == m]
    assert had == pytest.approx([60.0])
    await rounds(clock, [r1, r0, r1], 1)  # r1 joins, r0 gives its shards up, r1 takes them
    assert not r0.core.acts_on(j) and r1.core.acts_on(j)
    assert j not in r0.core.ingest.windows  # dropped, so a return counts nothing twice
    await rounds(clock, [r0], 1)  # r0 reads r1's new lease
    r0.sharding.ship()
    await asyncio.gather(*r0.sharding._in_flight.values())
    got = [m for m in r1.core.ingest.windows[j].means(end, 4) if m == m]
    assert got == pytest.approx([60.0])
    r0.sharding.ship()  # a replay goes once per owner change
    await asyncio.gather(*r0.sharding._in_flight.values())
    slots = r1.core.ingest.windows[j].slots().values()
    assert (sum(v[0] for v in slots), sum(v[1] for v in slots)) == pytest.approx((600.0, 10))
