"""The cost of every scaler replica ingesting: CPU per report on a follower and on
the leader (docs/reliability.md, Leader election).

    python -m bench.replicas [--quick] [--nodes 40] [--rate-hz 4] [--seconds 10]

Two replicas of ``python -m tide.services.testing.scaler`` (``--leader-election sql``,
one SQLite store, the in-memory coordinator), and jobs of two trainers of one GPU
each. The same agents stream the same reports to both, as agents that fan out to
every replica would: ``--nodes`` nodes of 8 GPUs (4 jobs a node), at
``--rate-hz``, utilization between the thresholds so that the leader evaluates
every job each pass without deciding. Each replica's CPU time (utime + stime,
/proc) is read over ``--seconds`` idle first (the baseline, measured in the same
run: lease renewals, the store probe, the leader's evaluation passes), then over
``--seconds`` of streaming. ``cpu_ms_per_report_*`` is the streaming CPU less the
idle CPU, per report ingested; ``follower_over_leader`` their ratio. The bench's
own agents share the machine, so absolute figures are a loaded machine's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from bench.failover import _serving, _start, _wait
from tide.base.grpc_options import client_options
from tide.services.testing.replicas import replica_args
from tide.v1 import common_pb2, scaler_pb2, scaler_pb2_grpc, telemetry_pb2, telemetry_pb2_grpc

T = 5.0
GPUS = 8


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    # utime and stime are fields 14 and 15 of stat, 12 and 13 after the name.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _replica(tmp: Path, owner: str) -> tuple[Any, str]:
    return _start(
        replica_args(
            tmp,
            owner,
            f"sqlite:///{tmp / 'scaler.db'}",
            "--leader-election",
            "sql",
            "--min-replicas",
            "1",
            "--max-gpus-per-node",
            str(GPUS),
        ),
        log=tmp / f"{owner}.log",
    )


def _report(node: int, seq: int) -> telemetry_pb2.NodeReport:
    r = telemetry_pb2.NodeReport(node_name=f"node-{node}", boot_id="b", seq=seq, gpu_capacity=GPUS)
    r.sampled_at.GetCurrentTime()
    for i in range(GPUS):
        g = r.gpus.add(index=i, uuid=f"GPU-{node}-{i}", utilization_pct=60.0)
        # One GPU per trainer, two trainers per job, named as the in-memory
        # coordinator names its members.
        gpu = node * GPUS + i
        pod = f"j{gpu // 2}-trainer-{gpu % 2}"
        g.pod.CopyFrom(common_pb2.PodRef(namespace="ns", name=pod, uid=pod))
    return r


async def _agent(target: str, node: int, rate_hz: float, end: float) -> int:
    sent = 0
    async with grpc.aio.insecure_channel(target, options=client_options()) as ch:
        call = telemetry_pb2_grpc.TelemetryStub(ch).Stream()

        async def acks() -> None:
            async for _ in call:
                pass

        reader = asyncio.create_task(acks())
        while time.monotonic() < end:
            sent += 1
            await call.write(_report(node, sent))
            await asyncio.sleep(1 / rate_hz)
        await call.done_writing()
        reader.cancel()
    return sent


async def _stream(targets: list[str], nodes: int, rate_hz: float, seconds: float) -> int:
    end = time.monotonic() + seconds
    sent = await asyncio.gather(
        *(_agent(t, n, rate_hz, end) for t in targets for n in range(nodes))
    )
    return sum(sent) // len(targets)


def run(tmp: Path, nodes: int, jobs: int, rate_hz: float, seconds: float) -> dict[str, Any]:
    leader, leader_target = _replica(tmp, "leader")
    follower = None
    try:
        _wait(lambda: _serving(leader_target), 30, "the leader", tmp)
        with grpc.insecure_channel(leader_target) as ch:
            stub = scaler_pb2_grpc.ScalerStub(ch)
            for j in range(jobs):
                stub.UpsertJob(
                    scaler_pb2.UpsertJobRequest(job_id=f"ns/j{j}", initial_replicas=2), timeout=T
                )

            def idle() -> bool:
                listed = stub.ListJobs(scaler_pb2.ListJobsRequest(), timeout=T).jobs
                return all(j.active_decision_id == 0 and j.current_replicas == 2 for j in listed)

            _wait(idle, 60, "every job's first resize", tmp)
        # Started once the jobs run, so its in-memory coordinator knows their trainers.
        follower, follower_target = _replica(tmp, "follower")
        with grpc.insecure_channel(follower_target) as ch:
            stub = scaler_pb2_grpc.ScalerStub(ch)
            _wait(
                lambda: len(stub.ListJobs(scaler_pb2.ListJobsRequest(), timeout=T).jobs) == jobs,
                30,
                "the follower to know the jobs",
                tmp,
            )
        pids = {"leader": leader.pid, "follower": follower.pid}
        before = {k: _cpu_s(p) for k, p in pids.items()}
        time.sleep(seconds)
        idle_cpu = {k: _cpu_s(p) - before[k] for k, p in pids.items()}
        before = {k: _cpu_s(p) for k, p in pids.items()}
        reports = asyncio.run(_stream([leader_target, follower_target], nodes, rate_hz, seconds))
        busy_cpu = {k: _cpu_s(p) - before[k] for k, p in pids.items()}
        # The windows did fill on both: the follower ingested, not just acked.
        with grpc.insecure_channel(follower_target) as ch:
            got = scaler_pb2_grpc.ScalerStub(ch).GetJob(
                scaler_pb2.GetJobRequest(job_id="ns/j0"), timeout=T
            )
            follower_coverage = got.window.coverage
    finally:
        for p in (leader, follower):
            if p is not None:
                p.terminate()
                p.wait(timeout=20)
    per = {k: 1000 * (busy_cpu[k] - idle_cpu[k]) / max(reports, 1) for k in pids}
    return {
        "reports_per_replica": reports,
        "reports_per_s": round(reports / seconds, 1),
        "cpu_ms_per_report_leader": round(per["leader"], 3),
        "cpu_ms_per_report_follower": round(per["follower"], 3),
        "follower_over_leader": round(per["follower"] / per["leader"], 3) if per["leader"] else 0,
        "idle_cpu_pct_leader": round(100 * idle_cpu["leader"] / seconds, 2),
        "idle_cpu_pct_follower": round(100 * idle_cpu["follower"] / seconds, 2),
        "follower_window_coverage": round(follower_coverage, 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the defaults (about 40 s)")
    ap.add_argument("--nodes", type=int, default=10)
    ap.add_argument("--rate-hz", type=float, default=10.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = run(Path(tmp), args.nodes, args.nodes * GPUS // 2, args.rate_hz, args.seconds)
    print(json.dumps(result, indent=1), file=sys.stderr)
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
