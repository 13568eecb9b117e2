"""The real coordinator client and member registry against a Coordinator served
on a real socket (a scripted servicer: the coordinator itself is another issue)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from tests.support.poll import eventually
from tide.base.client import open_channel
from tide.base.errors import NotFound
from tide.base.grpc_options import client_options, server_options
from tide.services.common.clock import SystemClock
from tide.services.scaler.coordination import GrpcCoordinatorClient, Phase, ResizeSpec
from tide.services.scaler.ingest import Ingest, IngestSettings, Rejection
from tide.services.scaler.members import CoordinatorMemberRegistry
from tide.services.scaler.metrics import IngestCollector
from tide.services.testing.members import InMemoryMemberRegistry
from tide.v1 import coordinator_pb2 as cpb
from tide.v1 import coordinator_pb2_grpc

pytestmark = pytest.mark.component


class ScriptedCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self) -> None:
        self.resizes: list[cpb.ResizeRequest] = []
        self.members = asyncio.Queue[list[cpb.Member]]()

    async def Resize(
        self, request: cpb.ResizeRequest, context: Any
    ) -> AsyncIterator[cpb.ResizeProgress]:
        self.resizes.append(request)
        for phase in (cpb.RESIZE_PHASE_CHECKPOINTING, cpb.RESIZE_PHASE_RENDEZVOUS):
            yield cpb.ResizeProgress(decision_id=request.decision_id, phase=phase)
        yield cpb.ResizeProgress(
            decision_id=request.decision_id,
            phase=cpb.RESIZE_PHASE_COMPLETED,
            generation=7,
            world_size=request.target_world_size,
            pause_s=1.25,
        )

    async def AbortResize(
        self, request: cpb.AbortResizeRequest, context: Any
    ) -> cpb.AbortResizeResponse:
        return cpb.AbortResizeResponse(phase=cpb.RESIZE_PHASE_ABORTED)

    async def GetJobStatus(self, request: cpb.GetJobStatusRequest, context: Any) -> cpb.JobStatus:
        if request.job_id != "ns/a":
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job {request.job_id}")
        return cpb.JobStatus(job_id="ns/a", generation=3, world_size=2)

    async def WatchJob(
        self, request: cpb.GetJobStatusRequest, context: Any
    ) -> AsyncIterator[cpb.JobStatus]:
        while True:
            members = await self.members.get()
            yield cpb.JobStatus(job_id=request.job_id, members=members)


@pytest.fixture
async def coordinator() -> AsyncIterator[tuple[ScriptedCoordinator, str]]:
    servicer = ScriptedCoordinator()
    server = grpc.aio.server(options=server_options())
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    await server.stop(0)


async def test_grpc_client_resize_abort_status(
    coordinator: tuple[ScriptedCoordinator, str],
) -> None:
    servicer, target = coordinator
    async with open_channel(target) as ch:
        client = GrpcCoordinatorClient(ch)
        spec = ResizeSpec(5, "ns/a", 4, deadline_s=2.0, leaving_pods=("p3",))
        phases = [p.phase async for p in client.resize(spec)]
        assert phases == [Phase.CHECKPOINTING, Phase.RENDEZVOUS, Phase.COMPLETED]
        assert list(servicer.resizes[0].leaving_pods) == ["p3"]
        assert await client.abort_resize(5, "ns/a", "x") is Phase.ABORTED
        st = await client.job_status("ns/a")
        assert (st.generation, st.world_size) == (3, 2)
        with pytest.raises(NotFound, match="no job"):
            await client.job_status("ns/b")


async def test_member_registry_follows_watch_job(
    coordinator: tuple[ScriptedCoordinator, str],
) -> None:
    servicer, target = coordinator
    async with open_channel(target) as ch:
        client = GrpcCoordinatorClient(ch)
        reg = CoordinatorMemberRegistry(client.watch_members)
        reg.track("ns/a")
        servicer.members.put_nowait(
            [
                cpb.Member(pod_name="a-0", pod_uid="u0", state=cpb.MEMBER_STATE_ACTIVE),
                cpb.Member(pod_name="a-1", pod_uid="u1", state=cpb.MEMBER_STATE_STANDBY),
                cpb.Member(pod_name="a-2", pod_uid="u2", state=cpb.MEMBER_STATE_GONE),
            ]
        )
        await eventually(lambda: len(reg.members("ns/a")) == 2, what="the first status")
        # A STANDBY newcomer's GPUs are not the job's yet: only ACTIVE members attribute.
        assert reg.by_uid == {"u0": "ns/a"}
        assert client.latest_status("ns/a") is not None
        assert reg.by_name["ns/a-0"] == "ns/a" and "ns/a-1" not in reg.by_name
        assert reg.member_count("ns/a") == 1
        servicer.members.put_nowait(
            [
                cpb.Member(pod_name="a-0", pod_uid="u0", state=cpb.MEMBER_STATE_ACTIVE),
                cpb.Member(pod_name="a-1", pod_uid="u1", state=cpb.MEMBER_STATE_ACTIVE),
            ]
        )
        await eventually(lambda: "u1" in reg.by_uid, what="the newcomer in the generation")
        assert reg.by_uid == {"u0": "ns/a", "u1": "ns/a"}
        servicer.members.put_nowait(
            [cpb.Member(pod_name="a-0", pod_uid="u0", state=cpb.MEMBER_STATE_DRAINING)]
        )
        await eventually(lambda: not reg.by_uid, what="the leaver dropped")
        await reg.close()


def test_telemetry_limits_match_the_agents_channel() -> None:
    server = dict(server_options())
    client = dict(client_options())
    assert server["grpc.max_receive_message_length"] == client["grpc.max_send_message_length"]
    # The agent may ping as often as its keepalive says without being struck off.
    assert (
        server["grpc.http2.min_recv_ping_interval_without_data_ms"]
        <= client["grpc.keepalive_time_ms"]
    )


def test_metrics_export_counters_by_reason() -> None:
    from tests.scaler.support import report

    engine = Ingest(IngestSettings(), InMemoryMemberRegistry(), SystemClock())
    reg = CollectorRegistry()
    reg.register(IngestCollector(engine))
    st = engine.open_stream()
    r = report(seq=1, utils=[50.0, 150.0])
    engine.process(st, r)
    engine.process(st, r)
    assert engine.rejected[Rejection.UTILIZATION_OUT_OF_RANGE] == 1
    get = reg.get_sample_value
    assert (
        get("tide_scaler_telemetry_samples_rejected_total", {"reason": "utilization_out_of_range"})
        == 1
    )
    # A reason is counted in its own scope only: a sample is not a report nor a stream.
    assert get("tide_scaler_telemetry_reports_rejected_total", {"reason": "non_finite"}) is None
    assert get("tide_scaler_telemetry_streams_rejected_total", {"reason": "malformed"}) == 0
    assert get("tide_scaler_telemetry_nodes", {"freshness": "fresh"}) == 1
    assert get("tide_scaler_telemetry_reports_total", {"result": "duplicate"}) == 1
    assert get("tide_scaler_telemetry_samples_accepted_total") == 1
    assert get("tide_scaler_telemetry_streams") == 1
