"""Helpers shared by the store tests (import these, never the conftest)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from sqlalchemy.orm import Session, sessionmaker

from tide.services.store import db


def sqlite_factory(tmp_path: Path, busy_timeout_s: float = 5.0) -> sessionmaker[Session]:
    """A migrated SQLite file under ``tmp_path`` and a session factory over it."""
    url = f"sqlite:///{tmp_path / 'tide.db'}"
    db.upgrade(url)
    return db.make_session_factory(
        db.make_engine(url, db.DbSettings(busy_timeout_s=busy_timeout_s))
    )


def no_sleep(seconds: float) -> None:
    """A unit of work's sleep that fails the test: it must not have retried."""
    raise AssertionError(f"unit of work retried (backoff {seconds} s) but must not")


R = TypeVar("R")


def tx(factory: sessionmaker[Session], fn: Callable[[Session], R]) -> R:
    """``fn`` in one transaction of ``factory``'s."""
    with db.session_scope(factory) as session:
        return fn(session)
