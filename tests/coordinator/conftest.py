"""An in-process coordinator on a real socket (port 0), with a fake clock."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from urllib.parse import quote

import grpc
import pytest
import sqlalchemy as sa
from tide.v1 import coordinator_pb2 as pb
from tide.v1 import coordinator_pb2_grpc as pb_grpc

from services.common.config import CommonSettings
from services.common.server import RunningServer, ServiceSpec, start_server
from services.coordinator.engine import Coordinator
from services.coordinator.servicer import SERVICE_NAME, CoordinatorServicer
from services.coordinator.settings import Tuning
from services.coordinator.store import CoordinatorStore, MemoryStore
from services.testing.clock import FakeClock
from tests.coordinator.fakes import TIMEOUT_S, FakeLauncher

JOB = "ns/job"
TUNING = Tuning(
    heartbeat_timeout_s=30.0,
    # Apart from the heartbeat timeout, so a test can tell which one a deadline came from.
    phase_timeout_s=40.0,
    heartbeat_interval_s=5.0,
    checkpoint_min_lead_steps=2,
    checkpoint_lead_s=3.0,
    tick_interval_s=0.5,
)


@dataclass
class Env:
    clock: FakeClock
    store: CoordinatorStore
    coordinator: Coordinator
    server: RunningServer
    channel: grpc.aio.Channel
    stub: pb_grpc.CoordinatorStub
    launchers: list[FakeLauncher] = field(default_factory=list)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    async def launcher(self, pod_index: int, **kw: object) -> FakeLauncher:
        fl = FakeLauncher(self.target, self.clock, JOB, pod_index, **kw)  # type: ignore[arg-type]
        self.launchers.append(fl)
        await fl.join()
        return fl

    async def restart(self) -> None:
        """A new Coordinator over the same store and a new server, as after a crash."""
        await self.server.stop(0)
        self.coordinator = Coordinator(self.store, self.clock, TUNING)
        self.coordinator.load()
        self.server = await _serve(self.coordinator)
        for fl in self.launchers:
            await fl.channel.close()
            fl.target = self.target
            fl.channel = grpc.aio.insecure_channel(self.target)
            fl.stub = pb_grpc.CoordinatorStub(fl.channel)
        await self.channel.close()
        self.channel = grpc.aio.insecure_channel(self.target)
        self.stub = pb_grpc.CoordinatorStub(self.channel)

    async def status(self) -> pb.JobStatus:
        st: pb.JobStatus = await self.stub.GetJobStatus(
            pb.GetJobStatusRequest(job_id=JOB), timeout=TIMEOUT_S
        )
        return st

    async def heartbeat_all(self, steps: int = 1, advance_s: float = 1.0) -> None:
        self.clock.advance(advance_s)
        for fl in self.launchers:
            if not fl.exited and fl.member_id:
                await fl.heartbeat(steps)


async def _serve(coordinator: Coordinator) -> RunningServer:
    return await start_server(
        CommonSettings(listen="127.0.0.1:0"),
        [
            ServiceSpec(
                pb_grpc.add_CoordinatorServicer_to_server,
                CoordinatorServicer(coordinator),
                SERVICE_NAME,
            )
        ],
    )


async def make_env(store: CoordinatorStore) -> Env:
    clock = FakeClock()
    coordinator = Coordinator(store, clock, TUNING)
    coordinator.load()
    server = await _serve(coordinator)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    return Env(clock, store, coordinator, server, channel, pb_grpc.CoordinatorStub(channel))


async def close_env(env: Env) -> None:
    for fl in env.launchers:
        await fl.close()
    await env.channel.close()
    await env.server.stop(0)


@pytest.fixture
def pg_schema_url(pg_url: str) -> Iterator[str]:
    """A schema of its own in the shared test database, dropped afterwards."""
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except sa.exc.OperationalError as exc:
        admin.dispose()
        if os.environ.get("TIDE_TEST_PG_URL"):
            # `make test` promised a database: its absence is a failure, not a skip.
            raise
        pytest.skip(f"PostgreSQL not reachable at {pg_url}: {exc.orig}")
    schema = f"coord_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    sep = "&" if "?" in pg_url else "?"
    try:
        yield f"{pg_url}{sep}options={quote(f'-csearch_path={schema}')}"
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    e = await make_env(MemoryStore())
    yield e
    await close_env(e)


__all__ = ["JOB", "TUNING", "Env", "FakeLauncher", "close_env", "make_env"]
