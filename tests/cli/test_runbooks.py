"""Every SQL file of docs/runbooks runs on PostgreSQL and answers its question correctly.

The schema is migrated fresh into a private PostgreSQL schema (other tests share
the tide_test database) and the history is written by the store's repository.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from tests.cli.seed import JOB, OTHER, T0, Seeded, seed
from tests.support.pg import schema_url
from tests.support.procs import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.postgres]

SQL_DIR = ROOT / "docs" / "runbooks" / "sql"
WEEK = {"since": T0.replace(hour=0, minute=0, second=0), "until": T0 + timedelta(days=7)}


@pytest.fixture(scope="module")
def pg(pg_url: str, pg_admin: Any) -> Iterator[tuple[Any, Seeded]]:
    with schema_url(pg_admin, pg_url, "runbooks") as url:
        ids = seed(url)
        engine = create_engine(url)
        yield engine, ids
        engine.dispose()


def run(engine: Any, name: str, **params: Any) -> list[dict[str, Any]]:
    sql = (SQL_DIR / name).read_text()
    # Comments may hold text a bind-parameter parser would misread; PostgreSQL skips them anyway.
    body = "\n".join(ln for ln in sql.splitlines() if not ln.lstrip().startswith("--"))
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(text(body), params)]


def test_every_sql_file_is_tested() -> None:
    tested = set(re.findall(r'"(\w+\.sql)"', Path(__file__).read_text()))
    assert {p.name for p in SQL_DIR.glob("*.sql")} == tested


def test_why_did_it_scale_at_1405(pg: tuple[Any, Seeded]) -> None:
    engine, ids = pg
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


def test_why_didnt_it_scale(pg: tuple[Any, Seeded]) -> None:
    engine, ids = pg
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


def test_freeze_shows_paused_jobs(pg: tuple[Any, Seeded]) -> None:
    engine, _ = pg
    rows = run(engine, "paused_jobs.sql")
    assert [(r["job_id"], r["pause_reason"], r["paused_at"]) for r in rows] == [
        (OTHER, "INC-7: storage outage", T0)
    ]


def test_what_scaling_cost_this_week(pg: tuple[Any, Seeded]) -> None:
    engine, _ = pg
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


def test_a_job_start_is_no_scaling_cost(pg: tuple[Any, Seeded]) -> None:
    from services.scaler import store as repo
    from services.store import db

    engine, _ = pg
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


def test_what_scaling_saved_this_week(pg: tuple[Any, Seeded]) -> None:
    engine, _ = pg
    (j,) = run(engine, "weekly_gpu_hours.sql", **WEEK)
    # 210 minutes observed: 120 at 4 replicas, 90 at 2; max_replicas is 8.
    assert j["job_id"] == JOB and j["minutes"] == 210
    assert float(j["gpu_hours_held"]) == pytest.approx((120 * 4 + 90 * 2) / 60)
    assert float(j["gpu_hours_at_max"]) == pytest.approx(210 * 8 / 60)
    assert float(j["gpu_hours_saved_vs_max"]) == pytest.approx(28.0 - 11.0)
    # 92 % busy until T0+1h (71 minutes, 10 at 2 replicas and 61 at 4), 20 % after.
    idle = (10 * 2 * 0.08 + 61 * 4 * 0.08 + 59 * 4 * 0.8 + 80 * 2 * 0.8) / 60
    assert float(j["gpu_hours_idle"]) == pytest.approx(idle)
