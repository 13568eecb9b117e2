"""Every SQL file of docs/runbooks runs on both stores and answers its question correctly.

Each engine has its own copy (docs/runbooks/sql/postgresql, sql/sqlite): the dialects
differ on times, intervals and JSON. Every test runs on both; one more runs each
query on both with the same parameters and compares the rows, normalised (SQLite
returns times as text and booleans as 0/1, PostgreSQL numerics as Decimal). The
schema is migrated fresh (a private PostgreSQL schema: other tests share the
tide_test database; a temp SQLite file) and the history is written by the store's
repository. Parameters are passed as text, as a person would type them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text

from tests.cli.seed import JOB, OTHER, T0, Seeded, seed
from tests.support.pg import schema_url
from tests.support.procs import ROOT

pytestmark = pytest.mark.integration

SQL_DIR = ROOT / "docs" / "runbooks" / "sql"
ENGINES = ("postgresql", "sqlite")
WEEK = {"since": T0.replace(hour=0, minute=0, second=0), "until": T0 + timedelta(days=7)}
_TIME = re.compile(r"^\d{4}-\d\d-\d\d[ T]\d\d:\d\d")


@pytest.fixture(scope="module")
def pg_store(pg_url: str, pg_admin: Any) -> Iterator[tuple[Engine, Seeded]]:
    with schema_url(pg_admin, pg_url, "runbooks") as url:
        ids = seed(url)
        engine = create_engine(url)
        yield engine, ids
        engine.dispose()


@pytest.fixture(scope="module")
def sqlite_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Seeded]]:
    url = f"sqlite:///{tmp_path_factory.mktemp('runbooks') / 'tide.db'}"
    ids = seed(url)
    engine = create_engine(url)
    yield engine, ids
    engine.dispose()


@pytest.fixture(
    params=[
        pytest.param("postgresql", marks=pytest.mark.postgres),
        pytest.param("sqlite"),
    ]
)
def store(request: pytest.FixtureRequest) -> tuple[Engine, Seeded]:
    """The seeded store of each engine."""
    name = "pg_store" if request.param == "postgresql" else "sqlite_store"
    seeded: tuple[Engine, Seeded] = request.getfixturevalue(name)
    return seeded


def normal(value: Any) -> Any:
    """One engine's value as the other's would read: aware UTC datetimes, floats, ints for
    booleans, parsed JSON."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, Decimal):
        value = float(value)
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, datetime):
        return value.astimezone(UTC)
    if isinstance(value, str) and _TIME.match(value):
        return datetime.fromisoformat(value).replace(tzinfo=UTC)
    if isinstance(value, str) and value.startswith(("[", "{")):
        return json.loads(value)
    if isinstance(value, list):
        return [normal(v) for v in value]
    return value


def run(engine: Engine, name: str, **params: Any) -> list[dict[str, Any]]:
    sql = (SQL_DIR / engine.dialect.name / name).read_text()
    # Comments may hold text a bind-parameter parser would misread; both engines skip them.
    body = "\n".join(ln for ln in sql.splitlines() if not ln.lstrip().startswith("--"))
    typed = {k: v.isoformat() if isinstance(v, datetime) else v for k, v in params.items()}
    with engine.connect() as conn:
        return [
            {k: normal(v) for k, v in r._mapping.items()} for r in conn.execute(text(body), typed)
        ]


def test_every_sql_file_is_tested_and_has_both_versions() -> None:
    tested = set(re.findall(r'"(\w+\.sql)"', Path(__file__).read_text()))
    for engine in ENGINES:
        assert {p.name for p in (SQL_DIR / engine).glob("*.sql")} == tested, engine
    assert not list(SQL_DIR.glob("*.sql")), "a query belongs in the directory of its engine"


def test_why_did_it_scale_at_1405(store: tuple[Engine, Seeded]) -> None:
    engine, ids = store
    at = T0.replace(second=0)
    rows = run(
        engine,
        "decisions_between.sql",
        job_id=JOB,
        since=at - timedelta(minutes=5),
        until=at + timedelta(minutes=5),
    )
    assert [
        (r["id"], r["from_replicas"], r["to_replicas"], r["reason"], r["state"]) for r in rows
    ] == [(ids.grow, 2, 4, "SUSTAINED_HIGH_UTILIZATION", "COMPLETED")]
    assert rows[0]["pause_s"] == 2.5

    (inp,) = run(engine, "decision_inputs.sql", decision_id=ids.grow)
    assert inp["window_mean_pct"] == 92.0 and inp["scale_up_pct"] == 80.0
    assert inp["bucket_means_pct"] == [91.0, None, 93.0, 92.0]
    assert (inp["raw_target_replicas"], inp["free_gpus"], inp["sustain_s"]) == (4, 6, 120.0)

    events = run(engine, "decision_events.sql", decision_id=ids.grow)
    assert [e["state"] for e in events] == ["PENDING", "PREPARING", "ACTUATING", "COMPLETED"]
    assert [float(e["seconds_after_created"]) for e in events] == [0.0, 3.0, 6.0, 9.0]

    around = run(engine, "utilization_around.sql", decision_id=ids.grow, context_minutes=5)
    assert len(around) == 11
    (marked,) = [r for r in around if r["decision_minute"]]
    assert marked["minute"] == at and marked["replicas"] == 4 and marked["mean_pct"] == 92.0
    assert around[0]["replicas"] == 2


def test_why_didnt_it_scale(store: tuple[Engine, Seeded]) -> None:
    engine, ids = store
    (other,) = run(engine, "job_blockers.sql", job_id=OTHER, default_cooldown_s=300)
    assert other["autoscaling_paused"] and other["pause_reason"] == "INC-7: storage outage"
    assert other["active_decision_id"] == ids.running
    (job,) = run(engine, "job_blockers.sql", job_id=JOB, default_cooldown_s=300)
    assert not job["autoscaling_paused"] and job["active_decision_id"] is None
    # The aborted grow ended 6 s after T0+3h (two transitions, 3 s apart).
    ended = T0 + timedelta(hours=3, seconds=6)
    assert job["last_resize_ended_at"] == ended
    assert job["cooldown_ends_at"] == ended + timedelta(seconds=300)
    assert job["at_min_replicas"] and not job["at_max_replicas"]

    rows = run(engine, "failed_or_stuck.sql", since=T0)
    assert [(r["id"], r["state"]) for r in rows] == [
        (ids.running, "PREPARING"),
        (ids.aborted, "ABORTED"),
    ]
    assert rows[1]["error"].startswith("barrier deadline")
    assert rows[0]["last_event"] == "preparing (step 1)" and rows[0]["ended_at"] is None

    # After the first hour the load dropped: no minute clears the scale-up threshold.
    minutes = run(
        engine,
        "utilization_vs_thresholds.sql",
        job_id=JOB,
        since=T0 + timedelta(hours=1, minutes=1),
        until=T0 + timedelta(hours=1, minutes=31),
        scale_up_pct=80,
        scale_down_pct=40,
    )
    assert len(minutes) == 30
    assert not any(m["mean_above_scale_up"] for m in minutes)
    assert all(m["mean_below_scale_down"] for m in minutes)


def test_freeze_shows_paused_jobs(store: tuple[Engine, Seeded]) -> None:
    engine, _ = store
    rows = run(engine, "paused_jobs.sql")
    assert [(r["job_id"], r["pause_reason"], r["paused_at"]) for r in rows] == [
        (OTHER, "INC-7: storage outage", T0)
    ]


def test_what_scaling_cost_this_week(store: tuple[Engine, Seeded]) -> None:
    engine, _ = store
    rows = {r["job_id"]: r for r in run(engine, "weekly_decisions.sql", **WEEK)}
    j = rows[JOB]
    assert (j["decisions"], j["completed"], j["aborted"], j["failed"]) == (3, 2, 1, 0)
    assert (j["grows"], j["shrinks"], j["manual"], j["lost_steps"]) == (1, 1, 0, 0)
    assert j["pause_s_total"] == pytest.approx(4.25) and j["pause_s_max"] == 2.5
    # 2.5 s with 4 GPUs, 1.75 s with 2, the abort paused nobody.
    assert j["pause_gpu_s"] == pytest.approx(2.5 * 4 + 1.75 * 2)
    assert rows[OTHER]["manual"] == 1 and rows[OTHER]["decisions"] == 2
    assert j["starts"] == 0 and rows[OTHER]["starts"] == 0
    last_week = run(
        engine, "weekly_decisions.sql", since=WEEK["since"] - timedelta(days=7), until=WEEK["since"]
    )
    assert last_week == []


#: Each query with the parameters of the tests above.
PARAMS: dict[str, dict[str, Any]] = {
    "decisions_between.sql": {
        "job_id": JOB,
        "since": T0 - timedelta(hours=1),
        "until": T0 + timedelta(hours=6),
    },
    "decision_inputs.sql": {"decision_id": 1},
    "decision_events.sql": {"decision_id": 3},
    "utilization_around.sql": {"decision_id": 1, "context_minutes": 5},
    "job_blockers.sql": {"job_id": JOB, "default_cooldown_s": 300},
    "failed_or_stuck.sql": {"since": T0},
    "utilization_vs_thresholds.sql": {
        "job_id": JOB,
        "since": T0,
        "until": T0 + timedelta(hours=2),
        "scale_up_pct": 80,
        "scale_down_pct": 40,
    },
    "paused_jobs.sql": {},
    "weekly_decisions.sql": WEEK,
    "weekly_gpu_hours.sql": WEEK,
}


@pytest.mark.postgres
@pytest.mark.parametrize("name", sorted(PARAMS))
def test_both_engines_give_the_same_rows(
    name: str, pg_store: tuple[Engine, Seeded], sqlite_store: tuple[Engine, Seeded]
) -> None:
    assert pg_store[1] == sqlite_store[1]
    on_pg = run(pg_store[0], name, **PARAMS[name])
    on_sqlite = run(sqlite_store[0], name, **PARAMS[name])
    assert on_pg, f"{name} answers nothing here: the comparison would prove nothing"
    assert on_pg == on_sqlite


def test_the_weekly_gpu_hours_read_the_week_by_index(store: tuple[Engine, Seeded]) -> None:
    # Rollups are a row per job per minute: a scan over all of them would read
    # every job's whole retention to answer for one week.
    engine, _ = store
    sql = (SQL_DIR / engine.dialect.name / "weekly_gpu_hours.sql").read_text()
    body = "\n".join(ln for ln in sql.splitlines() if not ln.lstrip().startswith("--"))
    week = {k: v.isoformat() for k, v in WEEK.items()}
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            plan = conn.execute(text(f"EXPLAIN QUERY PLAN {body}"), week).all()
            shown = " ".join(str(r[-1]) for r in plan)
        else:
            conn.exec_driver_sql("SET enable_seqscan = off")
            shown = " ".join(str(r[0]) for r in conn.execute(text(f"EXPLAIN {body}"), week))
    assert "ix_utilization_rollups_minute" in shown, shown


def test_a_job_start_is_no_scaling_cost(store: tuple[Engine, Seeded]) -> None:
    from tide.services.scaler import store as repo
    from tide.services.store import db

    engine, _ = store
    job, at = "ml/fresh", T0 + timedelta(hours=1)
    with db.session_scope(db.make_session_factory(engine)) as s:
        repo.upsert_job(s, job, min_replicas=2, max_replicas=8, now=at, initial_replicas=2)
        repo.set_job_observed(s, job, now=at, current_replicas=0)
        epoch = repo.acquire_job_ownership(s, job, "scaler-a", now=at)
        d = repo.create_decision(
            s,
            job_id=job,
            from_replicas=0,
            to_replicas=2,
            reason="JOB_STARTED",
            trigger="MANUAL",
            message="new job",
            inputs={},
            epoch=epoch,
            now=at,
        )
        for state in ("PREPARING", "ACTUATING", "COMPLETED"):
            repo.transition_decision(
                s,
                d.id,
                repo.DecisionState(state),
                detail=state,
                epoch=epoch,
                now=at,
                pause_s=40.0 if state == "COMPLETED" else None,
                generation=1 if state == "COMPLETED" else None,
            )
    rows = {r["job_id"]: r for r in run(engine, "weekly_decisions.sql", **WEEK)}
    fresh = rows[job]
    assert (fresh["decisions"], fresh["starts"], fresh["completed"]) == (1, 1, 1)
    # Its 40 s start-up is neither a grow, a manual resize nor a pause of scaling.
    assert (fresh["grows"], fresh["manual"], fresh["pause_s_total"], fresh["pause_gpu_s"]) == (
        0,
        0,
        0,
        0,
    )


def test_what_scaling_saved_this_week(store: tuple[Engine, Seeded]) -> None:
    engine, _ = store
    (j,) = run(engine, "weekly_gpu_hours.sql", **WEEK)
    # 210 minutes observed: 120 at 4 replicas, 90 at 2; max_replicas is 8.
    assert j["job_id"] == JOB and j["minutes"] == 210
    assert float(j["gpu_hours_held"]) == pytest.approx((120 * 4 + 90 * 2) / 60)
    assert float(j["gpu_hours_at_max"]) == pytest.approx(210 * 8 / 60)
    assert float(j["gpu_hours_saved_vs_max"]) == pytest.approx(28.0 - 11.0)
    # 92 % busy until T0+1h (71 minutes, 10 at 2 replicas and 61 at 4), 20 % after.
    idle = (10 * 2 * 0.08 + 61 * 4 * 0.08 + 59 * 4 * 0.8 + 80 * 2 * 0.8) / 60
    assert float(j["gpu_hours_idle"]) == pytest.approx(idle)
