"""Reliability catalog T19: several processes of several threads writing decisions
and heartbeats at once through the real store code, on SQLite and PostgreSQL
(bench/contention.py). No acknowledged write lost, none written twice, and a
write fails only as StoreUnavailable (UNAVAILABLE), never otherwise. CI runs it
for 3 s per store; nightly for 3 minutes with 16 writers."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from bench import contention
from tests.support.pg import admin_engine
from tide.services.store import db
from tide.services.store.models.scaler import Decision, DecisionEvent

pytestmark = [pytest.mark.integration]


def _holds(result: dict[str, Any]) -> None:
    print(f"T19 RESULT {json.dumps(result)}")
    assert result["errors"] == 0, result["first_errors"]
    assert result["lost"] == 0, result
    assert result["duplicated"] == 0, result
    assert result["writes"] > 0, result


@pytest.fixture
def pg(pg_url: str) -> str:
    admin_engine(pg_url).dispose()  # skips (or fails under make test) without PostgreSQL
    return pg_url


def test_sqlite_writers_lose_nothing() -> None:
    _holds(contention.run("sqlite", "", processes=2, threads=2, seconds=3.0))


@pytest.mark.postgres
def test_postgres_writers_lose_nothing(pg: str) -> None:
    _holds(contention.run("postgres", pg, processes=2, threads=2, seconds=3.0))


@pytest.mark.nightly
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_long_contention_loses_nothing(kind: str, pg_url: str) -> None:
    if kind == "postgres":
        admin_engine(pg_url).dispose()
    _holds(contention.run(kind, pg_url, processes=4, threads=4, seconds=180.0))


def test_the_tally_finds_a_lost_write(tmp_path: Path) -> None:
    """A decision or a heartbeat acknowledged and then gone from the store is lost."""
    url = f"sqlite:///{tmp_path / 'tide.db'}"
    db.upgrade(url)
    factory = db.make_session_factory(db.make_engine(url))
    epochs = contention.own_hot_jobs(factory)
    out: dict[str, Any] = {}
    contention._writer(factory, "w", epochs, time.monotonic() + 0.3, out)
    assert contention.tally(factory, [out], 0.3)["lost"] == 0
    assert out["decisions"] and out["beat"] > 0, out
    with factory.begin() as s:
        first = min(out["decisions"])
        s.execute(sa.delete(DecisionEvent).where(DecisionEvent.decision_id == first))
        s.execute(sa.delete(Decision).where(Decision.id == first))
    assert contention.tally(factory, [out], 0.3)["lost"] == 1
    assert contention.tally(factory, [{**out, "beat": out["beat"] + 1}], 0.3)["lost"] == 2
    factory.kw["bind"].dispose()
