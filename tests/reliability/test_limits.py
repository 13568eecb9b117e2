"""Reliability catalog T18, T21 and T23: a bound on calls in flight with a clear
answer past it, oversized messages refused, idle telemetry streams closed, and
the server answering everyone else (and its probe) throughout."""

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
from tests.support.poll import eventually
from tide.base.grpc_options import MAX_MESSAGE_BYTES
from tide.services.common.config import CommonSettings
from tide.services.common.server import RunningServer, ServiceSpec, start_server
from tide.v1 import scaler_pb2, scaler_pb2_grpc, telemetry_pb2, telemetry_pb2_grpc

pytestmark = pytest.mark.component

T = 5.0


class Gated(scaler_pb2_grpc.ScalerServicer):
    """GetJob waits for the gate: calls stay in flight as long as a test wants."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.waiting = 0

    async def GetJob(self, request: Any, context: Any) -> scaler_pb2.Job:
        self.waiting += 1
        await self.gate.wait()
        return scaler_pb2.Job(job_id=request.job_id)


async def serve(servicer: Gated, registry: CollectorRegistry) -> RunningServer:
    return await start_server(
        CommonSettings(listen="127.0.0.1:0", max_inflight_unary_calls=2, max_inflight_streams=2),
        [
            ServiceSpec(scaler_pb2_grpc.add_ScalerServicer_to_server, servicer, "tide.v1.Scaler"),
            ServiceSpec(
                telemetry_pb2_grpc.add_TelemetryServicer_to_server,
                EchoTelemetry(),
                "tide.v1.Telemetry",
            ),
        ],
        registry=registry,
    )


@pytest.fixture
async def live() -> AsyncIterator[tuple[RunningServer, Gated, CollectorRegistry]]:
    registry = CollectorRegistry()
    servicer = Gated()
    running = await serve(servicer, registry)
    yield running, servicer, registry
    servicer.gate.set()
    await running.stop(0)


async def healthy(port: int) -> bool:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=T
        )
    return resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_unary_calls_past_the_bound_are_shed_with_retry_advice(
    live: tuple[RunningServer, Gated, CollectorRegistry],
) -> None:
    running, servicer, registry = live
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as ch:
        stub = scaler_pb2_grpc.ScalerStub(ch)
        held = [
            asyncio.ensure_future(stub.GetJob(scaler_pb2.GetJobRequest(job_id=f"ns/{i}")))
            for i in range(2)
        ]
        await eventually(lambda: servicer.waiting == 2, timeout_s=T)
        started = time.monotonic()
        call = stub.GetJob(scaler_pb2.GetJobRequest(job_id="ns/third"), timeout=T)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        # Answered at once, not queued behind the held calls.
        assert time.monotonic() - started < 1.0
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "retry in" in (err.value.details() or "")
        trailers = dict(err.value.trailing_metadata() or ())
        assert trailers.get("grpc-retry-pushback-ms") == "1000"
        # Probes are never shed, and streams have a bound of their own.
        assert await healthy(running.port)
        stream = telemetry_pb2_grpc.TelemetryStub(ch).Stream()
        await stream.write(telemetry_pb2.NodeReport(node_name="n", boot_id="b", seq=1))
        assert (await stream.read()).acked_seq == 1
        await stream.done_writing()
        servicer.gate.set()
        assert [r.job_id for r in await asyncio.gather(*held)] == ["ns/0", "ns/1"]
        assert (
            await stub.GetJob(scaler_pb2.GetJobRequest(job_id="ns/after"), timeout=T)
        ).job_id == "ns/after"
    assert registry.get_sample_value("tide_grpc_shed_total", {"kind": "unary"}) == 1


async def test_streams_past_the_bound_are_shed_and_a_freed_slot_is_reused(
    live: tuple[RunningServer, Gated, CollectorRegistry],
) -> None:
    running, _, registry = live
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as ch:
        stub = telemetry_pb2_grpc.TelemetryStub(ch)

        async def open_stream(seq: int) -> Any:
            s = stub.Stream()
            await s.write(telemetry_pb2.NodeReport(node_name=f"n{seq}", boot_id="b", seq=seq))
            return s, await s.read()

        held = [await open_stream(i + 1) for i in range(2)]
        assert [ack.acked_seq for _, ack in held] == [1, 2]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await open_stream(3)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await healthy(running.port)
        first, _ = held[0]
        first.cancel()
        # The slot comes back once the cancelled stream's handler has ended.
        for _ in range(100):
            try:
                _, ack = await open_stream(4)
                break
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                await asyncio.sleep(0.02)
        else:
            raise AssertionError("a cancelled stream never gave its slot back")
        assert ack.acked_seq == 4
    assert (registry.get_sample_value("tide_grpc_shed_total", {"kind": "stream"}) or 0) >= 1


async def test_an_oversized_message_is_refused_and_the_server_goes_on(
    live: tuple[RunningServer, Gated, CollectorRegistry],
) -> None:
    running, servicer, _ = live
    # A client that would send more than the server takes (ours never does).
    big = [("grpc.max_send_message_length", 2 * MAX_MESSAGE_BYTES)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}", options=big) as ch:
        stub = scaler_pb2_grpc.ScalerStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetJob(
                scaler_pb2.GetJobRequest(job_id="x" * (MAX_MESSAGE_BYTES + 1)), timeout=T
            )
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert servicer.waiting == 0  # refused before any handler ran
    assert await healthy(running.port)
