"""Scaler fixtures: a telemetry server on a real socket, databases (helpers: support.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import sqlalchemy as sa

from tests.scaler import service_rig
from tests.scaler.support import TelemetryServer
from tests.support.pg import schema_url
from tide.base.grpc_options import server_options
from tide.services.common.clock import SystemClock
from tide.services.scaler.ingest import Ingest, IngestSettings
from tide.services.scaler.servicer import TelemetryServicer
from tide.services.testing.members import InMemoryMemberRegistry
from tide.v1 import telemetry_pb2_grpc


@pytest.fixture
def registry() -> InMemoryMemberRegistry:
    return InMemoryMemberRegistry()


@pytest.fixture
async def telemetry_server(registry: InMemoryMemberRegistry) -> AsyncIterator[TelemetryServer]:
    engine = Ingest(IngestSettings(stale_after_s=5.0), registry, SystemClock())
    server = grpc.aio.server(options=server_options())
    telemetry_pb2_grpc.add_TelemetryServicer_to_server(TelemetryServicer(engine), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield TelemetryServer(engine, server, port)
    finally:
        await server.stop(0)


# --- databases --------------------------------------------------------------------------------


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgresql", id="pg", marks=pytest.mark.postgres),
    ]
)
def scaler_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A migrated, empty database on each engine (PostgreSQL: a schema of its own)."""
    from tide.services.store import db

    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'scaler.db'}"
        db.upgrade(url)
        yield url
        return
    pg_url: str = request.getfixturevalue("pg_url")
    admin: sa.Engine = request.getfixturevalue("pg_admin")
    with schema_url(admin, pg_url, "scaler") as url:
        db.upgrade(url)
        yield url


# --- the scaler's end-to-end rig (service_rig.py) --------------------------------------------

rig = service_rig.rig_fixture
