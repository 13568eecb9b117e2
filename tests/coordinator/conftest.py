"""Fixtures of the coordinator tests; the harness itself is tests/coordinator/support.py."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from urllib.parse import quote

import pytest
import sqlalchemy as sa

from services.coordinator.store import MemoryStore
from tests.coordinator.support import Env, close_env, make_env


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
