"""Scale benchmark: a simulated cluster of agents at 1 Hz against scaler replicas and
PostgreSQL, one replica without sharding and several with, in the same run.

    python -m bench.scale [--quick] [--agents N] [--replicas 3] [--seconds S] [--pg URL]
    python -m bench.scale --sweep 3000,4000,5000 [--seconds S]

Every figure is measured at the size it names; nothing is extrapolated. Agents are
streams of one spawned process on CPU 1 (bench/fleet.py: gRPC over HTTP/2 on
CONNECTIONS loopback connections per replica, without grpc.aio's per-call cost, so
that one core drives 5,000 streams), one report of 8 GPUs a second each, opened at
RAMP_PER_S a second; one job in RESIZING_EVERY has its utilization flip between
95 % and 10 % every PERIOD_S, so that it keeps resizing through the in-memory
actuator and coordinator, and the others hold 50 %. ``--sweep`` runs only one
replica at each size given (the capacity target of issue 18: agents per core used,
ack p99).

Phases:

1. ``baseline``: one replica, a third of the agents (the same code, a smaller fleet);
2. ``single``: one replica (ScalerCore, PostgreSQL store), all the agents: ack p99
   (write → the ack that covers it, at the agent), tipping sample → committed
   decision p99, the replica's CPU and RSS, agents per core used;
3. ``sharded``: ``--replicas`` replicas holding shard leases in PostgreSQL
   (tide/services/scaler/sharding.py: the scaler's own core, rounds and policy loop);
   every agent streams to any replica, and replicas fold samples of jobs they do
   not own into partial aggregates (tide/services/scaler/partials.py) that they ship to
   the owner once a second over tide.v1.ScalerPeers. Ack p99, decision p99 (the
   owner's, tipping sample → committed, on shipped samples as much as its own),
   CPU and RSS per replica. Half-way one replica is killed (SIGKILL): its agents
   reconnect to the others, and ``rebalance_s`` is the time until the survivors
   own every shard. ``decision_p99_ms_before_kill`` leaves out the decisions made
   after it: a moved job is decided on its replayed window and timed from its
   tipping sample before the kill, so the failover is in its latency;
4. ``windows_match``: the same reports replayed into one engine and across replica
   engines shipping partials (tide/services/testing/shards.py): 1 when the owners'
   windows, coverage and rollups equal the single engine's;
5. ``decision_p99_ms_big_history``: decisions on a job with 20,000 past decisions in
   PostgreSQL (bench.history's seed and measurement).

The last line is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from bench.ingest import _base, _pin, pct

PERIOD_S = 10.0  # utilization of the resizing jobs flips between high and low this often
#: One job in this many resizes (its utilization flips); the others hold 50 %, inside
#: the policy's band. Every job resizing every flip would make the run a benchmark of
#: decision commits (bench.ingest's paced phase is that one), not of streams.
RESIZING_EVERY = 10
NODES_PER_JOB = 4
SHARDS = 12
LEASE_S = 3.0  # shard lease duration in the sharded phase; renewed every second
#: TCP connections from the fleet to each replica (the streams share them, as the two
#: grpc.aio channels of the earlier generator did).
CONNECTIONS = 2
#: New streams a second while the fleet starts (bench/fleet.py).
RAMP_PER_S = 1000
DEFAULT_PG = "postgresql+psycopg://postgres@127.0.0.1:5432/tide_test"


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# --- replicas ----------------------------------------------------------------------------------


def replica_main(mode: str, url: str, name: str, jobs: int, cpu: int, conn: Connection) -> None:
    _pin(cpu)
    asyncio.run(_replica(mode, url, name, jobs, conn))


async def _replica(mode: str, url: str, name: str, jobs: int, conn: Connection) -> None:
    import grpc

    from tide.base.credentials import NO_CREDENTIALS
    from tide.base.grpc_options import server_options
    from tide.services.common.clock import SystemClock
    from tide.services.scaler.engine.core import ScalerCore
    from tide.services.scaler.ingest import IngestSettings
    from tide.services.scaler.leases import ShardLeases, ShardSettings
    from tide.services.scaler.metrics import PARTIALS_DROPPED
    from tide.services.scaler.peers import GrpcPeerLink
    from tide.services.scaler.policy import PolicySettings
    from tide.services.scaler.servicer import ScalerPeersServicer, TelemetryServicer
    from tide.services.scaler.sharding import Sharding
    from tide.services.scaler.store import DecisionStore
    from tide.services.scaler.tuning import heap_freezer, tune_process
    from tide.services.store import db
    from tide.services.testing.actuators import InMemoryActuator
    from tide.services.testing.coordinator import InMemoryCoordinator, follow_actuator
    from tide.services.testing.members import InMemoryMemberRegistry
    from tide.v1 import peers_pb2_grpc, telemetry_pb2_grpc

    tune_process()  # as the scaler process does
    clock = SystemClock()
    engine = db.make_engine(url)
    store = DecisionStore(engine, name, clock)
    settings = IngestSettings(stale_after_s=5.0)
    latencies: list[tuple[float, float]] = []  # (committed at, perf_counter; latency s)
    sharding: Sharding | None = None
    background: list[asyncio.Task[Any]] = []
    actuator = InMemoryActuator()
    coordinator = InMemoryCoordinator()
    follow_actuator(coordinator, actuator)
    policy = PolicySettings(
        bucket_s=2.0,
        sustain_s=4.0,
        cooldown_s=0.0,
        scale_down_stabilization_s=0.0,
        min_replicas=2,
        max_replicas=8,
    )
    core = ScalerCore(
        store=store,
        actuator=actuator,
        coordinator=coordinator,
        clock=clock,
        defaults=policy,
        ingest=settings,
        heap=heap_freezer(),  # as tide/services/scaler/app.py does
    )
    observe = core.metrics.observe_decision

    def record(total_s: float, parts: tuple[float, float, float]) -> None:
        # Every observation, for exact percentiles; when, to tell those before a kill.
        latencies.append((time.perf_counter(), total_s))
        observe(total_s, parts)

    core.metrics.observe_decision = record  # type: ignore[method-assign]
    if mode == "single":
        await core.start()
        for j in range(jobs):
            await core.upsert_job(f"bench/j{j}", {}, gpus_per_replica=4)
    else:
        # One member list for every replica, every pod of the fleet: the one coordinator
        # that real replicas all follow. Their in-memory coordinators are one per
        # process, and a non-owner's would not see the owner's resizes, so the new pods'
        # samples it receives would be unattributed and the owner's coverage would fall.
        fleet = InMemoryMemberRegistry()
        for j in range(jobs):
            coordinator.set_job(f"bench/j{j}", 2)
            fleet.set_members(f"bench/j{j}", _members(j))
        core.ingest.registry = fleet
        if name == "r0":  # the first replica makes the jobs; the others start after it
            for j in range(jobs):
                await store.upsert_job(
                    f"bench/j{j}",
                    min_replicas=policy.min_replicas,
                    max_replicas=policy.max_replicas,
                    gpus_per_replica=4,
                )
        leases = ShardLeases(
            store, clock, ShardSettings(shards=SHARDS, duration_s=LEASE_S, renew_s=1.0), address=""
        )
        sharding = Sharding(core, leases, GrpcPeerLink(NO_CREDENTIALS), ship_interval_s=1.0)
        await core.start_sharded()
    ingest = core.ingest

    server = grpc.aio.server(options=server_options())
    telemetry_pb2_grpc.add_TelemetryServicer_to_server(TelemetryServicer(ingest), server)
    peers_pb2_grpc.add_ScalerPeersServicer_to_server(ScalerPeersServicer(core), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    if sharding is not None:
        sharding.leases.address = f"127.0.0.1:{port}"

        async def rounds(s: Sharding = sharding) -> None:
            while True:
                await s.round()
                await asyncio.sleep(s.leases.settings.renew_s)

        background += [asyncio.create_task(rounds()), asyncio.create_task(sharding.shipping())]
    background.append(asyncio.create_task(core.run()))
    conn.send(port)
    cpu0 = time.process_time()
    shipped = core.metrics.partials_shipped_bytes
    dropped = [core.metrics.partials_dropped.labels(r) for r in PARTIALS_DROPPED]
    while True:
        await asyncio.sleep(0.05)
        while conn.poll():
            msg = conn.recv()
            if msg[0] == "stats":
                owned = sorted(sharding.leases.owned_shards()) if sharding is not None else []
                conn.send(
                    (
                        "stats",
                        time.process_time() - cpu0,
                        ingest.reports_accepted,
                        owned,
                        shipped._value.get(),
                        [c._value.get() for c in dropped],
                    )
                )
            elif msg[0] == "stop":
                for t in background:
                    t.cancel()
                decisions = 0
                if mode == "single" or name == "r0":  # one store: counted once
                    page = await core.store.list_decisions(page_size=1000)
                    decisions = len(page.decisions)
                await core.close()
                conn.send(("stopped", latencies, decisions))
                await server.stop(0)
                engine.dispose()
                return


def _members(job: int) -> list[Any]:
    from tide.services.scaler.members import Member

    # The pods of bench.ingest._base: two of 4 GPUs per node, NODES_PER_JOB nodes.
    return [Member(f"j{job}-trainer-{p}", f"uid-j{job}-{p}") for p in range(NODES_PER_JOB * 2)]


# --- agents ------------------------------------------------------------------------------------


def agents_main(
    ports: list[int],
    nodes: list[tuple[str, int, int]],
    seconds: float,
    warm_s: float,
    q: Any,
    resizing_every: int = RESIZING_EVERY,
) -> None:
    """The fleet's streams, in one process on CPU 1 (bench/fleet.py: gRPC over HTTP/2
    without grpc.aio's per-call machinery, so one core drives 5,000 streams at 1 Hz)."""
    from bench.fleet import run_fleet

    _pin(1)
    templates = []
    for name, job, k in nodes:
        if resizing_every and job % resizing_every == 0:
            templates.append((_base(name, job, k, 95.0), _base(name, job, k, 10.0)))
        else:
            flat = _base(name, job, k, 50.0)
            templates.append((flat, flat))
    out = run_fleet(ports, templates, seconds, warm_s, CONNECTIONS, PERIOD_S, RAMP_PER_S)
    q.put((out["lat"], out["errors"], out["written"], out["cpu"], out["refused"]))


# --- phases ------------------------------------------------------------------------------------


def _start_replicas(
    ctx: Any, mode: str, url: str, count: int, jobs: int
) -> list[tuple[Any, Connection, int]]:
    out = []
    for r in range(count):
        parent, child = ctx.Pipe()
        # Replicas on CPU 0, agents on CPU 1: the agents' cost is not the replicas'.
        p = ctx.Process(target=replica_main, args=(mode, url, f"r{r}", jobs, 0, child), daemon=True)
        p.start()
        out.append((p, parent, parent.recv()))
    return out


def run_phase(
    url: str,
    mode: str,
    agents: int,
    replicas: int,
    seconds: float,
    kill_at_s: float | None,
    procs: int = 1,
    resizing_every: int = RESIZING_EVERY,
) -> dict[str, Any]:
    from tide.services.scaler.metrics import PARTIALS_DROPPED

    ctx = mp.get_context("spawn")
    jobs = max(1, agents // NODES_PER_JOB)
    reps = _start_replicas(ctx, mode, url, replicas, jobs)
    ports = [port for _, _, port in reps]
    nodes = [(f"node-{i}", i // NODES_PER_JOB % jobs, i % NODES_PER_JOB) for i in range(agents)]
    q = ctx.Queue()
    # The fleet opens RAMP_PER_S streams a second (bench/fleet.py); measured from a few
    # seconds after the last one opened.
    warm_s = min(seconds / 2, max(min(8.0, seconds / 3), agents / RAMP_PER_S + 5.0))
    fleet = [
        ctx.Process(
            target=agents_main,
            args=(ports, nodes[k::procs], seconds, warm_s, q, resizing_every),
        )
        for k in range(procs)
    ]
    for a in fleet:
        a.start()
    alive = list(range(replicas))

    def stats() -> dict[int, tuple[float, int, list[int], float, list[float]]]:
        out = {}
        for r in alive:
            reps[r][1].send(("stats",))
        for r in alive:
            msg = reps[r][1].recv()
            out[r] = msg[1:]
        return out

    t_start = time.monotonic()
    deadline = t_start + seconds
    time.sleep(warm_s)
    s0, t0 = stats(), time.monotonic()
    rss: dict[int, float] = {}
    rebalance_s: float | None = None
    killed_at: float | None = None
    killed_perf = float("inf")
    while time.monotonic() < deadline - 1.0:
        time.sleep(0.2)
        if mode == "sharded":
            cur = stats()
            if (
                killed_at is None
                and kill_at_s is not None
                and time.monotonic() - t_start >= kill_at_s
            ):
                for r in alive:
                    rss[r] = _rss_mib(reps[r][0].pid)
                victim = alive[-1]
                os.kill(reps[victim][0].pid, signal.SIGKILL)
                alive.remove(victim)
                killed_at = time.monotonic()
                killed_perf = time.perf_counter()
            elif killed_at is not None and rebalance_s is None:
                owned = {k for _, _, o, _, _ in cur.values() for k in o}
                if owned == set(range(SHARDS)):
                    rebalance_s = time.monotonic() - killed_at
    s1, t1 = stats(), time.monotonic()
    for r in alive:
        rss.setdefault(r, _rss_mib(reps[r][0].pid))
    results = [q.get(timeout=120) for _ in fleet]
    for a in fleet:
        a.join(timeout=30)
    lat = sorted(x for r in results for _, x in r[0])
    # Before the kill: the reconnect of a killed replica's agents (a few hundred new
    # streams at once) is most of the tail after it.
    steady = sorted(x for r in results for t, x in r[0] if t < killed_perf)
    errors = sum(r[1] for r in results)
    written = sum(r[2] for r in results)
    agent_cpu = sum(r[3] for r in results)
    refused = sum(r[4] for r in results)
    decision_lat: list[tuple[float, float]] = []
    decisions = 0
    for r in alive:
        reps[r][1].send(("stop",))
        while True:
            msg = reps[r][1].recv()
            if msg[0] == "stopped":
                decision_lat += msg[1]
                decisions += msg[2]
                break
        reps[r][0].join(timeout=30)
    for p, _, _ in reps:
        if p.is_alive():
            p.kill()
    # CPU of the replicas that lived through the whole measurement.
    cpu = [(s1[r][0] - s0[r][0]) / (t1 - t0) for r in s1 if r in s0]
    reports = sum(s1[r][1] - s0[r][1] for r in s1 if r in s0)
    lat_ms = [x * 1000 for x in lat]
    dec_ms = [x * 1000 for _, x in decision_lat]
    # Before the kill: a job whose owner was killed is decided by the new owner on the
    # replayed window, timed from its tipping sample before the kill (the failover is in
    # its latency); these are the decisions no failover touched.
    dec_steady_ms = [x * 1000 for t, x in decision_lat if t < killed_perf]
    return {
        "agents": agents,
        "replicas": replicas,
        "ack_p50_ms": round(pct(lat_ms, 0.5), 1),
        "ack_p99_ms": round(pct(lat_ms, 0.99), 1),
        "ack_p99_ms_before_kill": round(pct([x * 1000 for x in steady], 0.99), 1),
        "acks": len(lat),
        "decision_p99_ms": round(pct(dec_ms, 0.99), 1) if dec_ms else None,
        "decision_p99_ms_before_kill": (
            round(pct(dec_steady_ms, 0.99), 1) if dec_steady_ms else None
        ),
        "decisions": decisions,
        "cpu_pct_per_replica": [round(c * 100, 1) for c in cpu],
        "rss_mib_per_replica": [round(v, 1) for v in rss.values()],
        "reports_per_s": round(reports / (t1 - t0)),
        # What the agents wrote per second after the warm-up (the fleet asks `agents`).
        "written_per_s": round(written / max(1e-9, seconds - warm_s)),
        # CPU the agent processes used (all on CPU 1), of one core: near 100 % the
        # generator, not the replica, bounds what was written.
        "agent_cpu_pct": round(agent_cpu * 100, 1),
        # Reports the replica's flow-control windows did not admit (not written).
        "flow_refused": refused,
        # Agents per core the replicas used: the reports they accepted a second (one per
        # agent and second) over the CPU it cost them. Not the fleet's size over that
        # CPU: a replica that falls behind would count agents it did not serve.
        "agents_per_core": round(reports / (t1 - t0) / max(1e-9, sum(cpu))) if cpu else None,
        "stream_errors": errors,
        "rebalance_s": round(rebalance_s, 2) if rebalance_s is not None else None,
        # Shipped over gRPC (ShipPartials request sizes), by the replicas that lived through.
        "partial_bytes_per_s": round(sum(s1[r][3] - s0[r][3] for r in s1 if r in s0) / (t1 - t0)),
        # Jobs' partials dropped by those replicas, by reason.
        "partials_dropped": {
            reason: round(sum(s1[r][4][i] - s0[r][4][i] for r in s1 if r in s0))
            for i, reason in enumerate(PARTIALS_DROPPED)
        },
    }


def big_history(url: str) -> float:
    from bench.history import measure_scaler
    from bench.history_seed import BUSY_DECISIONS, pg_schema, seed

    total = BUSY_DECISIONS * 2
    with pg_schema(url) as u:
        seed(u, total)
        return float(asyncio.run(measure_scaler(u, total))["decision_p99_ms"])


def sweep(sizes: list[int], seconds: float, pg: str, resizing_every: int) -> int:
    """One replica at each fleet size; RESULT holds, per size, what the capacity target
    is judged by (agents per core used, ack p99) and whether the fleet kept its 1 Hz."""
    from bench.history_seed import pg_schema
    from tide.services.store import db

    out: dict[str, Any] = {}
    for n in sizes:
        with pg_schema(pg) as url:
            db.upgrade(url)
            r = run_phase(url, "single", n, 1, seconds, None, resizing_every=resizing_every)
        print(f"single {n}: " + json.dumps(r), flush=True)
        for key in (
            "agents_per_core",
            "ack_p50_ms",
            "ack_p99_ms",
            "cpu_pct_per_replica",
            "reports_per_s",
            "written_per_s",
            "agent_cpu_pct",
            "decision_p99_ms",
        ):
            out[f"{key}_{n}"] = r[key]
    out["seconds_per_phase"] = seconds
    out["resizing_every"] = resizing_every
    print("RESULT " + json.dumps(out), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="a fleet this 2-core machine holds")
    ap.add_argument("--agents", type=int, default=0, help="agent streams (nodes)")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=0.0, help="length of each phase")
    ap.add_argument("--pg", default=os.environ.get("TIDE_TEST_PG_URL", DEFAULT_PG))
    ap.add_argument(
        "--sweep",
        default="",
        help="comma-separated fleet sizes: only one replica at each (issue 18's capacity"
        " target: agents per core and ack p99 at 3,000, 4,000, 5,000)",
    )
    ap.add_argument(
        "--resizing-every",
        type=int,
        default=RESIZING_EVERY,
        help="one job in N flips utilization every PERIOD_S and resizes; 0: none (--sweep)",
    )
    args = ap.parse_args(argv)
    if args.resizing_every < 0:
        ap.error(f"--resizing-every {args.resizing_every}: must be >= 0")
    agents = args.agents or (1200 if args.quick else 3000)
    seconds = args.seconds or (30.0 if args.quick else 90.0)
    t_start = time.monotonic()
    from bench.history_seed import pg_schema
    from tide.services.store import db

    if args.sweep:
        return sweep([int(n) for n in args.sweep.split(",")], seconds, args.pg, args.resizing_every)
    from tide.services.testing.shards import compare_sharded

    phases: dict[str, dict[str, Any]] = {}
    for label, mode, n, reps in (
        ("baseline", "single", max(1, agents // 3), 1),
        ("single", "single", agents, 1),
        ("sharded", "sharded", agents, args.replicas),
    ):
        with pg_schema(args.pg) as url:
            db.upgrade(url)
            phases[label] = run_phase(
                url, mode, n, reps, seconds, seconds * 0.55 if mode == "sharded" else None
            )
        print(f"{label}: " + json.dumps(phases[label]), flush=True)
    diffs = compare_sharded(jobs=40, replicas=args.replicas, seconds=60)
    for d in diffs[:5]:
        print("windows differ:", d)
    big = big_history(args.pg)
    single, sharded, base = phases["single"], phases["sharded"], phases["baseline"]
    cpu_sharded = sharded["cpu_pct_per_replica"]
    result = {
        "agents": agents,
        "replicas": args.replicas,
        "ack_p99_ms": sharded["ack_p99_ms"],
        "ack_p99_ms_before_kill": sharded["ack_p99_ms_before_kill"],
        "decision_p99_ms_before_kill": sharded["decision_p99_ms_before_kill"],
        "decision_p99_ms": sharded["decision_p99_ms"],
        "cpu_pct_per_replica": round(sum(cpu_sharded) / max(1, len(cpu_sharded)), 1),
        "rss_mib_per_replica": sharded["rss_mib_per_replica"],
        "agents_per_core": sharded["agents_per_core"],
        "rebalance_s": sharded["rebalance_s"],
        "windows_match": int(not diffs),
        "decision_p99_ms_big_history": round(big, 1),
        "single_agents": single["agents"],
        "single_ack_p99_ms": single["ack_p99_ms"],
        "single_decision_p99_ms": single["decision_p99_ms"],
        "single_cpu_pct_per_replica": single["cpu_pct_per_replica"][0],
        "single_rss_mib": single["rss_mib_per_replica"][0],
        "single_agents_per_core": single["agents_per_core"],
        "single_reports_per_s": single["reports_per_s"],
        "single_written_per_s": single["written_per_s"],
        "baseline_agents": base["agents"],
        "baseline_ack_p99_ms": base["ack_p99_ms"],
        "baseline_cpu_pct": base["cpu_pct_per_replica"][0],
        "baseline_agents_per_core": base["agents_per_core"],
        "stream_errors": single["stream_errors"] + base["stream_errors"],
        "partial_bytes_per_s": sharded["partial_bytes_per_s"],
        "partials_dropped": sharded["partials_dropped"],
        "seconds_per_phase": seconds,
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
