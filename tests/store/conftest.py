"""Store fixtures: every test runs against SQLite (a temp file) and PostgreSQL.

PostgreSQL isolation: each test gets its own schema, named uniquely, reached
through ``search_path`` in the URL, and dropped afterwards; tests of other
areas sharing ``tide_test`` never see it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from services.store import db
from tests.store.support import with_search_path


def _pg_admin(pg_url: str) -> sa.Engine:
    engine = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except sa.exc.OperationalError as exc:
        engine.dispose()
        if os.environ.get("TIDE_TEST_PG_URL"):
            # `make test` promised a database: its absence is a failure, not a skip.
            raise
        pytest.skip(f"PostgreSQL not reachable at {pg_url}: {exc.orig}")
    return engine


@pytest.fixture(scope="session")
def pg_admin(pg_url: str) -> Iterator[sa.Engine]:
    engine = _pg_admin(pg_url)
    yield engine
    engine.dispose()


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgresql", id="pg", marks=pytest.mark.postgres),
    ]
)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL of an empty database, on each engine."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'tide.db'}"
        return
    admin: sa.Engine = request.getfixturevalue("pg_admin")
    pg_url: str = request.getfixturevalue("pg_url")
    schema = f"store_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    try:
        yield with_search_path(pg_url, schema)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.fixture
def migrated_url(db_url: str) -> str:
    db.upgrade(db_url)
    return db_url


@pytest.fixture
def engine(migrated_url: str) -> Iterator[sa.Engine]:
    eng = db.make_engine(migrated_url)
    yield eng
    eng.dispose()


@pytest.fixture
def factory(engine: sa.Engine) -> sessionmaker[Session]:
    return db.make_session_factory(engine)
