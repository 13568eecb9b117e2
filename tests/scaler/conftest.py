"""Scaler fixtures: a telemetry server on a real socket, databases (helpers: support.py)."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import quote

import grpc
import pytest
import sqlalchemy as sa
from tide.v1 import telemetry_pb2_grpc

from services.common.clock import SystemClock
from services.scaler.ingest import IngestEngine, IngestSettings
from services.scaler.servicer import TelemetryServicer
from services.testing.members import InMemoryMemberRegistry
from tests.scaler.support import TelemetryServer
from tidebase.grpc_options import server_options


@pytest.fixture
def registry() -> InMemoryMemberRegistry:
    return InMemoryMemberRegistry()


@pytest.fixture
async def telemetry_server(registry: InMemoryMemberRegistry) -> AsyncIterator[TelemetryServer]:
    engine = IngestEngine(IngestSettings(stale_after_s=5.0), registry, SystemClock())
    server = grpc.aio.server(options=server_options())
    telemetry_pb2_grpc.add_TelemetryServicer_to_server(TelemetryServicer(engine), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield TelemetryServer(engine, server, port)
    finally:
        await server.stop(0)


# --- databases --------------------------------------------------------------------------------


def _pg_reachable(url: str) -> sa.Engine | None:
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except sa.exc.OperationalError:
        engine.dispose()
        if os.environ.get("TIDE_TEST_PG_URL"):
            raise
        return None
    return engine


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgresql", id="pg", marks=pytest.mark.postgres),
    ]
)
def scaler_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A migrated, empty database on each engine (PostgreSQL: a schema of its own)."""
    from services.store import db

    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'scaler.db'}"
        db.upgrade(url)
        yield url
        return
    pg_url: str = request.getfixturevalue("pg_url")
    admin = _pg_reachable(pg_url)
    if admin is None:
        pytest.skip(f"PostgreSQL not reachable at {pg_url}")
    schema = f"scaler_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    sep = "&" if "?" in pg_url else "?"
    url = f"{pg_url}{sep}options={quote(f'-csearch_path={schema}')}"
    try:
        db.upgrade(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()
