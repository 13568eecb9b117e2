"""Migrations build the schema the models describe, and take it down again, on both engines."""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

# The models of every service register on Base.metadata when imported.
import tide.services.store.models.coordinator
import tide.services.store.models.scaler  # noqa: F401
from tide.base.errors import InvalidArgument, Unavailable
from tide.services.store import db

pytestmark = pytest.mark.integration

SCALER_TABLES = {"jobs", "decisions", "decision_events", "utilization_rollups"}


def _tables(url: str) -> set[str]:
    engine = db.make_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def _diff(url: str) -> list[object]:
    engine = db.make_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(
                conn, opts={"compare_type": True, "compare_server_default": True}
            )
            return list(compare_metadata(ctx, db.Base.metadata))
    finally:
        engine.dispose()


def _script() -> ScriptDirectory:
    return ScriptDirectory.from_config(db.alembic_config())


def test_history_is_linear_and_starts_at_0001_scaler() -> None:
    script = _script()
    assert script.get_heads() == [script.get_current_head()], "more than one head"
    revisions = list(script.walk_revisions())
    assert revisions[-1].revision == "0001_scaler"
    assert revisions[-1].down_revision is None


def test_upgrade_empty_database_to_head_then_back_to_base(db_url: str) -> None:
    assert db.current_revision(db_url) is None
    db.upgrade(db_url)
    assert db.current_revision(db_url) == _script().get_current_head()
    assert _tables(db_url) >= SCALER_TABLES
    assert _tables(db_url) == set(db.Base.metadata.tables)

    db.downgrade(db_url, "base")
    assert db.current_revision(db_url) is None
    assert _tables(db_url) == set()

    # And the way up works a second time (downgrades leave nothing behind that blocks it).
    db.upgrade(db_url)
    db.upgrade(db_url)  # at head already: a no-op, as every service start does
    assert _tables(db_url) == set(db.Base.metadata.tables)


def test_models_match_migrations(migrated_url: str) -> None:
    # Catches a model changed without a migration, by any service.
    assert _diff(migrated_url) == []


def test_every_revision_steps_up_and_down(db_url: str) -> None:
    revisions = [r.revision for r in reversed(list(_script().walk_revisions()))]
    for rev in revisions:
        db.upgrade(db_url, rev)
        assert db.current_revision(db_url) == rev
    for prev in [*reversed(revisions[:-1]), None]:
        db.downgrade(db_url, prev or "base")
        assert db.current_revision(db_url) == prev


def test_unknown_revision_is_invalid_argument(db_url: str) -> None:
    with pytest.raises(InvalidArgument, match="nope"):
        db.upgrade(db_url, "nope")


def test_unreachable_database_is_unavailable() -> None:
    # Port 1 on loopback: nothing listens, the connect fails fast.
    with pytest.raises(Unavailable):
        db.upgrade("postgresql+psycopg://postgres@127.0.0.1:1/none")


def test_services_starting_together_both_upgrade(db_url: str) -> None:
    # Scaler and coordinator call upgrade at start; two at once must not collide.
    errors: list[BaseException] = []
    start = threading.Barrier(3)

    def run() -> None:
        try:
            start.wait(timeout=10)
            db.upgrade(db_url)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert db.current_revision(db_url) == _script().get_current_head()
    assert _diff(db_url) == []


def test_0003_renames_a_stored_sync_timeout_override_and_back(db_url: str) -> None:
    """Overrides stored before the rename keep working after an upgrade; where both
    names are stored, phase_timeout_s was written later and wins."""
    db.upgrade(db_url, "0002_coordinator")
    engine = db.make_engine(db_url)
    jobs = sa.table("jobs", sa.column("job_id"), sa.column("policy_overrides", sa.JSON()))
    rows = {
        "ns/old": {"sync_timeout_s": 90.0, "cooldown_s": 10.0},
        "ns/both": {"sync_timeout_s": 90.0, "phase_timeout_s": 30.0},
        "ns/none": {"cooldown_s": 5.0},
    }
    try:
        with engine.begin() as conn:
            for job_id, overrides in rows.items():
                conn.execute(
                    sa.text(
                        "INSERT INTO jobs (job_id, min_replicas, max_replicas, current_replicas,"
                        " gpus_per_replica, policy_overrides, autoscaling_paused, pause_reason,"
                        " generation, owner_epoch, owner_id, created_at, updated_at, version)"
                        " VALUES (:j, 1, 8, 2, 1, :o, false, '', 0, 0, '', :t, :t, 1)"
                    ).bindparams(sa.bindparam("o", type_=sa.JSON())),
                    {"j": job_id, "o": overrides, "t": db.utc_from_epoch(1_800_000_000)},
                )
        db.upgrade(db_url)

        def stored() -> dict[str, object]:
            with engine.connect() as conn:
                return dict(conn.execute(sa.select(jobs.c.job_id, jobs.c.policy_overrides)).all())

        assert stored() == {
            "ns/old": {"phase_timeout_s": 90.0, "cooldown_s": 10.0},
            "ns/both": {"phase_timeout_s": 30.0},
            "ns/none": {"cooldown_s": 5.0},
        }
        db.downgrade(db_url, "0002_coordinator")
        assert stored()["ns/old"] == {"sync_timeout_s": 90.0, "cooldown_s": 10.0}
    finally:
        engine.dispose()
