"""Shared fixtures. Per-area fixtures live next to their tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def pg_url() -> str:
    """URL of the PostgreSQL test database; `make test` sets TIDE_TEST_PG_URL."""
    url = os.environ.get(
        "TIDE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/tide_test"
    )
    return url
