"""The runtime in-process: error mapping and the order of a graceful stop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tide.base import errors
from tide.base.client import domain_error, open_channel
from tide.services.common.config import CommonSettings
from tide.services.common.rpc import rpc_errors
from tide.services.common.server import ServiceSpec, start_server
from tide.v1 import scaler_pb2, scaler_pb2_grpc

pytestmark = pytest.mark.component


class Failing(scaler_pb2_grpc.ScalerServicer):
    @rpc_errors
    async def GetJob(self, request: Any, context: Any) -> scaler_pb2.Job:
        if request.job_id == "missing":
            raise errors.NotFound(f"no job {request.job_id!r}")
        if request.job_id == "bad":
            raise errors.InvalidArgument("job_id must be NAMESPACE/NAME")
        raise RuntimeError("boom with a secret inside")

    @rpc_errors
    async def WatchDecisions(
        self, request: Any, context: Any
    ) -> AsyncIterator[scaler_pb2.DecisionEvent]:
        yield scaler_pb2.DecisionEvent(decision_id=1)
        raise errors.FailedPrecondition("scaler is shutting down")


@pytest.fixture
async def server() -> AsyncIterator[int]:
    running = await start_server(
        CommonSettings(listen="127.0.0.1:0"),
        [ServiceSpec(scaler_pb2_grpc.add_ScalerServicer_to_server, Failing(), "tide.v1.Scaler")],
    )
    yield running.port
    await running.stop(0)


@pytest.mark.parametrize(
    ("job", "code", "text"),
    [
        ("missing", grpc.StatusCode.NOT_FOUND, "no job 'missing'"),
        ("bad", grpc.StatusCode.INVALID_ARGUMENT, "NAMESPACE/NAME"),
        ("other", grpc.StatusCode.INTERNAL, "internal error; see the server log"),
    ],
)
async def test_domain_errors_map_to_status(
    server: int, job: str, code: grpc.StatusCode, text: str
) -> None:
    async with open_channel(f"127.0.0.1:{server}") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await scaler_pb2_grpc.ScalerStub(ch).GetJob(
                scaler_pb2.GetJobRequest(job_id=job), timeout=5
            )
    assert err.value.code() == code
    assert text in (err.value.details() or "")
    assert "secret" not in (err.value.details() or "")
    back = domain_error(err.value)
    if code == grpc.StatusCode.NOT_FOUND:
        assert isinstance(back, errors.NotFound)


async def test_stream_error_after_items(server: int) -> None:
    async with open_channel(f"127.0.0.1:{server}") as ch:
        call = scaler_pb2_grpc.ScalerStub(ch).WatchDecisions(scaler_pb2.WatchDecisionsRequest())
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for ev in call:
                got.append(ev.decision_id)
    assert got == [1]
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_stop_reports_not_serving_before_closing() -> None:
    class Slow(scaler_pb2_grpc.ScalerServicer):
        started = asyncio.Event()

        async def ListJobs(self, request: Any, context: Any) -> scaler_pb2.ListJobsResponse:
            self.started.set()
            await asyncio.sleep(0.5)
            return scaler_pb2.ListJobsResponse()

    slow = Slow()
    running = await start_server(
        CommonSettings(listen="127.0.0.1:0"),
        [ServiceSpec(scaler_pb2_grpc.add_ScalerServicer_to_server, slow, "tide.v1.Scaler")],
    )
    async with open_channel(f"127.0.0.1:{running.port}") as ch:
        in_flight = asyncio.ensure_future(
            scaler_pb2_grpc.ScalerStub(ch).ListJobs(scaler_pb2.ListJobsRequest(), timeout=5)
        )
        await slow.started.wait()
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
        first = await watch.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        stopping = asyncio.ensure_future(running.stop(5))
        second = await watch.read()
        assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING
        # The in-flight call still completes within the grace period.
        await in_flight
        await stopping


async def test_a_call_logs_with_the_ids_of_its_request(
    server: int,
) -> None:
    from tide.services.common import logs

    seen: list[dict[str, object]] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append({k: getattr(record, k, None) for k in ("job_id", "msg")})

    handler = Grab()
    handler.addFilter(logs.ContextFilter())
    logging.getLogger("tide.services.common.rpc").addHandler(handler)
    try:
        async with open_channel(f"127.0.0.1:{server}") as channel:
            stub = scaler_pb2_grpc.ScalerStub(channel)
            for job in ("ns/one", "other"):
                with pytest.raises(grpc.aio.AioRpcError):
                    await stub.GetJob(scaler_pb2.GetJobRequest(job_id=job), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.GetJob(scaler_pb2.GetJobRequest(), timeout=5)
    finally:
        logging.getLogger("tide.services.common.rpc").removeHandler(handler)
    # Each call's "unhandled error" line carries its own request's job_id; the call
    # without one carries none (nothing leaked from the call before).
    assert [s["job_id"] for s in seen] == ["ns/one", "other", None]
