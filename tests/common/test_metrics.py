"""What every service exports: the gRPC server metrics (over a real socket) and build info."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from tide.base import errors
from tide.base.client import open_channel
from tide.services.common.config import CommonSettings
from tide.services.common.metrics import register_build_info
from tide.services.common.rpc import rpc_errors
from tide.services.common.server import RunningServer, ServiceSpec, start_server
from tide.v1 import scaler_pb2, scaler_pb2_grpc

pytestmark = pytest.mark.component


class Sample(scaler_pb2_grpc.ScalerServicer):
    @rpc_errors
    async def GetJob(self, request: Any, context: Any) -> scaler_pb2.Job:
        if request.job_id == "missing":
            raise errors.NotFound("no such job")
        return scaler_pb2.Job(job_id=request.job_id)

    @rpc_errors
    async def UpsertJob(self, request: Any, context: Any) -> scaler_pb2.Job:
        return scaler_pb2.Job(job_id=request.job_id)

    @rpc_errors
    async def WatchDecisions(
        self, request: Any, context: Any
    ) -> AsyncIterator[scaler_pb2.DecisionEvent]:
        for i in range(3):
            yield scaler_pb2.DecisionEvent(decision_id=i)


@pytest.fixture
async def served() -> AsyncIterator[tuple[RunningServer, CollectorRegistry]]:
    registry = CollectorRegistry()
    running = await start_server(
        CommonSettings(listen="127.0.0.1:0", admin_token="s3cret"),
        [ServiceSpec(scaler_pb2_grpc.add_ScalerServicer_to_server, Sample(), "tide.v1.Scaler")],
        admin_methods=frozenset({"/tide.v1.Scaler/UpsertJob"}),
        registry=registry,
    )
    yield running, registry
    await running.stop(0)


async def test_calls_are_counted_by_method_type_and_code(
    served: tuple[RunningServer, CollectorRegistry],
) -> None:
    running, registry = served
    async with open_channel(f"127.0.0.1:{running.port}") as channel:
        stub = scaler_pb2_grpc.ScalerStub(channel)
        await stub.GetJob(scaler_pb2.GetJobRequest(job_id="ns/a"), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.GetJob(scaler_pb2.GetJobRequest(job_id="missing"), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.UpsertJob(scaler_pb2.UpsertJobRequest(job_id="ns/a"), timeout=5)
        got = [e.decision_id async for e in stub.WatchDecisions(scaler_pb2.WatchDecisionsRequest())]
        assert got == [0, 1, 2]

    def value(name: str, method: str, kind: str = "unary", **more: str) -> float | None:
        labels = {"grpc_service": "tide.v1.Scaler", "grpc_method": method, "grpc_type": kind}
        return registry.get_sample_value(name, {**labels, **more})

    assert value("grpc_server_started_total", "GetJob") == 2
    assert value("grpc_server_handled_total", "GetJob", grpc_code="OK") == 1
    assert value("grpc_server_handled_total", "GetJob", grpc_code="NOT_FOUND") == 1
    # The token check comes after the count: a refused admin call is seen.
    assert value("grpc_server_handled_total", "UpsertJob", grpc_code="UNAUTHENTICATED") == 1
    assert value("grpc_server_handling_seconds_count", "GetJob") == 2
    stream = ("WatchDecisions", "server_stream")
    assert value("grpc_server_handled_total", *stream, grpc_code="OK") == 1


async def test_two_servers_on_one_registry_share_the_series() -> None:
    registry = CollectorRegistry()
    servers = [
        await start_server(CommonSettings(listen="127.0.0.1:0"), [], registry=registry)
        for _ in range(2)
    ]
    for s in servers:
        await s.stop(0)


def test_build_info_names_the_service_and_version() -> None:
    registry = CollectorRegistry()
    register_build_info(registry, "scaler")
    sample = next(s for m in registry.collect() for s in m.samples if s.name == "tide_build_info")
    assert sample.value == 1
    assert sample.labels["service"] == "scaler"
    assert sample.labels["version"] and sample.labels["grpc"] == grpc.__version__
