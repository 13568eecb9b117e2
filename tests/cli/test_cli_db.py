"""`tide db upgrade|downgrade`: the schema commands keep the exit-code convention."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect
from typer.testing import CliRunner

from tide.services.cli.main import app
from tide.services.store import db

pytestmark = pytest.mark.integration

runner = CliRunner()


def test_upgrade_then_downgrade_a_fresh_sqlite_store(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'tide.db'}"
    r = runner.invoke(app, ["db", "upgrade", "--db", url])
    assert r.exit_code == 0, r.stderr
    head = db.current_revision(url)
    assert head is not None and r.stdout.strip() == f"schema at {head}"
    engine = create_engine(url)
    assert {"jobs", "decisions", "decision_events"} <= set(inspect(engine).get_table_names())
    engine.dispose()
    # Idempotent: a second upgrade finds head.
    assert runner.invoke(app, ["db", "upgrade", "--db", url]).exit_code == 0
    r = runner.invoke(app, ["db", "downgrade", "base", "--db", url])
    assert r.exit_code == 0 and r.stdout.strip() == "schema at None"


def test_the_url_comes_from_the_environment(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'env.db'}"
    r = runner.invoke(app, ["db", "upgrade"], env={"TIDE_DB": url})
    assert r.exit_code == 0 and (tmp_path / "env.db").exists()


def test_bad_url_and_unreachable_database() -> None:
    r = runner.invoke(app, ["db", "upgrade", "--db", "mysql://nope"])
    assert r.exit_code == 2 and r.stderr.startswith("tide: ")
    r = runner.invoke(app, ["db", "upgrade", "--db", "postgresql+psycopg://postgres@127.0.0.1:1/x"])
    assert r.exit_code == 3 and r.stderr.startswith("tide: ") and r.stderr.count("\n") == 1
