"""The ServiceAccount-token path: bound tokens checked through TokenReview (a fake API
with real semantics, tide.services.testing.tokenreview), cached for their lifetime."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from tide.base.client import open_channel
from tide.base.credentials import ClientCredentials
from tide.base.timeconv import ts_from_seconds
from tide.services.common.tokenreview import CachedReviewer, token_expiry_s
from tide.services.testing.stack import Stack, start_stack
from tide.services.testing.tokenreview import FakeTokenApi
from tide.v1 import coordinator_pb2 as cpb
from tide.v1 import coordinator_pb2_grpc as cpb_grpc
from tide.v1 import scaler_pb2, scaler_pb2_grpc, telemetry_pb2, telemetry_pb2_grpc

pytestmark = pytest.mark.component

T = 10.0
KINDS = (
    "tide/tide-agent=agent",
    "ml/tide-launcher=launcher",
    "tide/tide-scaler=scaler",
    "ml/ci=operator",
)


@pytest.fixture
def api() -> FakeTokenApi:
    return FakeTokenApi()


@pytest.fixture
async def stack(tmp_path: Path, api: FakeTokenApi) -> AsyncIterator[Stack]:
    s = await start_stack(
        tmp_path,
        require_client_cert=False,
        reviewer=CachedReviewer(api),
        token_identities=KINDS,
    )
    try:
        yield s
    finally:
        await s.close()


def _channel(stack: Stack, target: str, token_file: Path) -> grpc.aio.Channel:
    assert stack.ca is not None
    creds = ClientCredentials(tls_ca_file=stack.ca.ca_file, token_file=str(token_file))
    return open_channel(target, credentials=creds, own_subchannels=True)


def _report(node: str) -> telemetry_pb2.NodeReport:
    r = telemetry_pb2.NodeReport(node_name=node, boot_id="b", seq=1, gpu_capacity=1)
    r.sampled_at.CopyFrom(ts_from_seconds(time.time()))
    return r


async def _stream(ch: grpc.aio.Channel, report: telemetry_pb2.NodeReport) -> list[int]:
    call = telemetry_pb2_grpc.TelemetryStub(ch).Stream(iter([report]), timeout=T)
    return [a.acked_seq async for a in call]


async def test_an_agent_token_speaks_for_the_node_it_is_bound_to(
    stack: Stack, api: FakeTokenApi, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text(api.issue("tide", "tide-agent", pod="agent-x", node="node-a"))
    async with _channel(stack, stack.scaler_target, token) as ch:
        assert await _stream(ch, _report("node-a")) == [1]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _stream(ch, _report("node-b"))
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
        # One review for both calls: the answer is cached for the token's lifetime.
        assert api.calls == 1


async def test_a_launcher_token_registers_its_own_pod_only(
    stack: Stack, api: FakeTokenApi, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text(api.issue("ml", "tide-launcher", pod="bert-worker-0", node="n1"))

    def register(pod: str) -> cpb.RegisterRequest:
        return cpb.RegisterRequest(
            job_id="ml/bert", pod_name=pod, host="h", launcher_id="l", free_port=1
        )

    async with _channel(stack, stack.coordinator_target, token) as ch:
        stub = cpb_grpc.CoordinatorStub(ch)
        assert (await stub.Register(register("bert-worker-0"), timeout=T)).member_id
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Register(register("bert-worker-1"), timeout=T)
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED


async def test_expired_unknown_wrong_audience_and_unmapped_tokens_are_refused(
    stack: Stack, api: FakeTokenApi, tmp_path: Path
) -> None:
    tokens = {
        "expired": api.issue("ml", "ci", ttl_s=-1),
        "unknown": "not.a.token",
        "audience": api.issue("ml", "ci", audience="vault"),
        "unmapped": api.issue("ml", "someone-else"),
    }
    codes = {}
    for name, value in tokens.items():
        f = tmp_path / name
        f.write_text(value)
        async with _channel(stack, stack.scaler_target, f) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await scaler_pb2_grpc.ScalerStub(ch).ListJobs(
                    scaler_pb2.ListJobsRequest(), timeout=T
                )
            codes[name] = err.value.code()
    assert codes == {
        "expired": grpc.StatusCode.UNAUTHENTICATED,
        "unknown": grpc.StatusCode.UNAUTHENTICATED,
        "audience": grpc.StatusCode.UNAUTHENTICATED,
        "unmapped": grpc.StatusCode.PERMISSION_DENIED,
    }
    # And without any token, on a server that does not ask for certificates:
    assert stack.ca is not None
    async with open_channel(
        stack.scaler_target, credentials=ClientCredentials(tls_ca_file=stack.ca.ca_file)
    ) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await scaler_pb2_grpc.ScalerStub(ch).ListJobs(scaler_pb2.ListJobsRequest(), timeout=T)
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED


async def test_a_rotated_token_file_is_picked_up_without_a_restart(
    stack: Stack, api: FakeTokenApi, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("stale")
    async with _channel(stack, stack.scaler_target, token) as ch:
        stub = scaler_pb2_grpc.ScalerStub(ch)
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.ListJobs(scaler_pb2.ListJobsRequest(), timeout=T)
        # A Secret's or a projected token's update: a new file swapped in.
        fresh = tmp_path / "token.new"
        fresh.write_text(api.issue("ml", "ci"))
        fresh.replace(token)
        await stub.ListJobs(scaler_pb2.ListJobsRequest(), timeout=T)


async def test_the_cache_ends_with_the_token() -> None:
    now = [1000.0]
    api = FakeTokenApi(clock=lambda: now[0])
    reviewer = CachedReviewer(api, clock=lambda: now[0])
    token = api.issue("ml", "ci", ttl_s=60)
    assert token_expiry_s(token) == pytest.approx(1060, abs=1)
    assert (await reviewer.review(token)).authenticated
    now[0] += 30
    assert (await reviewer.review(token)).authenticated
    assert api.calls == 1
    now[0] += 31
    assert not (await reviewer.review(token)).authenticated
    assert api.calls == 2
