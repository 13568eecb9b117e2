"""bench/fleet.py, bench.scale's load generator, against the real Telemetry servicer:
it must speak the protocol the scaler serves (every report it writes is accepted and
acknowledged, in sequence), and a stream whose replica goes away must continue on
the next one, from the report after its highest ack."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest

from bench.fleet import Fleet
from bench.ingest import _base
from tests.support.poll import eventually
from tide.base.grpc_options import server_options
from tide.services.common.clock import SystemClock
from tide.services.scaler.ingest import Ingest, IngestSettings
from tide.services.scaler.members import Member
from tide.services.scaler.servicer import TelemetryServicer
from tide.services.testing.members import InMemoryMemberRegistry
from tide.v1 import telemetry_pb2, telemetry_pb2_grpc

pytestmark = [pytest.mark.component]

NODES = 24


@asynccontextmanager
async def _replica() -> AsyncIterator[tuple[Ingest, grpc.aio.Server, int]]:
    registry = InMemoryMemberRegistry()
    for j in range(NODES // 4):
        registry.set_members(
            f"bench/j{j}", [Member(f"j{j}-trainer-{p}", f"uid-j{j}-{p}") for p in range(8)]
        )
    engine = Ingest(IngestSettings(), registry, SystemClock())
    server = grpc.aio.server(options=server_options())
    telemetry_pb2_grpc.add_TelemetryServicer_to_server(TelemetryServicer(engine), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield engine, server, port
    finally:
        await server.stop(0)


def _fleet(ports: list[int]) -> Fleet:
    templates = []
    for i in range(NODES):
        report = _base(f"node-{i}", i // 4, i % 4, 50.0)
        templates.append((report, report))
    return Fleet(
        ports,
        templates,
        conns=2,
        warm_at=0.0,
        period_s=10.0,
        acked_seq=lambda b: telemetry_pb2.TelemetryAck.FromString(b).acked_seq,
        ramp_per_s=NODES,
    )


async def _settled(fleet: Fleet) -> None:
    # The last second's acks are in flight when run() returns.
    await eventually(
        lambda: all(st.acked == st.seq for st in fleet.streams), 5.0, what="the last acks"
    )


async def test_every_report_is_accepted_and_acked_in_sequence() -> None:
    async with _replica() as (engine, _, port):
        fleet = _fleet([port])
        await fleet.connect()
        await fleet.run(2.5)
        await _settled(fleet)
        written = sum(st.seq for st in fleet.streams)
        assert fleet.errors == 0 and fleet.refused == 0
        assert all(st.seq >= 2 and st.acked == st.seq for st in fleet.streams)
        assert engine.reports_accepted == written
        assert engine.reports_duplicate == 0 and engine.seq_gaps == 0
        assert sum(engine.rejected.values()) == 0
        assert len(fleet.lat) == written  # one latency per acked report
        await fleet.close()


async def test_streams_of_a_stopped_replica_continue_on_the_next() -> None:
    async with _replica() as (first, first_server, p1), _replica() as (second, _, p2):
        fleet = _fleet([p1, p2])
        await fleet.connect()
        on_first = sum(1 for st in fleet.streams if st.attempt % 2 == 0)

        async def stop_first() -> None:
            await asyncio.sleep(1.5)
            await first_server.stop(0)

        stopper = asyncio.create_task(stop_first())
        await fleet.run(3.5)
        await stopper
        await _settled(fleet)
        assert fleet.errors >= on_first
        # Every stream ends on the second replica, every report acked there or before.
        assert all(st.conn is not None and st.acked == st.seq for st in fleet.streams)
        assert second.nodes.keys() == {f"node-{i}" for i in range(NODES)}
        assert first.reports_accepted > 0
        # The second replica took each moved stream up from the report after its ack.
        assert second.seq_gaps == 0 and second.reports_duplicate == 0
        assert all(
            second.nodes[f"node-{i}"].acked == st.acked for i, st in enumerate(fleet.streams)
        )
        await fleet.close()
