"""Fixtures of the agent tests: a Telemetry server on port 0 and running agents.

What they are made of lives in tests/agent/support.py, which tests import."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from .support import Agents, RunAgent, Scaler, start_scaler


@pytest.fixture
async def scaler() -> AsyncIterator[Scaler]:
    s = await start_scaler()
    yield s
    await s.server.stop(None)


@pytest.fixture
async def run_agent() -> AsyncIterator[RunAgent]:
    agents = Agents()
    yield agents.start
    await agents.stop_all()
