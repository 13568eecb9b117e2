"""Fixtures of the coordinator tests; the harness itself is tests/coordinator/support.py."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import sqlalchemy as sa

from tests.coordinator.support import Env, close_env, make_env
from tests.support.pg import schema_url
from tide.services.coordinator.store import MemoryStore


@pytest.fixture
def pg_schema_url(pg_url: str, pg_admin: sa.Engine) -> Iterator[str]:
    """A schema of its own in the shared test database, dropped afterwards."""
    with schema_url(pg_admin, pg_url, "coord") as url:
        yield url


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    e = await make_env(MemoryStore())
    yield e
    await close_env(e)
