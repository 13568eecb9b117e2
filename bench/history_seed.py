"""The seeded store of bench.history (and of bench.scale and bench.lifecycle): 1,000
jobs over 90 days, a busy one, a huge one, a few with a decision still running,
written by COPY on PostgreSQL and executemany on SQLite in a private schema.

Its own module because three benchmarks stand on it, and what each measures
(bench/history.py: the CLI and the API; bench/scale.py; bench/lifecycle.py) changes
apart from how the rows are made.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

DEFAULT_PG = "postgresql+psycopg://postgres@127.0.0.1:5432/tide_test"
JOBS = 1000
BUSY = "bench/busy"
BUSY_DECISIONS = 20_000
#: A job with a hundred thousand decisions, seeded besides ``--decisions``: what
#: ``tide history HUGE --all`` costs (``history_100k_table_s``, the issue's 8.8 s).
HUGE = "bench/huge"
HUGE_DECISIONS = 100_000
DAYS = 90
OPEN_JOBS = 20  # jobs with a decision still running
NOW = datetime.now(tz=UTC).replace(microsecond=0)

INPUTS = json.dumps(
    {
        "window": {
            "bucket_s": 30.0,
            "bucket_means_pct": [91.0, 92.0, 93.0, 92.0],
            "coverage": 1.0,
            "gpus_expected": 4,
            "gpus_fresh": 4,
            "mean_pct": 92.0,
        },
        "policy": {"scale_up_utilization_pct": 80.0, "scale_down_utilization_pct": 40.0},
        "current_replicas": 2,
        "free_gpus": 6,
        "raw_target_replicas": 4,
    }
)


@contextmanager
def pg_schema(url: str) -> Iterator[str]:
    from urllib.parse import quote

    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    schema = f"bench_history_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    sep = "&" if "?" in url else "?"
    try:
        yield f"{url}{sep}options={quote(f'-csearch_path={schema}')}"
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()


def _job_rows() -> list[tuple[Any, ...]]:
    made = NOW - timedelta(days=DAYS + 1)
    ids = [BUSY, HUGE] + [f"bench/j{i:04d}" for i in range(JOBS - 1)]
    # job_id, min, max, current, gpus, overrides, paused, reason, paused_at, generation,
    # last_resize_ended_at, owner_epoch, owner_id, created_at, updated_at, version
    return [(j, 2, 8, 4, 1, "{}", False, "", None, 1, made, 0, "", made, made, 1) for j in ids]


JOB_COLS = (
    "job_id, min_replicas, max_replicas, current_replicas, gpus_per_replica, policy_overrides,"
    " autoscaling_paused, pause_reason, paused_at, generation, last_resize_ended_at,"
    " owner_epoch, owner_id, created_at, updated_at, version"
)
DECISION_COLS = (
    "id, job_id, from_replicas, to_replicas, reason, trigger, message, inputs, state, error,"
    " pause_s, lost_steps, generation, requested_by, created_at, updated_at, ended_at, version"
)
EVENT_COLS = "id, decision_id, state, at, detail"


def _decisions(total: int) -> Iterator[tuple[tuple[Any, ...], tuple[Any, ...]]]:
    """(decision row, event row), oldest first per job; the busy job's 20,000 over 90
    days, the rest spread over the other jobs; OPEN_JOBS jobs end with an open one."""
    span = DAYS * 86400.0
    others = [f"bench/j{i:04d}" for i in range(JOBS - 1)]
    busy = min(BUSY_DECISIONS, total)
    rest = total - busy
    plan: list[tuple[str, int, int]] = [(BUSY, i, busy) for i in range(busy)]
    plan += [(HUGE, i, HUGE_DECISIONS) for i in range(HUGE_DECISIONS)]
    per = max(1, rest // len(others))
    n = 0
    for j in others:
        for i in range(per):
            if n >= rest:
                break
            plan.append((j, i, per))
            n += 1
    for k, (job, i, of) in enumerate(plan, start=1):
        at = NOW - timedelta(seconds=span * (1 - (i + 0.5) / of))
        last = i == of - 1
        running = last and job in others[:OPEN_JOBS]
        state = "PREPARING" if running else ("ABORTED" if k % 17 == 0 else "COMPLETED")
        grow = k % 2 == 0
        frm, to = (2, 4) if grow else (4, 2)
        reason = "SUSTAINED_HIGH_UTILIZATION" if grow else "SUSTAINED_LOW_UTILIZATION"
        end = None if running else at + timedelta(seconds=9)
        d = (
            k, job, frm, to, reason, "POLICY", f"{reason.lower()}: {frm} -> {to}", INPUTS,
            state, "", 2.5, 0, k, "", at, end or at, end, 1,
        )  # fmt: skip
        e = (k, k, state, end or at, state.lower())
        yield d, e


def seed(url: str, total: int) -> float:
    """Migrate and fill the store; returns the seconds it took."""
    from tide.services.store import db

    t0 = time.perf_counter()
    db.upgrade(url)
    engine = db.make_engine(url)
    try:
        if engine.dialect.name == "postgresql":
            _seed_pg(engine, total)
        else:
            _seed_sqlite(engine, total)
    finally:
        engine.dispose()
    return time.perf_counter() - t0


def _seed_pg(engine: sa.Engine, total: int) -> None:
    raw: Any = engine.raw_connection()
    try:
        conn = raw.driver_connection
        with conn.cursor() as cur:
            with cur.copy(f"COPY jobs ({JOB_COLS}) FROM STDIN") as cp:
                for row in _job_rows():
                    cp.write_row(row)
            events = []
            with cur.copy(f"COPY decisions ({DECISION_COLS}) FROM STDIN") as cp:
                for d, e in _decisions(total):
                    cp.write_row(d)
                    events.append(e)
            with cur.copy(f"COPY decision_events ({EVENT_COLS}) FROM STDIN") as cp:
                for e in events:
                    cp.write_row(e)
            for table in ("decisions", "decision_events"):
                cur.execute(
                    f"SELECT setval(pg_get_serial_sequence('{table}', 'id'),"
                    f" (SELECT max(id) FROM {table}))"
                )
        conn.commit()
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("ANALYZE")
    finally:
        raw.close()


def _seed_sqlite(engine: sa.Engine, total: int) -> None:
    def fmt(row: tuple[Any, ...]) -> tuple[Any, ...]:
        # The store's SQLite format for times (tide/services/store/db.py UTCDateTime).
        return tuple(
            v.astimezone(UTC).replace(tzinfo=None).isoformat(" ", "microseconds")
            if isinstance(v, datetime)
            else v
            for v in row
        )

    raw: Any = engine.raw_connection()
    try:
        cur = raw.cursor()
        q = ", ".join("?" * len(JOB_COLS.split(",")))
        cur.executemany(f"INSERT INTO jobs ({JOB_COLS}) VALUES ({q})", map(fmt, _job_rows()))
        dq = ", ".join("?" * len(DECISION_COLS.split(",")))
        eq = ", ".join("?" * len(EVENT_COLS.split(",")))
        rows = list(_decisions(total))
        cur.executemany(
            f"INSERT INTO decisions ({DECISION_COLS}) VALUES ({dq})", (fmt(d) for d, _ in rows)
        )
        cur.executemany(
            f"INSERT INTO decision_events ({EVENT_COLS}) VALUES ({eq})", (fmt(e) for _, e in rows)
        )
        raw.commit()
        cur.execute("ANALYZE")
    finally:
        raw.close()
