"""``open_channel`` over a list of replicas (tide.base.client.channel_target): calls go to
the replica whose gRPC health is SERVING, and follow it when another one becomes the
leader, as launchers and the scaler dial coordinator replicas without a Service."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.trainer.fake_coordinator import FakeCoordinator
from tide.base.client import open_channel
from tide.v1 import coordinator_pb2 as pb
from tide.v1 import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.component

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Replica:
    def __init__(self) -> None:
        self.coordinator = FakeCoordinator()
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server()
        self.port = 0

    async def start(self, status: int) -> None:
        pb_grpc.add_CoordinatorServicer_to_server(self.coordinator, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        await self.health.set("", status)


@pytest.fixture
async def replicas() -> AsyncIterator[tuple[Replica, Replica]]:
    a, b = Replica(), Replica()
    await a.start(SERVING)
    await b.start(NOT_SERVING)
    yield a, b
    for r in (a, b):
        await r.server.stop(None)


async def _register(stub: pb_grpc.CoordinatorAsyncStub, pod: str) -> bool:
    try:
        await stub.Register(
            pb.RegisterRequest(
                job_id="ns/job", pod_name=pod, host="127.0.0.1", launcher_id=pod, free_port=1
            ),
            timeout=2.0,
        )
    except grpc.aio.AioRpcError:
        return False
    return True


async def test_calls_go_to_the_serving_replica_and_follow_a_new_leader(
    replicas: tuple[Replica, Replica],
) -> None:
    a, b = replicas
    channel = open_channel(f"127.0.0.1:{a.port},127.0.0.1:{b.port}")
    stub: pb_grpc.CoordinatorAsyncStub = pb_grpc.CoordinatorStub(channel)
    try:
        for i in range(6):
            assert await _register(stub, f"a-{i}")
        assert len(a.coordinator.members) == 6 and b.coordinator.members == {}

        # b is elected, a stands by: the channel learns it from the health watch.
        await b.health.set("", SERVING)
        await a.health.set("", NOT_SERVING)
        deadline = time.monotonic() + 10
        n = 0
        while not b.coordinator.members:
            assert time.monotonic() < deadline, "no call reached the new leader"
            await _register(stub, f"b-{n}")
            n += 1
            await asyncio.sleep(0.02)
        before = len(a.coordinator.members)
        for i in range(6):
            assert await _register(stub, f"c-{i}")
        assert len(a.coordinator.members) == before
    finally:
        await channel.close()
