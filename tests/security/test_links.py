"""Every link of a scaler and a coordinator run with mTLS (tide.services.testing.stack): each
identity may do what it is for, and each forged or unauthenticated shape is refused."""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tide.base.errors import NotFound
from tide.base.timeconv import ts_from_seconds
from tide.services.common.pki import CertificateAuthority
from tide.services.scaler.ingest import Rejection
from tide.services.testing.stack import Stack, start_stack
from tide.v1 import coordinator_pb2 as cpb
from tide.v1 import coordinator_pb2_grpc as cpb_grpc
from tide.v1 import scaler_pb2, scaler_pb2_grpc, telemetry_pb2, telemetry_pb2_grpc

pytestmark = pytest.mark.component

T = 10.0
DENIED = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = await start_stack(tmp_path)
    try:
        yield s
    finally:
        await s.close()


def _report(node: str, seq: int = 1) -> telemetry_pb2.NodeReport:
    import time

    return telemetry_pb2.NodeReport(
        node_name=node,
        boot_id="b1",
        seq=seq,
        sampled_at=ts_from_seconds(time.time()),
        gpu_capacity=1,
        gpus=[telemetry_pb2.GpuSample(index=0, uuid="GPU-1", utilization_pct=50.0)],
    )


async def _stream(channel: grpc.aio.Channel, *reports: telemetry_pb2.NodeReport) -> list[int]:
    stub = telemetry_pb2_grpc.TelemetryStub(channel)
    call = stub.Stream(iter(reports), timeout=T)
    return [ack.acked_seq async for ack in call]


async def _live_stream(
    channel: grpc.aio.Channel, node: str
) -> tuple[Any, asyncio.Queue[telemetry_pb2.NodeReport | None]]:
    """A telemetry stream of ``node`` whose first report is acked and that stays open: the
    call, and the queue that feeds it (None half-closes it)."""
    stub = telemetry_pb2_grpc.TelemetryStub(channel)
    first: asyncio.Queue[telemetry_pb2.NodeReport | None] = asyncio.Queue()

    async def feed() -> AsyncIterator[telemetry_pb2.NodeReport]:
        while (r := await first.get()) is not None:
            yield r

    live: Any = stub.Stream(feed(), timeout=T)
    await first.put(_report(node))
    assert (await live.read()).acked_seq == 1
    return live, first


async def test_an_agent_reports_for_its_own_node_only(stack: Stack) -> None:
    assert stack.ca is not None
    own = stack.ca.agent("node-a")
    async with stack.channel(stack.scaler_target, own) as ch:
        assert await _stream(ch, _report("node-a")) == [1]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _stream(ch, _report("node-b"))
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert "node-a" in (err.value.details() or "")
    assert "node-b" not in stack.core.ingest.nodes


async def test_no_certificate_wrong_ca_and_expired_are_refused_at_the_handshake(
    stack: Stack, tmp_path: Path
) -> None:
    assert stack.ca is not None
    other = CertificateAuthority.create(tmp_path / "other")
    forged = other.agent("node-a")
    expired = stack.ca.issue(
        "old",
        uris=("spiffe://tide/ns/local/sa/tide/user/old/role/admin",),
        not_before=datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=40),
        valid_days=1,
    )
    for issued in (None, forged, expired):
        async with stack.channel(stack.scaler_target, issued) as ch:
            stub = scaler_pb2_grpc.ScalerStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ListJobs(scaler_pb2.ListJobsRequest(), timeout=T)
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    assert stack.core.jobs == {}


async def test_roles_on_the_scaler_api_and_requested_by_is_the_caller(stack: Stack) -> None:
    assert stack.ca is not None
    admin = stack.ca.user("ada", "admin")
    operator = stack.ca.user("otto", "operator")
    viewer = stack.ca.user("vera", "viewer")
    agent = stack.ca.agent("node-a")
    async with stack.channel(stack.scaler_target, admin) as ch:
        await scaler_pb2_grpc.ScalerStub(ch).UpsertJob(
            scaler_pb2.UpsertJobRequest(job_id="ns/a"), timeout=T
        )
    async with stack.channel(stack.scaler_target, viewer) as ch:
        stub = scaler_pb2_grpc.ScalerStub(ch)
        assert len((await stub.ListJobs(scaler_pb2.ListJobsRequest(), timeout=T)).jobs) == 1
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RequestResize(
                scaler_pb2.RequestResizeRequest(job_id="ns/a", replicas=3, reason="t"), timeout=T
            )
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    async with stack.channel(stack.scaler_target, agent) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await scaler_pb2_grpc.ScalerStub(ch).ListJobs(scaler_pb2.ListJobsRequest(), timeout=T)
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    # The scaler's own identity reads (the CLI run in its pod) and writes nothing.
    async with stack.channel(stack.scaler_target, stack.ca.scaler()) as ch:
        stub = scaler_pb2_grpc.ScalerStub(ch)
        assert len((await stub.ListJobs(scaler_pb2.ListJobsRequest(), timeout=T)).jobs) == 1
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RequestResize(
                scaler_pb2.RequestResizeRequest(job_id="ns/a", replicas=3, reason="t"), timeout=T
            )
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    async with stack.channel(stack.scaler_target, operator) as ch:
        stub = scaler_pb2_grpc.ScalerStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.UpsertJob(scaler_pb2.UpsertJobRequest(job_id="ns/b"), timeout=T)
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
        d = await stub.RequestResize(
            scaler_pb2.RequestResizeRequest(
                job_id="ns/a", replicas=3, reason="test", requested_by="someone"
            ),
            timeout=T,
        )
    # The operator's self-asserted name is ignored: the decision names the certificate.
    assert d.requested_by == "spiffe://tide/ns/local/sa/tide/user/otto/role/operator"
    assert "ns/b" not in stack.core.jobs


async def test_a_launcher_acts_only_as_its_own_pod_of_its_own_job(stack: Stack) -> None:
    assert stack.ca is not None
    mine = stack.ca.launcher("ns/job", "job-worker-0")
    theirs = stack.ca.launcher("ns/job", "job-worker-1")
    other_job = stack.ca.launcher("ns/other", "other-worker-0")

    def register(pod: str, job: str = "ns/job") -> cpb.RegisterRequest:
        return cpb.RegisterRequest(
            job_id=job, pod_name=pod, host="127.0.0.1", launcher_id=f"l-{pod}", free_port=1234
        )

    async with stack.channel(stack.coordinator_target, mine) as ch:
        stub = cpb_grpc.CoordinatorStub(ch)
        member = (await stub.Register(register("job-worker-0"), timeout=T)).member_id
        await stub.Heartbeat(cpb.HeartbeatRequest(member_id=member), timeout=T)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Register(register("job-worker-1"), timeout=T)
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    for issued, request in (
        (theirs, register("job-worker-0")),
        (other_job, register("job-worker-0")),
    ):
        async with stack.channel(stack.coordinator_target, issued) as ch:
            stub = cpb_grpc.CoordinatorStub(ch)
            # Neither the pod's name nor its member id can be taken over by another caller.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Register(request, timeout=T)
            assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Heartbeat(cpb.HeartbeatRequest(member_id=member), timeout=T)
            assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Resize(
                    cpb.ResizeRequest(decision_id=1, job_id="ns/job", target_world_size=2),
                    timeout=T,
                ).read()
            assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    members = stack.coord.job("ns/job").members
    assert [m.pod_name for m in members.values()] == ["job-worker-0"]


async def test_the_scaler_reaches_the_coordinator_with_its_own_certificate(stack: Stack) -> None:
    assert stack.ca is not None
    async with stack.channel(stack.coordinator_target, stack.ca.scaler()) as ch:
        stub = cpb_grpc.CoordinatorStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetJobStatus(cpb.GetJobStatusRequest(job_id="ns/none"), timeout=T)
        assert err.value.code() is grpc.StatusCode.NOT_FOUND
    # ...and so does its own link, the real client (a refusal would not be NotFound).
    with pytest.raises(NotFound):
        await stack.core.coordinator.job_status("ns/none")


@pytest.mark.parametrize("tls", [True, False], ids=["mtls", "insecure"])
async def test_a_second_live_stream_for_a_node_is_a_conflict_never_a_merge(
    tmp_path: Path, tls: bool
) -> None:
    s = await start_stack(tmp_path, tls=tls)
    try:
        agent = s.ca.agent("node-a") if s.ca is not None else None
        async with s.channel(s.scaler_target, agent) as ch:
            live, first = await _live_stream(ch, "node-a")
            second = _report("node-a")
            second.boot_id = "b2"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _stream(ch, second)
            assert err.value.code() is grpc.StatusCode.ALREADY_EXISTS
            await first.put(None)
            assert await live.read() is grpc.aio.EOF
        assert s.core.ingest.nodes["node-a"].boot_id == "b1"
        assert s.core.ingest.rejected[Rejection.DUPLICATE_STREAM] == 1
    finally:
        await s.close()


async def test_a_conflicting_stream_reads_already_exists_while_it_still_writes(
    stack: Stack,
) -> None:
    # Refused before its 8 reports were read, such a stream read INTERNAL "Internal error
    # from Core" 984 times in 1,000 (grpc/grpc#36066); the servicer now reads to the
    # half-close first (refused_streams.drain), so the code is ALREADY_EXISTS every time.
    assert stack.ca is not None
    async with stack.channel(stack.scaler_target, stack.ca.agent("node-a")) as ch:
        live, first = await _live_stream(ch, "node-a")
        second = _report("node-a")
        second.boot_id = "b2"
        codes = []
        for _ in range(25):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _stream(ch, *[second] * 8)
            codes.append(err.value.code())
        assert set(codes) == {grpc.StatusCode.ALREADY_EXISTS}, codes
        await first.put(None)
        assert await live.read() is grpc.aio.EOF
    assert stack.core.ingest.nodes["node-a"].boot_id == "b1"


async def test_a_report_from_ten_years_ago_is_dropped(stack: Stack) -> None:
    assert stack.ca is not None
    old = _report("node-a")
    old.sampled_at.FromSeconds(int(old.sampled_at.seconds - 10 * 365 * 86400))
    async with stack.channel(stack.scaler_target, stack.ca.agent("node-a")) as ch:
        assert await _stream(ch, old) == [1]
    assert stack.core.ingest.rejected[Rejection.TIMESTAMP_TOO_OLD] == 1
    assert stack.core.ingest.reports_accepted == 0


async def test_out_of_range_timestamps_are_invalid_argument_naming_the_field(
    stack: Stack,
) -> None:
    assert stack.ca is not None
    async with stack.channel(stack.scaler_target, stack.ca.user("vera", "viewer")) as ch:
        req = scaler_pb2.ListDecisionsRequest()
        req.since.seconds = 2**62
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await scaler_pb2_grpc.ScalerStub(ch).ListDecisions(req, timeout=T)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert (err.value.details() or "").startswith("since.seconds:")
    launcher = stack.ca.launcher("ns/job", "job-worker-0")
    async with stack.channel(stack.coordinator_target, launcher) as ch:
        stub = cpb_grpc.CoordinatorStub(ch)
        member = (
            await stub.Register(
                cpb.RegisterRequest(
                    job_id="ns/job", pod_name="job-worker-0", host="h", launcher_id="l", free_port=1
                ),
                timeout=T,
            )
        ).member_id
        ack = cpb.AckRequest(member_id=member, directive_id="d")
        ack.held_at.seconds = -(2**62)
        beat = cpb.HeartbeatRequest(member_id=member)
        beat.first_step_at.nanos = -5
        for call, req, field in (
            (stub.Ack, ack, "held_at.seconds"),
            (stub.Heartbeat, beat, "first_step_at.nanos"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(req, timeout=T)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert (err.value.details() or "").startswith(field + ":")


async def test_a_certificate_of_the_ca_without_a_tide_identity_is_permission_denied(
    stack: Stack,
) -> None:
    # No URI SAN at all, as a certificate issued by the right CA for something else;
    # docs/security.md: PERMISSION_DENIED (authenticated, but nobody Tide knows).
    nobody = stack.ca.issue("printer")
    async with stack.channel(stack.scaler_target, nobody) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await scaler_pb2_grpc.ScalerStub(ch).ListJobs(scaler_pb2.ListJobsRequest(), timeout=T)
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED, err.value
        assert "no Tide identity" in (err.value.details() or "")
