"""Store fixtures: every test runs against SQLite (a temp file) and PostgreSQL.

PostgreSQL isolation: each test gets its own schema, named uniquely, reached
through ``search_path`` in the URL, and dropped afterwards; tests of other
areas sharing ``tide_test`` never see it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from tests.support.pg import schema_url
from tide.services.store import db


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
    with schema_url(admin, pg_url, "store") as url:
        yield url


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
