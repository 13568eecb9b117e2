"""An agent whose clock is wrong, against the scaler's real Telemetry servicer: the
scaler acks and drops its reports, and the agent learns why from the acks."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from prometheus_client import CollectorRegistry

from tests.support.poll import eventually
from tide.base.grpc_options import server_options
from tide.services.common.clock import SystemClock
from tide.services.scaler.ingest import Ingest, IngestSettings, Rejection
from tide.services.scaler.servicer import TelemetryServicer
from tide.services.testing.members import InMemoryMemberRegistry
from tide.v1 import telemetry_pb2_grpc

from .support import RunAgent, agent_settings

pytestmark = pytest.mark.component

TEN_YEARS_S = 10 * 365.25 * 86400


class SkewedClock(SystemClock):
    """The system's clock, its wall time off by ``offset_s`` (durations unaffected)."""

    def __init__(self, offset_s: float) -> None:
        self.offset_s = offset_s

    def now(self) -> float:
        return time.time() + self.offset_s


@pytest.fixture
async def ingest_server() -> AsyncIterator[tuple[Ingest, int]]:
    ingest = Ingest(IngestSettings(), InMemoryMemberRegistry(), SystemClock())
    server = grpc.aio.server(options=server_options())
    telemetry_pb2_grpc.add_TelemetryServicer_to_server(TelemetryServicer(ingest), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield ingest, port
    finally:
        await server.stop(0)


def _refused(registry: CollectorRegistry, reason: str) -> float:
    value = registry.get_sample_value("tide_agent_reports_refused_total", {"reason": reason})
    return value or 0.0


@pytest.mark.parametrize(
    ("offset_s", "reason", "words"),
    [
        (TEN_YEARS_S, Rejection.TIMESTAMP_IN_FUTURE, "10.0 years ahead"),
        (-TEN_YEARS_S, Rejection.TIMESTAMP_TOO_OLD, "10.0 years behind"),
    ],
)
async def test_an_agent_off_by_years_logs_once_and_counts_every_refused_report(
    ingest_server: tuple[Ingest, int],
    run_agent: RunAgent,
    caplog: pytest.LogCaptureFixture,
    offset_s: float,
    reason: Rejection,
    words: str,
) -> None:
    ingest, port = ingest_server
    caplog.set_level(logging.WARNING, logger="tide.services.agent")
    r = await run_agent(agent_settings(port), clock=SkewedClock(offset_s))
    registry = r.agent.metrics.registry
    # Ten and more refused reports, each acked: the buffer drains as if all were well.
    await eventually(lambda: _refused(registry, reason.value) >= 10, what="refusals counted")
    assert ingest.rejected[reason] >= _refused(registry, reason.value)
    assert ingest.reports_accepted == 0
    assert ingest.node_view() == []
    warnings = [
        rec.getMessage()
        for rec in caplog.records
        if rec.levelno == logging.WARNING and rec.name.startswith("tide.services.agent")
    ]
    refusals = [m for m in warnings if "dropped" in m]
    assert len(refusals) == 1, warnings
    assert reason.value in refusals[0]
    assert words in refusals[0]
    assert _refused(registry, "timestamp_missing") == 0
    await r.shutdown()
