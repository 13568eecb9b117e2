"""Rough figures of the store on this machine: ``python -m tests.store.measure [--pg URL]``.

Not a test (pytest does not collect it): it prints per-operation latencies of
the repository through ``unit_of_work``, on SQLite (temp file, WAL, FULL) and,
when reachable, PostgreSQL (a throw-away schema).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from tide.services.scaler import store as repo
from tide.services.scaler.store import DecisionState as S
from tide.services.store import db

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def _timed(n: int, op: Callable[[int], Any]) -> list[float]:
    out = []
    for i in range(n):
        t = time.perf_counter()
        op(i)
        out.append((time.perf_counter() - t) * 1000)
    return out


def _fmt(name: str, ms: list[float]) -> str:
    ms = sorted(ms)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return f"  {name:<44} p50 {statistics.median(ms):7.2f} ms   p99 {p99:7.2f} ms   n={len(ms)}"


def measure(factory: sessionmaker[Session], label: str, decisions: int, seed_rows: int) -> None:
    print(f"{label}:")

    def uow(fn: Callable[[Session], Any], write: bool = True) -> Any:
        return db.unit_of_work(factory, fn, write=write)

    uow(lambda s: repo.upsert_job(s, "ml/a", min_replicas=1, max_replicas=64, now=T0))
    epoch = uow(lambda s: repo.acquire_job_ownership(s, "ml/a", "m", now=T0))
    ids: list[int] = []

    def create(i: int) -> None:
        d = uow(
            lambda s: repo.create_decision(
                s,
                job_id="ml/a",
                from_replicas=2,
                to_replicas=3,
                reason="SUSTAINED_HIGH_UTILIZATION",
                trigger="POLICY",
                message="m",
                inputs={"window": [85.0] * 10, "free_gpus": 4},
                epoch=epoch,
                now=T0 + timedelta(seconds=i),
            )
        )
        ids.append(d.id)

    def walk(i: int) -> None:
        for state in (S.PREPARING, S.ACTUATING, S.COMPLETED):
            uow(
                lambda s, st=state: repo.transition_decision(
                    s, ids[i], st, detail="", epoch=epoch, now=T0 + timedelta(seconds=i)
                )
            )

    created: list[float] = []
    walked: list[float] = []
    for i in range(decisions):
        created += _timed(1, lambda _j, i=i: create(i))
        walked += [x / 3 for x in _timed(1, lambda _j, i=i: walk(i))]
    print(_fmt("create_decision (fenced, + event) / tx", created))
    print(_fmt("transition_decision (fenced, + event) / tx", walked))

    # History: seed rows in bulk, then page through them.
    with db.session_scope(factory) as s:
        for i in range(seed_rows):
            repo.create_decision(
                s,
                job_id="ml/a",
                from_replicas=2,
                to_replicas=3,
                reason="MANUAL",
                trigger="MANUAL",
                message="",
                inputs={},
                epoch=epoch,
                now=T0 + timedelta(seconds=decisions + i),
                exclusive=False,
            )
    tokens: list[str] = [""]

    def page(_i: int) -> None:
        p = uow(
            lambda s: repo.list_decisions(s, job_id="ml/a", page_size=100, page_token=tokens[-1]),
            write=False,
        )
        tokens.append(p.next_page_token)

    print(_fmt(f"list_decisions page of 100 (of {seed_rows + decisions})", _timed(20, page)))

    minute0 = T0.replace(second=0)

    def rollups(i: int) -> None:
        rows = [
            repo.RollupRecord(f"ml/j{j}", minute0 + timedelta(minutes=i), 50, 40, 60, 60, 4)
            for j in range(100)
        ]
        uow(lambda s: repo.write_rollups(s, rows))

    print(_fmt("write_rollups, 100 jobs x 1 minute / tx", _timed(30, rollups)))
    print(_fmt("same minutes again (merge path)", _timed(30, rollups)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pg", default="postgresql+psycopg://postgres@127.0.0.1:5432/tide_test")
    ap.add_argument("--decisions", type=int, default=200)
    ap.add_argument("--seed-rows", type=int, default=10_000)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'tide.db'}"
        db.upgrade(url)
        engine = db.make_engine(url)
        measure(
            db.make_session_factory(engine), "SQLite (WAL, FULL)", args.decisions, args.seed_rows
        )
        engine.dispose()

    schema = f"measure_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(args.pg, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    except sa.exc.OperationalError as exc:
        print(f"PostgreSQL skipped: {exc.orig}")
        return
    try:
        url = f"{args.pg}?options=-csearch_path%3D{schema}"
        db.upgrade(url)
        engine = db.make_engine(url)
        measure(db.make_session_factory(engine), "PostgreSQL", args.decisions, args.seed_rows)
        engine.dispose()
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()


if __name__ == "__main__":
    main()
