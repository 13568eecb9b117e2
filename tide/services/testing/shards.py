"""One stream of reports replayed two ways: into one ingest engine, and across replica
engines that ship partial aggregates to each job's owner (tide/services/scaler/partials.py).
:func:`compare_sharded` returns every difference between the owners' windows, coverage
and rollups and the single engine's; tests/scaler/test_partials.py and bench.scale
(``windows_match``) use it. :class:`InProcessPeers` carries shipments between cores
in one process (tests/scaler/test_sharding.py)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterable, Sequence

from tide.base.errors import Unavailable
from tide.base.timeconv import ts_from_seconds
from tide.services.scaler.engine.core import ScalerCore
from tide.services.scaler.ingest import Ingest, IngestSettings
from tide.services.scaler.leases import assign, shard_of
from tide.services.scaler.members import Member
from tide.services.scaler.partials import JobPartial, NodeNotice
from tide.services.scaler.peers import ship_request
from tide.services.testing.clock import FakeClock
from tide.services.testing.members import InMemoryMemberRegistry
from tide.v1 import common_pb2, telemetry_pb2

T0 = 1_800_000_000.0
GPUS = 8


def _engine(clock: FakeClock, jobs: int) -> Ingest:
    reg = InMemoryMemberRegistry()
    for k in range(jobs):
        reg.set_members(f"ns/j{k}", [Member(f"j{k}-p{i}", f"j{k}-p{i}") for i in range(4)])
    # Staggered slot grids of 2 s buckets, the production default: shipped slots must
    # land on the owner's grid.
    return Ingest(IngestSettings(stale_after_s=5.0), reg, clock, window_shape=lambda _j: (2.0, 3))


def _report(node: int, seq: int, t: float, utils: list[float]) -> telemetry_pb2.NodeReport:
    r = telemetry_pb2.NodeReport(
        node_name=f"n{node}", boot_id="b", seq=seq, gpu_capacity=GPUS, sampled_at=ts_from_seconds(t)
    )
    k = node // 2  # two nodes per job, two pods of 4 GPUs per node
    for i, u in enumerate(utils):
        pod = f"j{k}-p{(node % 2) * 2 + i // 4}"
        r.gpus.add(
            index=i,
            utilization_pct=u,
            memory_used_bytes=1,
            memory_total_bytes=2,
            pod=common_pb2.PodRef(namespace="ns", name=pod, uid=pod),
        )
        if node % 2 == 0:
            # Half the nodes measure GPM: the partials carry its sums and its count,
            # and the owner's window must tell the GPUs without it apart.
            r.gpus[-1].sm_active_pct = u / 2
            r.gpus[-1].tensor_active_pct = u / 4
    return r


def compare_sharded(
    *,
    jobs: int = 6,
    replicas: int = 3,
    shards: int = 8,
    seconds: int = 40,
    ship_every_s: int = 3,
    seed: int = 5,
) -> list[str]:
    """Replay ``seconds`` of reports of ``2 * jobs`` nodes; nodes move between replicas
    now and then, and two go quiet half-way (stale coverage). Returns the differences."""
    clock = FakeClock(T0)
    names = [f"r{i}" for i in range(replicas)]
    single = _engine(clock, jobs)
    engines = {r: _engine(clock, jobs) for r in names}
    job_ids = [f"ns/j{k}" for k in range(jobs)]
    owner_of = {j: assign(shards, names)[shard_of(j, shards)] for j in job_ids}
    for name, e in engines.items():
        e.forward = lambda job, me=name: owner_of[job] != me
    nodes = 2 * jobs
    rng = random.Random(seed)
    streams = {(r, n): engines[r].open_stream() for r in names for n in range(nodes)}
    single_streams = [single.open_stream() for _ in range(nodes)]
    at = {n: rng.choice(names) for n in range(nodes)}
    silent = {3, nodes - 4}

    def ship() -> None:
        for name, e in engines.items():
            for p in e.take_partials():
                engines[owner_of[p.job_id]].merge_partials(name, [p])

    for sec in range(seconds):
        for n in range(nodes):
            if n in silent and sec >= seconds // 2:
                continue
            if rng.random() < 0.05:
                at[n] = rng.choice(names)  # a reconnect behind the Service
            t = T0 + sec + rng.uniform(0.0, 0.99)
            r = _report(n, sec + 1, t, [rng.uniform(0.0, 100.0) for _ in range(GPUS)])
            single.process(single_streams[n], r)
            engines[at[n]].process(streams[(at[n], n)], r)
        clock.advance(1.0)
        if sec % ship_every_s == ship_every_s - 1:
            ship()
    ship()

    diffs: list[str] = []
    now = clock.now()
    for job in job_ids:
        owner = engines[owner_of[job]]
        fresh, want_fresh = owner.fresh_gpus_of(job, now), single.fresh_gpus_of(job, now)
        if fresh != want_fresh:
            diffs.append(f"{job}: {fresh} fresh GPUs, single {want_fresh}")
        whole = owner.fresh_gpus(now).get(job, 0)
        if whole != want_fresh:
            diffs.append(f"{job}: fresh_gpus {whole}, single {want_fresh}")
        got = owner.window_view(job, now, 16, fresh)
        want = single.window_view(job, now, 16, want_fresh)
        for name in ("bucket_means", "sm_active_means", "tensor_active_means", "gpm_fractions"):
            g, w = getattr(got, name), getattr(want, name)
            same = all((a != a and b != b) or abs(a - b) < 1e-9 for a, b in zip(g, w, strict=True))
            if not same or got.end_s != want.end_s:
                diffs.append(f"{job}: window {name} {g}, single {w}")

    def rows(es: list[Ingest]) -> list[tuple[object, ...]]:
        return sorted(
            (r.job_id, r.minute_s, r.samples, round(r.mean_pct, 9), r.min_pct, r.max_pct)
            for e in es
            for r in e.rollups.take_complete(now + 120.0, {})
        )

    sharded_rows, single_rows = rows(list(engines.values())), rows([single])
    if sharded_rows != single_rows or not single_rows:
        diffs.append(f"rollups: {len(sharded_rows)} rows, single {len(single_rows)}")
    return diffs


class InProcessPeers:
    """:class:`~tide.services.scaler.peers.PeerLink` between cores in one process: a shipment
    is the receiver's ``receive_partials``, as the ScalerPeers servicer calls it, with
    the real call's size in bytes. An address in ``stalled`` never answers (a dead or
    paused owner): the call waits out its deadline and raises Unavailable."""

    def __init__(self) -> None:
        self.cores: dict[str, ScalerCore] = {}
        self.stalled: set[str] = set()
        self.calls: list[tuple[str, str, list[str]]] = []
        #: (address, sender, the notices of that call), one per call.
        self.notices: list[tuple[str, str, list[NodeNotice]]] = []

    async def ship(
        self,
        address: str,
        sender: str,
        parts: Sequence[JobPartial],
        notices: Sequence[NodeNotice] = (),
        *,
        timeout_s: float,
    ) -> tuple[int, int]:
        self.calls.append((address, sender, [p.job_id for p in parts]))
        self.notices.append((address, sender, list(notices)))
        core = self.cores.get(address)
        if core is None or address in self.stalled:
            await asyncio.sleep(timeout_s)
            raise Unavailable(f"{address}: deadline exceeded")
        size = ship_request(sender, parts, notices).ByteSize()
        core.receive_notices(list(notices))  # as the ScalerPeers servicer: notices first
        return size, await core.receive_partials(sender, list(parts))

    def keep(self, addresses: Iterable[str]) -> None:
        pass

    async def close(self) -> None:
        pass
