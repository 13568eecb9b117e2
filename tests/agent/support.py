"""Shared support of the agent tests: a Telemetry server to stream to, agent settings
for tests, and a running agent. The fixtures in conftest.py build on these; tests
import what they name from here, never from the conftest."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from tide.services.agent.agent import Agent
from tide.services.agent.fanout import ScalerFanout
from tide.services.agent.settings import AgentSettings
from tide.services.agent.sink import SingleStream
from tide.services.agent.sources import Profile, Source, SyntheticSource
from tide.services.common.clock import SystemClock

from .telemetry_server import TelemetryRecorder, start_server


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


async def start_scaler() -> Scaler:
    recorder = TelemetryRecorder()
    server, port = await start_server(recorder, 0, client_keepalive_time_s=1.0)
    return Scaler(recorder, server, port)


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


def single_stream(agent: Agent) -> SingleStream:
    """The agent's sink without --scaler-fanout: its buffer and stream, to look into."""
    assert isinstance(agent.sink, SingleStream), agent.sink
    return agent.sink


def fanout(agent: Agent) -> ScalerFanout:
    """The agent's sink with --scaler-fanout: its replicas, to look into."""
    assert isinstance(agent.sink, ScalerFanout), agent.sink
    return agent.sink


@dataclass
class Running:
    agent: Agent
    stop: asyncio.Event
    task: asyncio.Task[None]

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, timeout_s)


RunAgent = Callable[..., Awaitable[Running]]


class Agents:
    """Starts agents on the running loop and stops every one it started."""

    def __init__(self) -> None:
        self.running: list[Running] = []

    async def start(
        self, settings: AgentSettings, source: Source | None = None, **kw: Any
    ) -> Running:
        src = source or SyntheticSource(
            Profile.parse(settings.synthetic_profile), settings.synthetic_gpus, SystemClock()
        )
        agent = Agent(settings, src, **kw)
        stop = asyncio.Event()
        r = Running(agent, stop, asyncio.create_task(agent.run(stop)))
        self.running.append(r)
        return r

    async def stop_all(self) -> None:
        for r in self.running:
            if not r.task.done():
                r.stop.set()
                try:
                    await asyncio.wait_for(r.task, 10)
                except Exception:
                    r.task.cancel()
