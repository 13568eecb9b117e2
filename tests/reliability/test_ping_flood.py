"""Reliability catalog T23, ping floods: a client that pings a Tide server far more
often than tide/base/grpc_options.py permits (one ping per half the clients'
keepalive time, 10 s, without data) is sent GOAWAY(too_many_pings) after two
strikes and its connection closed; every other caller goes on unaffected.

The flooder is gRPC's own channel with keepalive every 50 ms and no limit on pings
without data (no raw HTTP/2 library is installed): it holds one telemetry stream
open and idle, so every ping arrives without data. gRPC's client itself sends
no more than one ping a second, so the GOAWAY comes about 5 s in (two strikes,
then the third ping too soon), not in milliseconds as a raw HTTP/2 flood's would.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from tests.common.sample_service import EchoTelemetry
from tide.base.grpc_options import client_options
from tide.services.common.config import CommonSettings
from tide.services.common.server import RunningServer, ServiceSpec, start_server
from tide.v1 import telemetry_pb2, telemetry_pb2_grpc

pytestmark = pytest.mark.component

T = 5.0
FLOOD_OPTIONS = [
    ("grpc.keepalive_time_ms", 50),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


@pytest.fixture
async def server() -> AsyncIterator[RunningServer]:
    running = await start_server(
        CommonSettings(listen="127.0.0.1:0"),
        [
            ServiceSpec(
                telemetry_pb2_grpc.add_TelemetryServicer_to_server,
                EchoTelemetry(),
                "tide.v1.Telemetry",
            )
        ],
        registry=CollectorRegistry(),
    )
    yield running
    await running.stop(0)


def _report(node: str, seq: int) -> telemetry_pb2.NodeReport:
    r = telemetry_pb2.NodeReport(node_name=node, boot_id="b", seq=seq)
    r.sampled_at.GetCurrentTime()
    return r


async def test_a_ping_flood_gets_goaway_and_other_callers_go_on(server: RunningServer) -> None:
    target = f"127.0.0.1:{server.port}"
    agent_reports: asyncio.Queue[telemetry_pb2.NodeReport | None] = asyncio.Queue()
    stop = asyncio.Event()

    async def from_queue() -> AsyncIterator[telemetry_pb2.NodeReport]:
        while (r := await agent_reports.get()) is not None:
            yield r

    async def one_then_idle() -> AsyncIterator[telemetry_pb2.NodeReport]:
        yield _report("flooder", 1)
        await stop.wait()  # idle from here: the flooder's pings come without data

    async with (
        grpc.aio.insecure_channel(target, options=client_options()) as good,
        grpc.aio.insecure_channel(target, options=FLOOD_OPTIONS) as flood,
    ):
        # A well-behaved agent's stream, open across the flood.
        agent: Any = telemetry_pb2_grpc.TelemetryStub(good).Stream(from_queue())
        agent_reports.put_nowait(_report("agent", 1))
        assert (await agent.read()).acked_seq == 1

        started = time.monotonic()
        flooded: Any = telemetry_pb2_grpc.TelemetryStub(flood).Stream(one_then_idle())
        assert (await flooded.read()).acked_seq == 1
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(flooded.read(), 10)
        refused_after = time.monotonic() - started
        stop.set()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        # GOAWAY(ENHANCE_YOUR_CALM, "too_many_pings"), as gRPC reports it.
        assert "too many pings" in (err.value.details() or "").lower(), err.value
        print(f"T23 ping flood: closed after {refused_after:.2f} s: {err.value.details()}")
        # gRPC's client spaces its pings 1 s apart whatever keepalive asks: two strikes
        # and the third ping too soon close it after about 5 s here.
        assert refused_after < 15.0, refused_after

        # The agent's stream on its own connection goes on, and new callers are served.
        agent_reports.put_nowait(_report("agent", 2))
        assert (await asyncio.wait_for(agent.read(), T)).acked_seq == 2
        health: Any = health_pb2_grpc.HealthStub(good)
        resp = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=T)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        agent_reports.put_nowait(None)
        async with grpc.aio.insecure_channel(target, options=client_options()) as fresh:
            late: Any = telemetry_pb2_grpc.TelemetryStub(fresh).Stream(
                iter([_report("late", 1), _report("late", 2)]), timeout=T
            )
            assert [a.acked_seq async for a in late] == [1, 2]
