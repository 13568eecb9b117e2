"""Fixtures of the trainer tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.trainer.fake_coordinator import FakeCoordinator, start_fake


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeCoordinator, int]]:
    """The fake coordinator served on a free loopback port: (it, the port)."""
    coord = FakeCoordinator()
    server, port = await start_fake(coord)
    yield coord, port
    await server.stop(None)
