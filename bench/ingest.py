"""Ingest benchmark of one scaler process: reports/s, samples/s, decision latency,
and the ceiling of a bare Telemetry server under the same load.

    python -m bench.ingest [--quick] [--streams 16] [--seconds 8]

Phases, each with a fresh server process pinned to CPU 0 and agent streams in
spawned processes pinned to the other CPU:

1. ceiling: a Telemetry server that only parses and counts (and acks like the
   scaler does), saturated;
2. scaler: the real scaler (ingest, windows, policy, SQLite decisions) with the
   in-memory coordinator and actuator of tide.services.testing, saturated: reports/s and samples/s
   accepted; ``ceiling_ratio`` is its reports/s over the ceiling's, and
   ``ceiling_ratio_per_cpu`` the same per second of each server's CPU time (steadier
   on a shared machine, where a server does not always get its core);
2b. guarded: the same behind the interceptors tide/services/common/server.py puts in
   front of every servicer (the concurrency limit, and the guard, which parses each
   message and validates every field of every report), as a scaler run
   ``--insecure`` has them: ``ceiling_ratio_guarded``. An agent with an mTLS
   identity also has its node checked on each report; that is not measured here;
3. paced: the real scaler at the target rate (5,000 reports/s), where the
   agents flip utilization between 95 % and 10 % every PERIOD_S so that jobs
   keep crossing the thresholds: the time from the tipping sample (its
   sampled_at) to the committed decision, p50 and p99; and the lag of each
   decision over the sustain the policy was given (committed at - (flip +
   sustain_s), ``lag_over_sustain_p99_s``; negative when the oldest bucket
   already cleared the threshold with a few samples from before the flip).
   Windows slide by slots of at most 0.5 s (tide/services/scaler/windows.py); a
   window on a fixed bucket grid would add up to a bucket (uniform over one
   bucket, shown for comparison as ``aligned_grid_lag_p99_s``).

It then compares the pipeline delay (sample to decision, without the policy's
deliberate sustain window, which both paths add alike) with the path of DCGM
exporter → Prometheus → HPA at their default periods, by simulation over
random phases. Last, in its own process, the CPU time the ingest spends per report
with and without NVML GPM activity on every GPU (``ingest_cost_ratio_with_gpm``,
bench/ingest_gpm.py). The last line is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

from bench.fleet import varint
from bench.ingest_gpm import gpm_cost_ratio

PERIOD_S = 6.0  # utilization flips between high and low this often (paced phase)
BUCKET_S = 2.0  # the paced policy: buckets of 2 s, sustain 4 s, no cooldown
SUSTAIN_S = 4.0
GPUS = 8
NODES_PER_JOB = 4
TARGET_REPORTS_S = 5000


def _pin(cpu: int) -> None:
    try:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) > 1:
            os.sched_setaffinity(0, {cpus[cpu % len(cpus)]})
    except (AttributeError, OSError):
        pass


# --- servers ---------------------------------------------------------------------------------


def server_main(mode: str, jobs: int, conn: Connection) -> None:
    _pin(0)
    asyncio.run(_serve(mode, jobs, conn))


async def _serve(mode: str, jobs: int, conn: Connection) -> None:
    import grpc
    from prometheus_client import CollectorRegistry

    from tide.base.grpc_options import server_options
    from tide.services.common.metrics import grpc_server_metrics
    from tide.v1 import telemetry_pb2, telemetry_pb2_grpc

    # The scaler's server has the gRPC metrics interceptor (tide/services/common/server.py);
    # so does the benchmark's, so that its cost is in the figures. The ceiling has none.
    registry = CollectorRegistry()
    interceptors: list[Any] = [] if mode == "ceiling" else [grpc_server_metrics(registry)]
    if mode == "guarded":
        from tide.services.common.config import CommonSettings
        from tide.services.common.guard import Guard, GuardSettings
        from tide.services.common.shedding import ConcurrencyLimit
        from tide.services.common.validate import validate_request
        from tide.services.scaler.servicer import RULES

        # As tide/services/common/server.py orders them, for a server run --insecure.
        defaults = CommonSettings()
        interceptors += [
            ConcurrencyLimit(
                defaults.max_inflight_unary_calls, defaults.max_inflight_streams, registry
            ),
            Guard(
                GuardSettings(insecure=True), RULES, validate=validate_request, registry=registry
            ),
        ]
    server = grpc.aio.server(options=server_options(), interceptors=interceptors)
    core: Any = None
    counters: dict[str, float] = {"reports": 0, "samples": 0}
    tmp = tempfile.mkdtemp(prefix="tide-bench-")
    if mode == "ceiling":

        class Bare(telemetry_pb2_grpc.TelemetryServicer):
            async def Stream(self, it: Any, context: Any) -> Any:
                n = 0
                last = time.monotonic()
                async for r in it:
                    counters["reports"] += 1
                    counters["samples"] += len(r.gpus)
                    n += 1
                    now = time.monotonic()
                    if n >= 32 or now - last >= 0.2:
                        n = 0
                        last = now
                        yield telemetry_pb2.TelemetryAck(boot_id=r.boot_id, acked_seq=r.seq)

        telemetry_pb2_grpc.add_TelemetryServicer_to_server(Bare(), server)
    else:
        from tide.services.common.clock import SystemClock
        from tide.services.scaler.engine.core import ScalerCore
        from tide.services.scaler.ingest import IngestSettings
        from tide.services.scaler.policy import PolicySettings
        from tide.services.scaler.servicer import TelemetryServicer
        from tide.services.scaler.store import DecisionStore
        from tide.services.scaler.tuning import tune_process
        from tide.services.store import db
        from tide.services.testing.actuators import InMemoryActuator
        from tide.services.testing.coordinator import InMemoryCoordinator, follow_actuator

        # As the scaler process does (tide/services/scaler/app.py); the core is built here,
        # not through python -m tide.services.testing.scaler, to read its latencies in-process.
        tune_process()
        url = f"sqlite:///{tmp}/bench.db"
        db.upgrade(url)
        clock = SystemClock()
        actuator = InMemoryActuator()
        coordinator = InMemoryCoordinator()
        follow_actuator(coordinator, actuator)
        core = ScalerCore(
            store=DecisionStore(db.make_engine(url), "bench", clock),
            actuator=actuator,
            coordinator=coordinator,
            clock=clock,
            defaults=PolicySettings(
                bucket_s=BUCKET_S,
                sustain_s=SUSTAIN_S,
                cooldown_s=0.0,
                scale_down_stabilization_s=0.0,
                min_replicas=2,
                max_replicas=8,
            ),
            ingest=IngestSettings(stale_after_s=5.0),
        )
        # The core keeps no list of latencies (its histogram is what production has);
        # the benchmark wants exact percentiles, so it records each observation itself.
        latencies: list[float] = []
        parts: list[tuple[float, float, float]] = []
        observe = core.metrics.observe_decision

        def record(total_s: float, stages: tuple[float, float, float]) -> None:
            latencies.append(total_s)
            parts.append(stages)
            observe(total_s, stages)

        core.metrics.observe_decision = record
        await core.start()
        for j in range(jobs):
            await core.upsert_job(f"bench/j{j}", {}, gpus_per_replica=4)
        loop_task = asyncio.create_task(core.run())
        telemetry_pb2_grpc.add_TelemetryServicer_to_server(TelemetryServicer(core.ingest), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    conn.send(port)
    t_cpu0 = time.process_time()
    while True:
        await asyncio.sleep(0.05)
        if core is not None:
            counters["reports"] = core.ingest.reports_accepted
            counters["samples"] = core.ingest.samples_accepted
        if conn.poll():
            msg = conn.recv()
            if msg == "stats":
                conn.send((time.monotonic(), time.process_time() - t_cpu0, dict(counters)))
            elif msg == "stop":
                out: dict[str, Any] = {"latencies_s": [], "decisions": 0}
                if core is not None:
                    out["latencies_s"] = latencies
                    out["latency_parts"] = parts
                    page = await core.store.list_decisions(page_size=1000)
                    out["decisions"] = len(page.decisions)
                    out["decided_at_s"] = [d.created_at.timestamp() for d in page.decisions]
                    out["rejected"] = sum(core.ingest.rejected.values())
                    loop_task.cancel()
                    await core.close()
                conn.send(out)
                await server.stop(0)
                return


# --- agents ------------------------------------------------------------------------------------


def _base(node: str, job: int, k: int, util: float) -> bytes:
    from tide.v1 import common_pb2, telemetry_pb2

    r = telemetry_pb2.NodeReport(node_name=node, boot_id=f"boot-{node}", gpu_capacity=GPUS)
    for i in range(GPUS):
        # Two pods of 4 GPUs per node: 4 nodes hold the 8 replicas a job may reach.
        pod_index = k * 2 + i // 4
        r.gpus.add(
            index=i,
            uuid=f"GPU-{node}-{i}",
            utilization_pct=util + (i % 3) * 0.5,
            memory_used_bytes=10 << 30,
            memory_total_bytes=80 << 30,
            power_w=300.0,
            temperature_c=60.0,
            pod=common_pb2.PodRef(
                namespace="bench", name=f"j{job}-trainer-{pod_index}", uid=f"uid-j{job}-{pod_index}"
            ),
        )
    return r.SerializeToString()


def agent_main(port: int, nodes: list[tuple[str, int, int]], seconds: float, rate: float) -> None:
    _pin(1)
    asyncio.run(_agents(port, nodes, seconds, rate))


async def _agents(
    port: int, nodes: list[tuple[str, int, int]], seconds: float, rate: float
) -> None:
    import grpc

    from tide.base.grpc_options import client_options

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=client_options()) as ch:
        method = ch.stream_stream(
            "/tide.v1.Telemetry/Stream",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        end = time.monotonic() + seconds
        await asyncio.gather(*(_one(method, n, end, rate) for n in nodes))


async def _one(method: Any, node: tuple[str, int, int], end: float, rate: float) -> None:
    name, job, k = node
    high = _base(name, job, k, 95.0)
    low = _base(name, job, k, 10.0)
    call = method(timeout=end - time.monotonic() + 30)

    async def drain() -> None:
        async for _ in call:
            pass

    reader = asyncio.create_task(drain())
    seq = 0
    next_at = time.monotonic()
    try:
        while time.monotonic() < end:
            if rate > 0:
                # Send in 20 ms batches to keep the pacing overhead low.
                next_at += 0.02
                n = max(1, round(rate * 0.02))
                delay = next_at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            else:
                n = 16
            for _ in range(n):
                seq += 1
                now = time.time()
                base = high if int(now / PERIOD_S) % 2 == 0 else low
                sec = int(now)
                ts = b"\x08" + varint(sec) + b"\x10" + varint(int((now - sec) * 1e9))
                await call.write(base + b"\x18" + varint(seq) + b"\x22" + varint(len(ts)) + ts)
        await call.done_writing()
    except Exception:
        pass
    finally:
        reader.cancel()
        call.cancel()


# --- phases ------------------------------------------------------------------------------------


def run_phase(
    mode: str, streams: int, seconds: float, rate_total: float, procs: int
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    jobs = max(1, streams // NODES_PER_JOB)
    parent, child = ctx.Pipe()
    server = ctx.Process(target=server_main, args=(mode, jobs, child), daemon=True)
    server.start()
    port = parent.recv()
    nodes = [(f"node-{i}", i // NODES_PER_JOB % jobs, i % NODES_PER_JOB) for i in range(streams)]
    per = [nodes[i::procs] for i in range(procs)]
    rate = rate_total / streams if rate_total else 0.0
    agents = [
        ctx.Process(target=agent_main, args=(port, p, seconds, rate), daemon=True) for p in per
    ]
    started_at = time.time()
    for a in agents:
        a.start()
    warm = min(2.0, seconds / 4)
    time.sleep(warm)
    parent.send("stats")
    t0, c0, s0 = parent.recv()
    time.sleep(seconds - warm - 0.5)
    parent.send("stats")
    t1, c1, s1 = parent.recv()
    for a in agents:
        a.join(timeout=60)
        if a.is_alive():
            a.kill()
    parent.send("stop")
    out = parent.recv()
    server.join(timeout=30)
    if server.is_alive():
        server.kill()
    dt = t1 - t0
    return {
        "reports_per_s": (s1["reports"] - s0["reports"]) / dt,
        "samples_per_s": (s1["samples"] - s0["samples"]) / dt,
        "server_cpu": (c1 - c0) / dt,
        "started_at_s": started_at,
        **out,
    }


def _per_cpu(phase: dict[str, Any]) -> float:
    """Reports per second of the server's CPU time."""
    return float(phase["reports_per_s"]) / max(1e-9, float(phase["server_cpu"]))


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]


def lag_over_sustain(decided_at_s: list[float], started_at_s: float) -> list[float]:
    """Each decision's commit time less (the flip that started its condition + the sustain).
    The agents flip on multiples of PERIOD_S (wall time); a decision belongs to the
    nearest flip one sustain before it. Flips before the windows had a full sustain of
    samples (the agents' first seconds) do not count: their condition started with the
    samples, not with the flip."""
    out = []
    for t in decided_at_s:
        flip = round((t - SUSTAIN_S) / PERIOD_S) * PERIOD_S
        if flip >= started_at_s + SUSTAIN_S + 1.0:
            out.append(t - flip - SUSTAIN_S)
    return out


def hpa_path_delay(rng: random.Random, scrape_s: float) -> float:
    """Step change → HPA acts: next DCGM collection (30 s), next scrape, next HPA sync (15 s)."""
    return rng.uniform(0, 30.0) + rng.uniform(0, scrape_s) + rng.uniform(0, 15.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ingest", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="short phases (< 1 min in all)")
    ap.add_argument("--streams", type=int, default=32, help="agent streams (nodes), 4 per job")
    ap.add_argument("--seconds", type=float, default=0.0, help="length of each phase")
    ap.add_argument("--procs", type=int, default=2, help="agent processes")
    args = ap.parse_args(argv)
    seconds = args.seconds or (6.0 if args.quick else 20.0)
    t_start = time.monotonic()
    ceiling = run_phase("ceiling", args.streams, seconds, 0.0, args.procs)
    scaler = run_phase("scaler", args.streams, seconds, 0.0, args.procs)
    guarded = run_phase("guarded", args.streams, seconds, 0.0, args.procs)
    # Long enough for a few flips after the windows first fill (PERIOD_S apart).
    paced = run_phase("scaler", args.streams, seconds + 14.0, TARGET_REPORTS_S, args.procs)
    # In this process, after the phases (their servers are gone): the GPM fields' cost.
    # The same size with --quick: it takes about 2 s, and on the shared machine 9 rounds
    # of 1,000 reports left single runs 0.05-0.3 off the ratio (docs/scaler.md).
    gpm_cost = gpm_cost_ratio()
    lat_ms = [x * 1000 for x in paced["latencies_s"]]
    lags = lag_over_sustain(paced.get("decided_at_s", []), paced["started_at_s"])
    rng = random.Random(7)
    aligned = [rng.uniform(0, BUCKET_S) + rng.choice(lags or [0.0]) for _ in range(20000)]
    agent_interval_s = 1.0
    tide = [
        rng.uniform(0, agent_interval_s) + rng.choice(paced["latencies_s"] or [0.0])
        for _ in range(20000)
    ]
    hpa60 = [hpa_path_delay(rng, 60.0) for _ in range(20000)]
    hpa15 = [hpa_path_delay(rng, 15.0) for _ in range(20000)]
    ratio = statistics.mean(hpa60) / statistics.mean(tide)
    result = {
        "reports_per_s": round(scaler["reports_per_s"]),
        "samples_per_s": round(scaler["samples_per_s"]),
        "ceiling_reports_per_s": round(ceiling["reports_per_s"]),
        "ceiling_ratio": round(scaler["reports_per_s"] / max(1.0, ceiling["reports_per_s"]), 3),
        # The same per second of the server's CPU: on a shared machine a server process
        # does not always get its core, and the two phases do not get it alike.
        "ceiling_ratio_per_cpu": round(
            _per_cpu(scaler) / max(1e-9, _per_cpu(ceiling)),
            3,
        ),
        "guarded_reports_per_s": round(guarded["reports_per_s"]),
        "ceiling_ratio_guarded": round(
            guarded["reports_per_s"] / max(1.0, ceiling["reports_per_s"]), 3
        ),
        "decision_p50_ms": round(pct(lat_ms, 0.5), 2),
        "decision_p99_ms": round(pct(lat_ms, 0.99), 2),
        "lag_over_sustain_p50_s": round(pct(lags, 0.5), 3),
        "lag_over_sustain_p99_s": round(pct(lags, 0.99), 3),
        "aligned_grid_lag_p99_s": round(pct(aligned, 0.99), 3),
        "decisions": paced["decisions"],
        "paced_reports_per_s": round(paced["reports_per_s"]),
        "paced_server_cpu": round(paced["server_cpu"], 3),
        "hpa_path_mean_s": round(statistics.mean(hpa60), 1),
        "hpa_path_mean_s_15s_scrape": round(statistics.mean(hpa15), 1),
        "tide_path_mean_s": round(statistics.mean(tide), 3),
        "reaction_ratio": round(ratio, 1),
        **gpm_cost,
        "streams": args.streams,
        "seconds_per_phase": seconds,
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    rows = [
        (
            "ceiling (bare server)",
            f"{ceiling['reports_per_s']:,.0f}",
            f"{ceiling['samples_per_s']:,.0f}",
            f"{ceiling['server_cpu']:.2f}",
        ),
        (
            "scaler, saturated",
            f"{scaler['reports_per_s']:,.0f}",
            f"{scaler['samples_per_s']:,.0f}",
            f"{scaler['server_cpu']:.2f}",
        ),
        (
            "scaler, guarded",
            f"{guarded['reports_per_s']:,.0f}",
            f"{guarded['samples_per_s']:,.0f}",
            f"{guarded['server_cpu']:.2f}",
        ),
        (
            f"scaler, paced {TARGET_REPORTS_S}/s",
            f"{paced['reports_per_s']:,.0f}",
            f"{paced['samples_per_s']:,.0f}",
            f"{paced['server_cpu']:.2f}",
        ),
    ]
    print(f"{'phase':<26}{'reports/s':>12}{'samples/s':>12}{'server CPU':>12}")
    for r in rows:
        print(f"{r[0]:<26}{r[1]:>12}{r[2]:>12}{r[3]:>12}")
    print(
        f"ceiling ratio {result['ceiling_ratio']} (per second of server CPU "
        f"{result['ceiling_ratio_per_cpu']}); behind the guard {result['ceiling_ratio_guarded']}"
    )
    print(
        f"decisions: {paced['decisions']}, tipping sample -> committed decision "
        f"p50 {result['decision_p50_ms']} ms, p99 {result['decision_p99_ms']} ms "
        f"({len(lat_ms)} measured)"
    )
    print(
        f"lag over the sustain ({SUSTAIN_S:g} s, buckets of {BUCKET_S:g} s): p50 "
        f"{result['lag_over_sustain_p50_s']} s, p99 {result['lag_over_sustain_p99_s']} s "
        f"({len(lags)} decisions); a fixed bucket grid would add U(0, {BUCKET_S:g} s): p99 "
        f"{result['aligned_grid_lag_p99_s']} s"
    )
    print(
        f"reaction (sample -> decision, no sustain): tide mean {result['tide_path_mean_s']} s; "
        f"DCGM 30 s + Prometheus 60 s (15 s) + HPA 15 s mean {result['hpa_path_mean_s']} s "
        f"({result['hpa_path_mean_s_15s_scrape']} s): ratio {result['reaction_ratio']}x"
    )
    print(
        f"ingest CPU per report of {GPUS} GPUs: {gpm_cost['ingest_us_per_report']} us, with "
        f"GPM {gpm_cost['ingest_us_per_report_with_gpm']} us: ratio "
        f"{gpm_cost['ingest_cost_ratio_with_gpm']} (bench/ingest_gpm.py)"
    )
    if os.environ.get("TIDE_BENCH_VERBOSE"):
        print("latencies ms (in order):", [round(x, 1) for x in lat_ms])
    parts = paced.get("latency_parts") or []
    if parts:
        names = ("transport+queue", "wait for loop", "evaluate+commit")
        print(
            "  where it went (p50 ms): "
            + ", ".join(
                f"{n} {statistics.median(p[i] for p in parts) * 1000:.1f}"
                for i, n in enumerate(names)
            )
        )
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
