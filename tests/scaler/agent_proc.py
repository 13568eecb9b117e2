"""A stand-in node agent, run as its own process: streams one report per interval
until killed. Usage: python -m tests.scaler.agent_proc TARGET NODE UTIL INTERVAL_S POD..."""

from __future__ import annotations

import asyncio
import sys
import time

import grpc

from tide.base.grpc_options import client_options
from tide.v1 import common_pb2, telemetry_pb2, telemetry_pb2_grpc


async def main(target: str, node: str, util: float, interval_s: float, pods: list[str]) -> None:
    boot = f"boot-{time.time_ns()}"
    async with grpc.aio.insecure_channel(target, options=client_options()) as ch:
        stub = telemetry_pb2_grpc.TelemetryStub(ch)
        call = stub.Stream()
        seq = 0
        print("STREAMING", flush=True)
        while True:
            seq += 1
            r = telemetry_pb2.NodeReport(
                node_name=node, boot_id=boot, seq=seq, gpu_capacity=len(pods)
            )
            r.sampled_at.GetCurrentTime()
            for i, pod in enumerate(pods):
                r.gpus.add(
                    index=i,
                    utilization_pct=util,
                    memory_used_bytes=1,
                    memory_total_bytes=2,
                    pod=common_pb2.PodRef(namespace="ns", name=pod, uid=pod),
                )
            await call.write(r)
            await asyncio.sleep(interval_s)


if __name__ == "__main__":
    a = sys.argv[1:]
    asyncio.run(main(a[0], a[1], float(a[2]), float(a[3]), a[4:]))
