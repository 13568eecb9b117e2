"""Three sharded scaler processes on PostgreSQL (docs/scaler.md, Scaling out): agents
stream to replicas that do not own their job, the owner decides from the partials the
others ship it, exactly once per job; one replica SIGKILLed, its shards move to the
others within lease + round + 1 s and its jobs keep being decided, and no job's
decision events ever go back to an older owner epoch."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest
import sqlalchemy as sa
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.scaler.support import report
from tests.support.pg import schema_url
from tests.support.poll import eventually_rpc
from tests.support.procs import ServiceProcess, start_service
from tide.base.grpc_options import client_options
from tide.services.scaler.leases import SHARD_LEASE_PREFIX, assign, shard_of
from tide.services.testing.replicas import replica_args
from tide.v1 import scaler_pb2, scaler_pb2_grpc, telemetry_pb2, telemetry_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.postgres]

SHARDS = 6
LEASE_S = 2.0
RENEW_S = 0.5
NAMES = ("r0", "r1", "r2")
JOBS = [f"ns/j{k}" for k in range(6)]
T = 5.0


@pytest.fixture
def db_url(pg_admin: sa.Engine, pg_url: str) -> Iterator[str]:
    from tide.services.store import db

    with schema_url(pg_admin, pg_url, "sharded") as url:
        db.upgrade(url)
        yield url


def replica(tmp: Path, db_url: str, owner: str) -> ServiceProcess:
    # Drained: a replica whose stderr pipe nobody reads stops in its next log write
    # once 64 KiB are waiting there. Its output is printed at the end, for a failure.
    return start_service(
        replica_args(
            tmp,
            owner,
            db_url,
            "--shards",
            str(SHARDS),
            "--lease-duration-s",
            str(LEASE_S),
            "--lease-renew-s",
            str(RENEW_S),
            "--partials-ship-interval-s",
            "0.5",
            "--evaluate-interval-s",
            "0.5",
            "--reconcile-interval-s",
            "600",
            "--sustain-s",
            "3",
            "--bucket-s",
            "1",
            "--cooldown-s",
            "0",
            "--min-replicas",
            "2",
            "--max-replicas",
            "3",
            "--min-scale-up-efficiency",
            "0",
            actuator="memory",
        )
    ).drain()


class Agents:
    """One node per job, two GPUs (its two trainers), 4 reports a second, each streaming
    to a replica that does not own the job; a stream that breaks moves to the next
    replica still up (as behind a Service)."""

    def __init__(self, targets: dict[str, str], first: dict[str, str]) -> None:
        self.targets = targets
        self.first = first
        self.util = dict.fromkeys(JOBS, 50.0)
        self.dead: set[str] = set()
        self.stop = asyncio.Event()

    async def node(self, job: str) -> None:
        name = job.partition("/")[2]
        pods = [f"{name}-trainer-0", f"{name}-trainer-1"]
        at = self.first[job]
        seq = 0
        while not self.stop.is_set():
            try:
                async with grpc.aio.insecure_channel(
                    self.targets[at], options=client_options()
                ) as ch:
                    call = telemetry_pb2_grpc.TelemetryStub(ch).Stream()
                    while not self.stop.is_set():
                        seq += 1
                        u = self.util[job]
                        await call.write(
                            report(f"node-{name}", seq, utils=[u, u], capacity=2, pods=pods)
                        )
                        await asyncio.sleep(0.25)
                    call.cancel()
            except (grpc.aio.AioRpcError, grpc.aio.UsageError):
                live = [n for n in NAMES if n not in self.dead]
                at = live[(live.index(at) + 1) % len(live)] if at in live else live[0]
                await asyncio.sleep(0.1)


def holders(db_url: str) -> dict[int, str]:
    """Shard → holder of its live lease, as the store has it."""
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT name, holder FROM leader_leases"
                    " WHERE name LIKE :p AND expires_at > now()"
                ),
                {"p": SHARD_LEASE_PREFIX + "%"},
            )
            return {int(n.removeprefix(SHARD_LEASE_PREFIX)): h for n, h in rows}
    finally:
        engine.dispose()


def decisions(db_url: str) -> list[tuple[str, int, str, list[int], str]]:
    """(job, decision id, reason, its events' owner epochs in order, state)."""
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT d.job_id, d.id, d.reason, e.owner_epoch, d.state FROM decisions d"
                    " JOIN decision_events e ON e.decision_id = d.id ORDER BY e.id"
                )
            ).all()
    finally:
        engine.dispose()
    out: dict[int, tuple[str, int, str, list[int], str]] = {}
    for job, did, reason, epoch, state in rows:
        out.setdefault(did, (job, did, reason, [], state))[3].append(int(epoch))
    return list(out.values())


def scale_ups(db_url: str, job: str) -> list[tuple[str, int, str, list[int], str]]:
    return [d for d in decisions(db_url) if d[0] == job and d[2] == "SUSTAINED_HIGH_UTILIZATION"]


async def upsert(targets: dict[str, str], job: str) -> bool:
    """UpsertJob at any replica; a replica that does not own the job names its owner."""
    for target in list(targets.values()):
        async with grpc.aio.insecure_channel(target) as ch:
            stub: Any = scaler_pb2_grpc.ScalerStub(ch)
            try:
                await stub.UpsertJob(
                    scaler_pb2.UpsertJobRequest(job_id=job, gpus_per_replica=1), timeout=T
                )
                return True
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                details = exc.details() or ""
                if " at 127.0.0.1:" in details:
                    owner = details.rpartition(" at ")[2]
                    assert owner in targets.values(), details
    return False


async def ready(target: str) -> bool:
    async with grpc.aio.insecure_channel(target) as ch:
        health: Any = health_pb2_grpc.HealthStub(ch)
        resp = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=T)
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


async def test_jobs_decided_once_by_their_owner_through_a_replica_kill(
    tmp_path: Path, db_url: str
) -> None:
    # The in-memory coordinators of all three know each job's two trainers.
    doc = {
        "jobs": {
            j: {"generation": 1, "world_size": 2, "step": 0, "lost_steps_total": 0} for j in JOBS
        },
        "finished": {},
    }
    (tmp_path / "coordinator.json").write_text(json.dumps(doc))
    owner_of = {j: assign(SHARDS, list(NAMES))[shard_of(j, SHARDS)] for j in JOBS}
    victim = owner_of[JOBS[0]]
    assert len(set(owner_of.values())) >= 2, owner_of
    procs = {n: replica(tmp_path, db_url, n) for n in NAMES}
    targets = {n: p.target for n, p in procs.items()}
    # Each job's agent streams to the replica after its owner: never the owner itself.
    first = {j: NAMES[(NAMES.index(owner_of[j]) + 1) % len(NAMES)] for j in JOBS}
    agents = Agents(targets, first)
    feeders: list[asyncio.Task[None]] = []
    try:
        for n in NAMES:
            await eventually_rpc(partial(ready, targets[n]), 30, what=f"{n} to run rounds")
        await eventually_rpc(
            lambda: _all_held(db_url, owner_of), 30, what="every shard held by its replica"
        )
        for j in JOBS:
            await eventually_rpc(partial(upsert, targets, j), 20, what=f"{j} created")
        feeders = [asyncio.create_task(agents.node(j)) for j in JOBS]

        # Phase 1: the jobs of the replicas that stay tip; each is decided once.
        phase1 = [j for j in JOBS if owner_of[j] != victim]
        for j in phase1:
            agents.util[j] = 97.0
        for j in phase1:
            await eventually_rpc(partial(_one, db_url, j), 40, what=f"{j} scaled up by its owner")
        assert all(not scale_ups(db_url, j) for j in JOBS if j not in phase1)

        # Phase 2: the victim is killed; its shards move and its jobs tip.
        procs[victim].kill()
        killed = time.monotonic()
        agents.dead.add(victim)
        await eventually_rpc(
            lambda: _moved(db_url, victim), 10, what="the victim's shards taken over"
        )
        moved_s = time.monotonic() - killed
        assert moved_s <= LEASE_S + RENEW_S + 1.0, moved_s
        for j in JOBS:
            if j not in phase1:
                agents.util[j] = 97.0
        for j in JOBS:
            await eventually_rpc(partial(_one, db_url, j), 40, what=f"{j} scaled up")
        await asyncio.sleep(2 * RENEW_S + 1.0)  # a second decision would show by now
        for j in JOBS:
            ups = scale_ups(db_url, j)
            assert len(ups) == 1, (j, ups)
        # Fencing: across every decision of a job, its events' epochs never go back.
        for j in JOBS:
            epochs = [e for d in decisions(db_url) if d[0] == j for e in d[3]]
            assert epochs == sorted(epochs), (j, epochs)
        engine = sa.create_engine(db_url)
        try:
            with engine.connect() as conn:
                owners: dict[str, str] = {
                    str(j): str(o)
                    for j, o in conn.execute(sa.text("SELECT job_id, owner_id FROM jobs"))
                }
        finally:
            engine.dispose()
        live = holders(db_url)
        for j in JOBS:
            assert owners[j] == live[shard_of(j, SHARDS)] != victim, (j, owners, live)
    finally:
        agents.stop.set()
        for t in feeders:
            t.cancel()
        for t in feeders:
            with contextlib.suppress(BaseException):
                await t
        for p in procs.values():
            p.kill()
        # What a failure needs to be read: each replica's last lines, the store's view.
        for n, p in procs.items():
            print(f"--- {n}: {p.drained_bytes[0]} bytes of output, the last lines:")
            print("".join(list(p.tail)[-20:]))
        with contextlib.suppress(Exception):
            print("owners planned:", owner_of, "victim:", victim)
            print("shard holders:", holders(db_url))
            for d in decisions(db_url):
                print("decision:", d)


async def _all_held(db_url: str, owner_of: dict[str, str]) -> bool:
    held = await asyncio.to_thread(holders, db_url)
    want = assign(SHARDS, list(NAMES))
    return held == want


async def _moved(db_url: str, victim: str) -> bool:
    held = await asyncio.to_thread(holders, db_url)
    return len(held) == SHARDS and victim not in held.values()


async def _one(db_url: str, job: str) -> bool:
    ups = await asyncio.to_thread(scale_ups, db_url, job)
    return len(ups) >= 1 and ups[0][4] == "COMPLETED"


def preemptions(db_url: str, job: str) -> list[tuple[float, str]]:
    """(created at, Unix seconds; state) of the job's NODE_TERMINATION decisions."""
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT extract(epoch FROM created_at), state FROM decisions"
                    " WHERE job_id = :j AND reason = 'NODE_TERMINATION' ORDER BY id"
                ),
                {"j": job},
            ).all()
    finally:
        engine.dispose()
    return [(float(t), str(s)) for t, s in rows]


async def test_a_notice_reported_to_a_non_owner_makes_the_owner_plan_the_preemption(
    tmp_path: Path, db_url: str
) -> None:
    """The node's agent streams to a replica that does not own the job: the owner learns
    the termination notice from that replica's shipment and decides the preemption
    (NODE_TERMINATION) well before the notice's deadline."""
    doc = {
        "jobs": {
            j: {"generation": 1, "world_size": 2, "step": 0, "lost_steps_total": 0} for j in JOBS
        },
        "finished": {},
    }
    (tmp_path / "coordinator.json").write_text(json.dumps(doc))
    owner_of = {j: assign(SHARDS, list(NAMES))[shard_of(j, SHARDS)] for j in JOBS}
    job = JOBS[0]
    name = job.partition("/")[2]
    pods = [f"{name}-trainer-0", f"{name}-trainer-1"]
    at = NAMES[(NAMES.index(owner_of[job]) + 1) % len(NAMES)]
    procs = {n: replica(tmp_path, db_url, n) for n in NAMES}
    targets = {n: p.target for n, p in procs.items()}
    try:
        for n in NAMES:
            await eventually_rpc(partial(ready, targets[n]), 30, what=f"{n} to run rounds")
        await eventually_rpc(
            lambda: _all_held(db_url, owner_of), 30, what="every shard held by its replica"
        )
        await eventually_rpc(partial(upsert, targets, job), 20, what=f"{job} created")
        async with grpc.aio.insecure_channel(targets[at], options=client_options()) as ch:
            call = telemetry_pb2_grpc.TelemetryStub(ch).Stream()
            seq = 0
            for _ in range(4):  # attributed first, as a node that ran the job a while
                seq += 1
                await call.write(
                    report(f"node-{name}", seq, utils=[60.0, 60.0], capacity=2, pods=pods)
                )
                await asyncio.sleep(0.25)
            # Trainer 1's node goes in 30 s.
            seq += 1
            r = report(f"node-{name}", seq, utils=[60.0, 60.0], capacity=2, pods=[pods[1]] * 2)
            r.events.add(kind=telemetry_pb2.NodeEvent.KIND_TERMINATION_NOTICE, detail="spot")
            noticed = time.time()
            deadline = noticed + 30.0
            r.events[0].deadline.FromNanoseconds(int(deadline * 1e9))
            await call.write(r)
            got = await eventually_rpc(
                lambda: asyncio.to_thread(preemptions, db_url, job), 15, what="the preemption"
            )
            call.cancel()
        decided_s = got[0][0] - noticed
        print(f"notice to owner's NODE_TERMINATION decision: {decided_s:.3f} s")
        assert got[0][0] < deadline, got
        assert len(got) == 1, got
    finally:
        for p in procs.values():
            p.kill()


def _save_often(path: str, job: str, n: int) -> None:
    from tide.services.testing.coordinator import InMemoryCoordinator

    c = InMemoryCoordinator(path=Path(path))
    for i in range(n):
        c.set_job(job, 2 + i % 2, generation=i + 1)


def test_replicas_sharing_the_coordinator_file_lose_no_write(tmp_path: Path) -> None:
    """The replicas above share one in-memory coordinator's file: three processes saving
    at once neither fail (a shared temporary file was truncated and renamed away under
    another writer: FileNotFoundError inside a resize, the decision never completed)
    nor put back another's job as they last read it."""
    import multiprocessing as mp

    from tide.services.testing.coordinator import InMemoryCoordinator

    path = tmp_path / "coordinator.json"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_save_often, args=(str(path), f"ns/j{k}", 200)) for k in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    jobs = InMemoryCoordinator(path=path)
    assert {j: jobs.job(j) for j in ("ns/j0", "ns/j1", "ns/j2")} == dict.fromkeys(
        ("ns/j0", "ns/j1", "ns/j2"), (200, 3)
    )
