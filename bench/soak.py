"""Soak of one scaler process: steady ingest, stream churn and overload shedding
together, with its memory and file descriptors watched (reliability catalog
T16, T17, T18; docs/reliability.md).

    python -m bench.soak [--quick] [--seconds 120] [--agents 200] [--churn 2000]

A real scaler (``python -m tide.services.testing.scaler``: the in-memory coordinator
and actuator, SQLite) runs in its own process with a bound of streams. This
process plays the fleet on one event loop:

- ``--agents`` agents stream one report of 8 GPUs per second for the whole run;
  each report's ack latency (write to the ack that covers it) is recorded, and
  any stream error is an error;
- a churn task opens ``--churn`` short streams in all (5 reports, then
  cancelled), 20 at a time, reusing 50 node names as agents that reconnect do;
- at the end, a burst of streams past the scaler's bound: exactly the excess
  must be refused with RESOURCE_EXHAUSTED and retry advice while the agents go
  on without an error and the probe answers (``shed_correctly``).

The baseline is the scaler itself after a warm-up (RSS and open descriptors
once the agents are all connected); growth is measured against it at the end,
after the churn, once the burst's streams are closed. The last line is
``RESULT {json}``: ``rss_growth_pct``, ``fd_growth``, ``errors``, ``ack_p99_ms``,
``shed_correctly``, and the counts behind them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tide.base.grpc_options import client_options
from tide.base.listening import parse_listening
from tide.v1 import common_pb2, telemetry_pb2, telemetry_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
GPUS = 8
CHURN_NAMES = 50
CHURN_PARALLEL = 20
#: Streams allowed beyond the agents and the churn: the burst at the end asks for
#: this many and BURST_EXCESS more.
HEADROOM = 30
BURST_EXCESS = 25


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _report(node: str, boot: str, seq: int) -> telemetry_pb2.NodeReport:
    r = telemetry_pb2.NodeReport(node_name=node, boot_id=boot, seq=seq, gpu_capacity=GPUS)
    r.sampled_at.GetCurrentTime()
    for i in range(GPUS):
        r.gpus.add(
            index=i,
            utilization_pct=50.0,
            memory_used_bytes=1,
            memory_total_bytes=2,
            pod=common_pb2.PodRef(namespace="soak", name=f"{node}-p", uid=f"{node}-uid"),
        )
    return r


class Fleet:
    def __init__(self, target: str) -> None:
        self.target = target
        self.latencies_s: list[float] = []
        self.errors: list[str] = []
        self.churned = 0
        self.stop = asyncio.Event()
        self.connected = 0

    async def agent(self, ch: grpc.aio.Channel, i: int) -> None:
        stub = telemetry_pb2_grpc.TelemetryStub(ch)
        node, boot = f"soak-{i}", f"boot-{time.time_ns()}-{i}"
        call = stub.Stream()
        sent: dict[int, float] = {}

        async def read() -> None:
            async for ack in call:
                now = time.perf_counter()
                for seq in [s for s in sent if s <= ack.acked_seq]:
                    self.latencies_s.append(now - sent.pop(seq))

        reader = asyncio.create_task(read())
        try:
            seq = 0
            self.connected += 1
            while not self.stop.is_set():
                seq += 1
                sent[seq] = time.perf_counter()
                await call.write(_report(node, boot, seq))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), 1.0)
            await call.done_writing()
            await reader
        except grpc.aio.AioRpcError as exc:
            self.errors.append(f"agent {i}: {exc.code().name} {exc.details()}")
        finally:
            reader.cancel()

    async def churn(self, ch: grpc.aio.Channel, total: int) -> None:
        stub = telemetry_pb2_grpc.TelemetryStub(ch)
        seqs = [0] * CHURN_NAMES
        boots = [f"churn-boot-{time.time_ns()}-{k}" for k in range(CHURN_NAMES)]
        free = asyncio.Queue[int]()
        for k in range(CHURN_NAMES):
            free.put_nowait(k)

        async def one() -> None:
            k = await free.get()  # one live stream per node name, as a real agent
            call = stub.Stream()
            try:
                for _ in range(5):
                    seqs[k] += 1
                    await call.write(_report(f"churn-{k}", boots[k], seqs[k]))
                await call.read()
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED:
                    self.errors.append(f"churn: {exc.code().name} {exc.details()}")
            finally:
                call.cancel()
                free.put_nowait(k)
            self.churned += 1

        sem = asyncio.Semaphore(CHURN_PARALLEL)

        async def bounded() -> None:
            async with sem:
                await one()

        await asyncio.gather(*(bounded() for _ in range(total)))


async def _burst(target: str, count: int) -> tuple[int, int, int, list[Any]]:
    """Open ``count`` streams; (accepted, refused with advice, other errors, open calls)."""
    ch = grpc.aio.insecure_channel(target, options=client_options())
    stub = telemetry_pb2_grpc.TelemetryStub(ch)
    accepted = refused = other = 0
    calls: list[Any] = [ch]
    for n in range(count):
        call = stub.Stream()
        calls.append(call)
        try:
            await call.write(_report(f"burst-{n}", "burst", 1))
            await call.read()
            accepted += 1
        except grpc.aio.AioRpcError:
            # A write that races the server's refusal fails with "Internal error
            # from Core" on the client; the call's own status is the server's answer.
            code = await call.code()
            advice = dict(await call.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED and advice:
                refused += 1
            else:
                other += 1
                print(f"burst stream {n}: {code.name} {await call.details()}", file=sys.stderr)
    return accepted, refused, other, calls


async def _healthy(target: str) -> bool:
    async with grpc.aio.insecure_channel(target) as ch:
        stub: Any = health_pb2_grpc.HealthStub(ch)  # grpcio-health ships no stub types
        resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


async def soak(pid: int, target: str, seconds: float, agents: int, churn: int) -> dict[str, Any]:
    fleet = Fleet(target)
    # Agents over a few channels, as many nodes would be many connections.
    channels = [grpc.aio.insecure_channel(target, options=client_options()) for _ in range(8)]
    tasks = [asyncio.create_task(fleet.agent(channels[i % 8], i)) for i in range(agents)]
    warm_s = min(15.0, seconds / 4)
    await asyncio.sleep(warm_s)
    base_rss, base_fds = _rss_kib(pid), _fds(pid)
    fleet.latencies_s.clear()
    started = time.monotonic()
    churn_ch = grpc.aio.insecure_channel(target, options=client_options())
    churner = asyncio.create_task(fleet.churn(churn_ch, churn))
    await asyncio.sleep(max(0.0, seconds - warm_s - 10.0))
    await churner
    churn_s = time.monotonic() - started
    await churn_ch.close()
    await asyncio.sleep(1.0)  # the last churned streams' handlers end
    # The burst: the scaler's bound leaves CHURN_PARALLEL + HEADROOM slots past the
    # agents; ask for BURST_EXCESS more than that.
    room = CHURN_PARALLEL + HEADROOM
    accepted, refused, other, calls = await _burst(target, room + BURST_EXCESS)
    probe_ok = await _healthy(target)
    for c in calls[1:]:
        c.cancel()
    await calls[0].close()
    await asyncio.sleep(3.0)  # the agents report on through and after the burst
    fleet.stop.set()
    await asyncio.gather(*tasks)
    for ch in channels:
        await ch.close()
    await asyncio.sleep(2.0)  # handlers of closed streams end
    end_rss, end_fds = _rss_kib(pid), _fds(pid)
    lat = sorted(fleet.latencies_s)
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan")
    return {
        "rss_growth_pct": round(100.0 * (end_rss - base_rss) / base_rss, 2),
        "fd_growth": end_fds - base_fds,
        "errors": len(fleet.errors),
        "ack_p99_ms": round(p99 * 1000, 2),
        "ack_p50_ms": round(statistics.median(lat) * 1000, 2) if lat else None,
        "shed_correctly": int(
            accepted == room and refused == BURST_EXCESS and other == 0 and probe_ok
        ),
        "acks": len(lat),
        "agents": agents,
        "churned_streams": fleet.churned,
        "churn_s": round(churn_s, 1),
        "burst_accepted": accepted,
        "burst_refused": refused,
        "base_rss_mib": round(base_rss / 1024, 1),
        "end_rss_mib": round(end_rss / 1024, 1),
        "base_fds": base_fds,
        "first_errors": fleet.errors[:3],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 minutes, 2,000 churned streams")
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--agents", type=int, default=200)
    ap.add_argument("--churn", type=int, default=10_000)
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds, args.churn = 120.0, 2000
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tide.services.testing.scaler",
                "--coordinator",
                "memory",
                "--actuator",
                "memory",
                "--db",
                f"sqlite:///{tmp}/tide.db",
                "--listen",
                "127.0.0.1:0",
                "--insecure",
                "--log-level",
                "ERROR",
                "--max-inflight-streams",
                str(args.agents + CHURN_PARALLEL + HEADROOM),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            ports = None
            while ports is None:
                line = proc.stdout.readline()
                if not line:
                    raise SystemExit("the scaler did not start")
                ports = parse_listening(line)
            result = asyncio.run(
                soak(
                    proc.pid, f"127.0.0.1:{ports.grpc_port}", args.seconds, args.agents, args.churn
                )
            )
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(json.dumps(result, indent=1), file=sys.stderr)
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
