"""Shared helpers of the scaler tests (import these, never the conftest)."""

from __future__ import annotations

import time

import grpc

from tide.base.timeconv import ts_from_seconds
from tide.services.scaler.ingest import Ingest
from tide.v1 import common_pb2, telemetry_pb2


def report(
    node: str = "n1",
    seq: int = 1,
    *,
    boot: str = "b1",
    utils: list[float] | None = None,
    pods: list[str] | None = None,
    t: float | None = None,
    capacity: int = 8,
    namespace: str = "ns",
) -> telemetry_pb2.NodeReport:
    """A report of len(utils) GPUs; GPU i is held by pods[i] (uid and name) when given."""
    utils = [50.0] * 8 if utils is None else utils
    r = telemetry_pb2.NodeReport(node_name=node, boot_id=boot, seq=seq, gpu_capacity=capacity)
    r.sampled_at.CopyFrom(ts_from_seconds(time.time() if t is None else t))
    for i, u in enumerate(utils):
        g = r.gpus.add(
            index=i,
            uuid=f"GPU-{node}-{i}",
            utilization_pct=u,
            memory_used_bytes=1 << 30,
            memory_total_bytes=16 << 30,
            power_w=200.0,
            temperature_c=60.0,
        )
        if pods and pods[i]:
            g.pod.CopyFrom(common_pb2.PodRef(namespace=namespace, name=pods[i], uid=pods[i]))
    return r


class TelemetryServer:
    def __init__(self, engine: Ingest, server: grpc.aio.Server, port: int) -> None:
        self.engine = engine
        self.server = server
        self.port = port
        self.target = f"127.0.0.1:{port}"
