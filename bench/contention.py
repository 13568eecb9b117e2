"""SQLite and PostgreSQL write contention through the real store code (reliability
catalog T19; docs/reliability.md).

    python -m bench.contention [--quick] [--db sqlite|postgres|both] [--seconds 60]
                               [--processes 3] [--threads 4] [--pg-url URL]

``--processes`` processes of ``--threads`` threads each write for ``--seconds``
against one store (a SQLite file in WAL mode, or a fresh PostgreSQL schema),
every write a unit of work (tide.services.store.db.unit_of_work) of the scaler's
repository, alternating:

- a decision (``create_decision``) on one of two shared hot jobs: its fencing
  check locks the job row, so every writer queues on the same two rows;
- a heartbeat (``set_job_observed``) on the writer's own job, its counter as
  the observed replicas, as the scaler records what it observes.

What must hold: no acknowledged write is lost (every decision id a writer was
given is in the store; each writer's job holds its last acknowledged counter),
nothing is written twice (decisions stored = decisions acknowledged, as no
write failed), and a write fails only as the store's documented answer to
overload, ``StoreUnavailable`` (UNAVAILABLE at the gRPC edge) after its
retries; anything else is an error. The latency of each acknowledged write,
retries included, is reported; the baseline of the run is the same writers one
at a time (``--processes 1 --threads 1`` for a tenth of the time):
``p99_over_single`` says what contention costs.

The last line is ``RESULT {json}``: per backend ``writes``, ``writes_per_s``,
``lost``, ``duplicated``, ``unavailable``, ``errors``, ``p50_ms``, ``p99_ms``,
``single_p99_ms``, ``p99_over_single``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import sqlalchemy as sa
from sqlalchemy.orm import Session

HOT_JOBS = ("c/hot-0", "c/hot-1")
DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/tide_test"


def _now() -> datetime:
    return datetime.now(UTC)


def _writer(
    factory: Any, name: str, epochs: dict[str, int], until: float, out: dict[str, Any]
) -> None:
    from tide.base.errors import StoreUnavailable
    from tide.services.scaler import store as repo
    from tide.services.store import db

    job = f"c/{name}"
    # The heartbeat counter goes on from what the job holds once registered.
    beat = db.unit_of_work(
        factory,
        lambda s: repo.upsert_job(s, job, min_replicas=1, max_replicas=1 << 30, now=_now()),
        what=f"register {job}",
    ).current_replicas
    decisions: list[int] = []
    latencies: list[float] = []
    unavailable = 0
    errors: list[str] = []
    i = 0
    while time.monotonic() < until:
        hot = HOT_JOBS[i % len(HOT_JOBS)]
        started = time.monotonic()
        try:
            if i % 2 == 0:

                def decide(s: Session, hot: str = hot) -> repo.DecisionRecord:
                    return repo.create_decision(
                        s,
                        job_id=hot,
                        from_replicas=1,
                        to_replicas=2,
                        reason="MANUAL",
                        trigger="MANUAL",
                        message=name,
                        inputs={},
                        epoch=epochs[hot],
                        now=_now(),
                        exclusive=False,
                    )

                decisions.append(db.unit_of_work(factory, decide, what=f"decision for {hot}").id)
            else:
                n = beat + 1

                def heartbeat(s: Session, n: int = n) -> object:
                    return repo.set_job_observed(s, job, now=_now(), current_replicas=n)

                db.unit_of_work(factory, heartbeat, what=f"heartbeat of {job}")
                beat = n
            latencies.append(time.monotonic() - started)
        except StoreUnavailable:
            unavailable += 1
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        i += 1
    out.update(
        name=name,
        job=job,
        decisions=decisions,
        beat=beat,
        latencies=latencies,
        unavailable=unavailable,
        errors=errors,
    )


def _process(
    url: str, proc: int, threads: int, seconds: float, epochs: dict[str, int], results: Any
) -> None:
    from tide.services.store import db

    engine = db.make_engine(url)
    factory = db.make_session_factory(engine)
    outs: list[dict[str, Any]] = [{} for _ in range(threads)]
    until = time.monotonic() + seconds
    workers = [
        threading.Thread(target=_writer, args=(factory, f"w{proc}-{t}", epochs, until, outs[t]))
        for t in range(threads)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    engine.dispose()
    results.put(outs)


def _pct(sorted_s: list[float], q: float) -> float:
    if not sorted_s:
        return float("nan")
    return round(1000 * sorted_s[min(len(sorted_s) - 1, int(q * len(sorted_s)))], 2)


def own_hot_jobs(factory: Any) -> dict[str, int]:
    """The shared jobs, owned by this run: their epochs, for the writers' fencing."""
    from tide.services.scaler import store as repo
    from tide.services.store import db

    epochs: dict[str, int] = {}
    for hot in HOT_JOBS:

        def own(s: Any, hot: str = hot) -> int:
            repo.upsert_job(s, hot, min_replicas=1, max_replicas=9, now=_now())
            return repo.acquire_job_ownership(s, hot, "bench", now=_now())

        epochs[hot] = db.unit_of_work(factory, own, what="hot job")
    return epochs


def run_once(url: str, processes: int, threads: int, seconds: float) -> dict[str, Any]:
    """One contention run against a migrated, empty store at ``url``."""
    from tide.services.store import db

    engine = db.make_engine(url)
    factory = db.make_session_factory(engine)
    epochs = own_hot_jobs(factory)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_process, args=(url, p, threads, seconds, epochs, results))
        for p in range(processes)
    ]
    started = time.monotonic()
    for p in procs:
        p.start()
    try:
        outs = [o for _ in procs for o in results.get(timeout=seconds + 120)]
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    elapsed = time.monotonic() - started
    result = tally(factory, outs, seconds)
    engine.dispose()
    result.update(wall_s=round(elapsed, 1), writers=processes * threads)
    return result


def tally(factory: Any, outs: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """What the writers' answers (``outs``) and the store say together."""
    from tide.services.scaler import store as repo
    from tide.services.store import db
    from tide.services.store.models.scaler import Decision

    acked = {d for o in outs for d in o["decisions"]}
    with db.session_scope(factory, write=False) as s:
        stored = {
            int(r[0])
            for r in s.execute(sa.select(Decision.id).where(Decision.job_id.in_(HOT_JOBS)))
        }
        beats_lost = [
            (o["job"], o["beat"], got)
            for o in outs
            if (got := repo.get_job(s, o["job"]).current_replicas) != o["beat"]
        ]
    unavailable = sum(o["unavailable"] for o in outs)
    errors = [e for o in outs for e in o["errors"]]
    lat = sorted(x for o in outs for x in o["latencies"])
    return {
        "writes": len(lat),
        "writes_per_s": round(len(lat) / seconds, 1),
        "lost": len(acked - stored) + len(beats_lost),
        "lost_decisions": sorted(acked - stored)[:5],
        "lost_heartbeats": beats_lost[:5],
        # A write that failed may still have committed (its answer was lost): only
        # decisions beyond the acknowledged and the failed ones are duplicates.
        "duplicated": max(0, len(stored) - len(acked) - unavailable - len(errors)),
        "unavailable": unavailable,
        "errors": len(errors),
        "first_errors": errors[:3],
        "p50_ms": _pct(lat, 0.5),
        "p99_ms": _pct(lat, 0.99),
    }


@contextlib.contextmanager
def _store(kind: str, pg_url: str) -> Iterator[str]:
    from tide.services.store import db

    if kind == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            url = f"sqlite:///{tmp}/tide.db"
            db.upgrade(url)
            yield url
        return
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    schema = f"contention_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    try:
        sep = "&" if "?" in pg_url else "?"
        url = f"{pg_url}{sep}options={quote(f'-csearch_path={schema}')}"
        db.upgrade(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()


def run(kind: str, pg_url: str, processes: int, threads: int, seconds: float) -> dict[str, Any]:
    with _store(kind, pg_url) as url:
        single = run_once(url, 1, 1, max(2.0, seconds / 10))
    with _store(kind, pg_url) as url:
        result = run_once(url, processes, threads, seconds)
    result["single_p99_ms"] = single["p99_ms"]
    result["p99_over_single"] = round(result["p99_ms"] / single["p99_ms"], 2)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10 s per backend")
    ap.add_argument("--db", choices=("sqlite", "postgres", "both"), default="both")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--pg-url", default=os.environ.get("TIDE_TEST_PG_URL", DEFAULT_PG_URL))
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds = 10.0
    kinds = ("sqlite", "postgres") if args.db == "both" else (args.db,)
    result = {k: run(k, args.pg_url, args.processes, args.threads, args.seconds) for k in kinds}
    print(json.dumps(result, indent=1), file=sys.stderr)
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
