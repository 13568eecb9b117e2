"""The Telemetry stream over real sockets: many agents, bad streams, replays."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from tests.scaler.support import TelemetryServer, report
from tide.base.grpc_options import client_options, server_options
from tide.services.common.clock import SystemClock
from tide.services.scaler.ingest import Ingest, IngestSettings, Rejection
from tide.services.scaler.members import Member
from tide.services.scaler.servicer import TelemetryServicer
from tide.services.testing.members import InMemoryMemberRegistry
from tide.v1 import telemetry_pb2, telemetry_pb2_grpc

pytestmark = pytest.mark.component


async def stream_reports(
    target: str, reports: list[telemetry_pb2.NodeReport], *, want_ack: int, timeout_s: float = 20
) -> list[telemetry_pb2.TelemetryAck]:
    """Send ``reports`` on one stream and read acks until ``want_ack`` is acknowledged."""
    async with grpc.aio.insecure_channel(target, options=client_options()) as ch:
        stub = telemetry_pb2_grpc.TelemetryStub(ch)
        call = stub.Stream(timeout=timeout_s)
        for r in reports:
            await call.write(r)
        acks = []
        async for ack in call:
            acks.append(ack)
            if ack.acked_seq >= want_ack:
                break
        await call.done_writing()
        call.cancel()
        return acks


async def test_fifty_concurrent_agents(
    telemetry_server: TelemetryServer, registry: InMemoryMemberRegistry
) -> None:
    registry.set_members("ns/big", [Member(f"p{i}", f"p{i}") for i in range(50)])
    now = time.time()

    async def agent(i: int) -> int:
        reports = [
            report(f"node-{i}", seq, t=now - 1 + seq * 0.04, pods=[f"p{i}"] * 8)
            for seq in range(1, 21)
        ]
        acks = await stream_reports(telemetry_server.target, reports, want_ack=20)
        return acks[-1].acked_seq

    results = await asyncio.gather(*(agent(i) for i in range(50)))
    assert results == [20] * 50
    e = telemetry_server.engine
    assert e.reports_accepted == 1000
    assert e.samples_accepted == 8000
    # Judged at the samples' own time, so a slow machine cannot make them stale.
    assert e.fresh_gpus(now) == {"ns/big": 400}
    assert sum(e.rejected.values()) == 0


async def test_malformed_stream_ends_with_invalid_argument(
    telemetry_server: TelemetryServer, registry: InMemoryMemberRegistry
) -> None:
    registry.set_members("ns/a", [Member("a0", "a0")])
    good = [report("good", s, utils=[50.0] * 8, pods=["a0"] * 8) for s in (1, 2)]
    bad = report("evil", 1, utils=[99.0] * 9, capacity=8, pods=["a0"] * 9)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stream_reports(telemetry_server.target, [bad], want_ack=1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "too_many_gpus" in (err.value.details() or "")
    # The server lives on and a healthy agent is unaffected; nothing of the bad one landed.
    acks = await stream_reports(telemetry_server.target, good, want_ack=2)
    assert acks[-1].acked_seq == 2
    e = telemetry_server.engine
    assert e.rejected[Rejection.TOO_MANY_GPUS] == 1
    assert e.samples_accepted == 16
    assert "evil" not in {row[0] for row in e.node_view()}


async def test_garbage_bytes_do_not_hurt_the_server(telemetry_server: TelemetryServer) -> None:
    async with grpc.aio.insecure_channel(telemetry_server.target) as ch:
        raw = ch.stream_stream(
            "/tide.v1.Telemetry/Stream",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        call = raw(timeout=5)
        await call.write(b"\xff\xff\xff\xff\x0f garbage")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call:
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert telemetry_server.engine.rejected[Rejection.MALFORMED] == 1
    acks = await stream_reports(telemetry_server.target, [report("ok", 1)], want_ack=1)
    assert acks[-1].acked_seq == 1


async def test_replayed_stream_is_acked_and_ignored(
    telemetry_server: TelemetryServer, registry: InMemoryMemberRegistry
) -> None:
    registry.set_members("ns/a", [Member("a0", "a0")])
    now = time.time()
    reports = [report("n1", s, t=now - 5 + s * 0.1, pods=["a0"] * 8) for s in range(1, 16)]
    acks = await stream_reports(telemetry_server.target, reports[:10], want_ack=10)
    assert acks[-1].acked_seq == 10
    # The agent reconnects and resends everything it holds, then continues.
    acks = await stream_reports(telemetry_server.target, reports, want_ack=15)
    assert acks[-1].acked_seq == 15
    e = telemetry_server.engine
    assert (e.reports_accepted, e.reports_duplicate) == (15, 10)
    assert e.samples_accepted == 15 * 8
    total = sum(w._counts[i] for w in e.windows.values() for i in range(w.n))
    assert total == 15 * 8


async def test_slow_agent_does_not_hold_up_others(telemetry_server: TelemetryServer) -> None:
    async with grpc.aio.insecure_channel(telemetry_server.target) as ch:
        stub = telemetry_pb2_grpc.TelemetryStub(ch)
        stuck = stub.Stream(timeout=30)
        await stuck.write(report("slow", 1))
        # It never reads its acks nor sends again; a fast agent still gets through.
        t0 = time.monotonic()
        acks = await stream_reports(
            telemetry_server.target, [report("fast", s) for s in range(1, 51)], want_ack=50
        )
        assert acks[-1].acked_seq == 50
        assert time.monotonic() - t0 < 5
        stuck.cancel()


async def test_held_back_acks_of_later_bursts_go_out(telemetry_server: TelemetryServer) -> None:
    """Bursts on one stream, each after the shared flusher emptied its set: each burst's
    last report is acknowledged (the flusher once swapped its set for a new one while
    streams kept adding to the old, and the second burst's ack never came)."""
    async with grpc.aio.insecure_channel(telemetry_server.target, options=client_options()) as ch:
        call = telemetry_pb2_grpc.TelemetryStub(ch).Stream(timeout=10)
        t = time.time()
        seq = 0
        for _ in range(3):
            for _ in range(5):
                seq += 1
                await call.write(report("burst", seq, t=t + seq * 0.01))
            while (await call.read()).acked_seq < seq:
                pass
        await call.done_writing()
        call.cancel()
    assert telemetry_server.engine.reports_accepted == 15


async def test_a_report_refused_for_its_timestamp_is_acked_with_the_cause(
    telemetry_server: TelemetryServer,
) -> None:
    ten_years_s = 10 * 365.25 * 86400
    now = time.time()
    dated = [now, now + ten_years_s, now + ten_years_s, now + ten_years_s, now - ten_years_s]
    dated += [now + 0.5, now + 0.2]  # the last goes back in time: out of order
    Refusal = telemetry_pb2.ReportRefusal
    async with grpc.aio.insecure_channel(telemetry_server.target, options=client_options()) as ch:
        call = telemetry_pb2_grpc.TelemetryStub(ch).Stream(timeout=10)
        for seq, t in enumerate(dated, start=1):
            await call.write(report("skewed", seq, t=t))
        seen: dict[int, tuple[int, float, float, int]] = {}
        ack = await call.read()
        while True:
            for r in ack.refused:
                before = seen.get(r.reason, (0, 0.0, 0.0, 0))[0]
                seen[r.reason] = (before + r.reports, r.skew_s, r.limit_s, r.last_seq)
            if ack.acked_seq >= len(dated):
                break
            ack = await call.read()
        # Every report is acknowledged (resending cannot help); the acks name each cause.
        assert set(seen) == {
            Refusal.REASON_TIMESTAMP_IN_FUTURE,
            Refusal.REASON_TIMESTAMP_TOO_OLD,
            Refusal.REASON_TIMESTAMP_OUT_OF_ORDER,
        }
        reports, skew_s, limit_s, last_seq = seen[Refusal.REASON_TIMESTAMP_IN_FUTURE]
        assert (reports, limit_s, last_seq) == (3, 5.0, 4)
        assert skew_s == pytest.approx(ten_years_s, abs=60)
        reports, skew_s, limit_s, last_seq = seen[Refusal.REASON_TIMESTAMP_TOO_OLD]
        assert (reports, limit_s, last_seq) == (1, 900.0, 5)
        assert skew_s == pytest.approx(-ten_years_s, abs=60)
        assert seen[Refusal.REASON_TIMESTAMP_OUT_OF_ORDER][0::3] == (1, 7)

        # A good report's ack carries no refusal already told.
        await call.write(report("skewed", 8, t=now + 1.0))
        while (ack := await call.read()).acked_seq < 8:
            pass
        assert list(ack.refused) == []
        # A refused report behind a gap (9 is missing) is told though the ack stays at 8.
        await call.write(report("skewed", 10, t=time.time() + ten_years_s))
        ack = await call.read()
        assert ack.acked_seq == 8
        assert [(r.reason, r.reports, r.last_seq) for r in ack.refused] == [
            (Refusal.REASON_TIMESTAMP_IN_FUTURE, 1, 10)
        ]
        await call.done_writing()
        call.cancel()
    e = telemetry_server.engine
    assert (e.reports_accepted, e.reports_dropped) == (3, 6)


async def test_a_busy_stream_is_acked_once_per_batch_not_per_report(
    registry: InMemoryMemberRegistry,
) -> None:
    """A write started by the shared flusher runs beside the handler; when it is done,
    reports taken meanwhile wait for their batch or the delay. (It once wrote again
    whenever the ack had moved: a busy stream got an ack every report or two.)"""
    every, delay_s, n = 32, 0.05, 3000
    engine = Ingest(IngestSettings(stale_after_s=5.0), registry, SystemClock())
    server = grpc.aio.server(options=server_options())
    servicer = TelemetryServicer(engine, ack_every_reports=every, ack_max_delay_s=delay_s)
    telemetry_pb2_grpc.add_TelemetryServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    t = time.time()
    reports = [report("busy", s, t=t + s * 1e-4, utils=[50.0]) for s in range(1, n + 1)]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=client_options()) as ch:
            call = telemetry_pb2_grpc.TelemetryStub(ch).Stream(timeout=60)

            async def send() -> None:
                for r in reports:
                    await call.write(r)

            sender = asyncio.create_task(send())
            started = time.monotonic()
            acks = 0
            while (await call.read()).acked_seq < n:
                acks += 1
            elapsed_s = time.monotonic() - started
            await sender
            await call.done_writing()
            call.cancel()
    finally:
        await server.stop(0)
    assert engine.reports_accepted == n
    # One ack per batch of `every`, plus at most one per delay from the handler and one
    # from the flusher: a few dozen, where an ack per report or two is well over 1,000.
    assert acks <= n / every + 2 * elapsed_s / delay_s + 2, (acks, elapsed_s)
