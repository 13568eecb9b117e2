"""Fixtures of the agent tests: a Telemetry server on port 0 and a running agent."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from services.agent.agent import Agent
from services.agent.settings import AgentSettings
from services.agent.sources import Profile, Source, SyntheticSource
from services.common.clock import SystemClock

from .telemetry_server import TelemetryRecorder, start_server


async def eventually(condition: Callable[[], Any], timeout_s: float = 10.0, what: str = "") -> Any:
    """Poll ``condition`` on the loop until it is truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or condition}")
        await asyncio.sleep(0.01)


@dataclass
class Scaler:
    recorder: TelemetryRecorder
    server: grpc.aio.Server
    port: int

    async def restart(self, keepalive_time_s: float = 20.0) -> None:
        """A new server process-equivalent on the same port, with no memory."""
        self.recorder = TelemetryRecorder()
        self.server, port = await start_server(self.recorder, self.port, keepalive_time_s)
        assert port == self.port


@pytest.fixture
async def scaler() -> AsyncIterator[Scaler]:
    recorder = TelemetryRecorder()
    server, port = await start_server(recorder, 0, client_keepalive_time_s=1.0)
    s = Scaler(recorder, server, port)
    yield s
    await s.server.stop(None)


def agent_settings(port: int, **overrides: Any) -> AgentSettings:
    values: dict[str, Any] = {
        "scaler": f"127.0.0.1:{port}",
        "node_name": "gpu-node-1",
        "source": "synthetic",
        "synthetic_gpus": 2,
        "interval_s": 0.05,
        "buffer_reports": 1000,
        "max_in_flight_reports": 64,
        "backoff_initial_s": 0.05,
        "backoff_max_s": 0.2,
        "watch_node": False,
        "pod_resources_socket": "",
        "shutdown_flush_s": 2.0,
    }
    values.update(overrides)
    return AgentSettings(**values)


@dataclass
class Running:
    agent: Agent
    stop: asyncio.Event
    task: asyncio.Task[None]

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, timeout_s)


RunAgent = Callable[..., Awaitable[Running]]


@pytest.fixture
async def run_agent() -> AsyncIterator[RunAgent]:
    running: list[Running] = []

    async def start(settings: AgentSettings, source: Source | None = None, **kw: Any) -> Running:
        src = source or SyntheticSource(
            Profile.parse(settings.synthetic_profile), settings.synthetic_gpus, SystemClock()
        )
        agent = Agent(settings, src, **kw)
        stop = asyncio.Event()
        r = Running(agent, stop, asyncio.create_task(agent.run(stop)))
        running.append(r)
        return r

    yield start
    for r in running:
        if not r.task.done():
            r.stop.set()
            try:
                await asyncio.wait_for(r.task, 10)
            except Exception:
                r.task.cancel()
