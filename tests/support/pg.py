"""PostgreSQL for tests: the admin engine, and one schema per test in the shared database."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import quote

import pytest
import sqlalchemy as sa


def admin_engine(pg_url: str) -> sa.Engine:
    """An autocommit engine on ``pg_url``. Unreachable: a skip, except under `make test`
    (TIDE_TEST_PG_URL set), which promised a database, so its absence is a failure."""
    engine = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except sa.exc.OperationalError as exc:
        engine.dispose()
        if os.environ.get("TIDE_TEST_PG_URL"):
            raise
        pytest.skip(f"PostgreSQL not reachable at {pg_url}: {exc.orig}")
    return engine


def with_search_path(url: str, schema: str) -> str:
    """``url`` with PostgreSQL's search_path set to ``schema``."""
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}options={quote(f'-csearch_path={schema}')}"


@contextmanager
def schema_url(admin: sa.Engine, pg_url: str, prefix: str) -> Iterator[str]:
    """The URL of a new empty schema named ``prefix_<random>``, dropped afterwards:
    tide_test is shared by every suite."""
    schema = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    try:
        yield with_search_path(pg_url, schema)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
