"""History benchmark: a large store, then the CLI and the store's API against it.

    python -m bench.history [--quick] [--pg URL | --sqlite] [--decisions N]

Seeds a store of ``--decisions`` decisions (1,000,000; ``--quick`` 100,000: a
million rows take minutes to write into PostgreSQL on this 2-core machine, which
CI cannot spare) over 90 days and 1,000 jobs, one of them busy with 20,000
decisions (the issue's "busy job over 90 days"), a few with a decision still
running. Rows go in by COPY on PostgreSQL (executemany on SQLite), each decision
with one event (its final state), in a private schema dropped afterwards. Then,
each timed as a fresh process where the CLI is concerned:

- ``history_first_page_s``: ``tide history BUSY --db URL --since 90d`` (the
  default first page of 100, a plain table as in a pipe);
- ``history_full_table_s`` / ``history_full_csv_s``: the same with ``--all``,
  ``rows`` of them;
- ``history_100k_table_s``: ``tide history HUGE --db URL --all``, a job of
  100,000 decisions seeded besides the others (``rows_100k``);
- ``jobs_s``: ``tide jobs --db URL`` with 1,000 jobs;
- the same through the Scaler API (``..._grpc_s``): the real ScalerCore
  and ScalerServicer on the store, served on 127.0.0.1 from a thread of this
  process, and ``tide ... --scaler``: the everyday path, which imports no
  SQLAlchemy;
- ``version_s``: ``tide --version`` beside ``python_s`` (the interpreter alone)
  and ``import_sqlalchemy_s`` (what the lazy store import spares it);
- ``startup_s``: a ScalerCore (in-memory coordinator and actuator) starting on
  the store: its jobs taken in batches, their last resize read, open decisions
  resumed;
- ``decision_p50_ms``/``decision_p99_ms`` on the busy job (the store's part of
  a decision: create, with the exclusivity check, then its transitions), and
  ``list_page_p99_ms`` (a ListDecisions page, keyset).

Baselines measured in the same run, where they mean something:
``exclusivity_not_in_ms`` (the check as it was, ``state NOT IN (final)``, which
no index serves) against ``exclusivity_index_ms`` (the partial index);
``jobs_per_job_queries_s`` (the old ``tide jobs --db``: a check per job)
against ``jobs_two_queries_s``; ``startup_per_job_s`` (two transactions per job)
against the batched start; ``rich_table_s`` against ``plain_table_s`` (the same
``RENDER_ROWS`` rows drawn by rich, as every table was, and by the plain
renderer). The last line is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.history_seed import (
    BUSY,
    BUSY_DECISIONS,
    DAYS,
    DEFAULT_PG,
    HUGE,
    INPUTS,
    JOBS,
    NOW,
    pg_schema,
    seed,
)

RENDER_ROWS = 2000
ROOT = Path(__file__).resolve().parents[1]


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))]


# --- the CLI -------------------------------------------------------------------------------


def _cli(*args: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "tide.services.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"tide {' '.join(args)} exited {proc.returncode}: {proc.stderr}")
    return took, proc.stdout


def _best(n: int, fn: Callable[[], float]) -> float:
    """The median of ``n`` runs (the machine is shared; the median is what one sees)."""
    return statistics.median(fn() for _ in range(n))


def _bare(*args: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, check=True)
    return time.perf_counter() - t0


def measure_cli(url: str, runs: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["history_first_page_s"] = _best(
        runs, lambda: _cli("history", BUSY, "--db", url, "--since", f"{DAYS + 1}d")[0]
    )
    took, text = _cli("history", BUSY, "--db", url, "--since", f"{DAYS + 1}d", "--all")
    out["rows"] = len(text.splitlines()) - 1
    out["history_full_table_s"] = statistics.median(
        [took]
        + [
            _cli("history", BUSY, "--db", url, "--since", f"{DAYS + 1}d", "--all")[0]
            for _ in range(runs - 1)
        ]
    )
    out["history_full_csv_s"] = _best(
        runs,
        lambda: _cli("history", BUSY, "--db", url, "--since", f"{DAYS + 1}d", "--all", "-o", "csv")[
            0
        ],
    )
    took, text = _cli("history", HUGE, "--db", url, "--since", f"{DAYS + 1}d", "--all")
    out["rows_100k"] = len(text.splitlines()) - 1
    out["history_100k_table_s"] = statistics.median(
        [took]
        + [
            _cli("history", HUGE, "--db", url, "--since", f"{DAYS + 1}d", "--all")[0]
            for _ in range(runs - 1)
        ]
    )
    took, text = _cli("jobs", "--db", url)
    out["jobs_rows"] = len(text.splitlines()) - 1
    out["jobs_s"] = statistics.median(
        [took] + [_cli("jobs", "--db", url)[0] for _ in range(runs - 1)]
    )
    out["version_s"] = _best(runs, lambda: _cli("--version")[0])
    out["help_s"] = _best(runs, lambda: _cli("--help")[0])
    out["python_s"] = _best(runs, lambda: _bare("-c", "pass"))
    out["import_sqlalchemy_s"] = _best(runs, lambda: _bare("-c", "import sqlalchemy.orm"))
    return out


@contextmanager
def scaler_api(url: str) -> Iterator[str]:
    """The real scaler's API over ``url`` (in-memory coordinator and actuator), served
    from a thread with its own event loop; yields its address."""
    import threading

    from tide.services.common.clock import SystemClock
    from tide.services.common.config import CommonSettings
    from tide.services.common.server import ServiceSpec, start_server
    from tide.services.scaler.engine.core import ScalerCore
    from tide.services.scaler.servicer import RULES, ScalerServicer
    from tide.services.scaler.store import DecisionStore
    from tide.services.store import db
    from tide.services.testing.actuators import InMemoryActuator
    from tide.services.testing.coordinator import InMemoryCoordinator
    from tide.v1 import scaler_pb2_grpc

    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop = asyncio.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        engine = db.make_engine(url)
        store = DecisionStore(engine, "bench-api", SystemClock())
        core = ScalerCore(
            store=store,
            actuator=InMemoryActuator(),
            coordinator=InMemoryCoordinator(),
            clock=SystemClock(),
        )
        try:
            await core.start()
            server = await start_server(
                CommonSettings(listen="127.0.0.1:0", insecure=True),
                [
                    ServiceSpec(
                        scaler_pb2_grpc.add_ScalerServicer_to_server,
                        ScalerServicer(core),
                        "tide.v1.Scaler",
                    )
                ],
                rules=RULES,
            )
            box["port"] = server.port
            ready.set()
            await stop.wait()
            await server.stop(0)
        except BaseException as exc:
            box["error"] = exc
            ready.set()
            raise
        finally:
            await core.close()
            engine.dispose()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    ready.wait(120)
    if "port" not in box:
        raise SystemExit(f"the scaler did not start: {box.get('error')}")
    try:
        yield f"127.0.0.1:{box['port']}"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(60)


def measure_api(url: str, runs: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    since = f"{DAYS + 1}d"
    with scaler_api(url) as target:
        out["history_first_page_grpc_s"] = _best(
            runs, lambda: _cli("history", BUSY, "--scaler", target, "--since", since)[0]
        )
        out["history_full_table_grpc_s"] = _best(
            runs, lambda: _cli("history", BUSY, "--scaler", target, "--since", since, "--all")[0]
        )
        out["history_100k_table_grpc_s"] = _best(
            runs, lambda: _cli("history", HUGE, "--scaler", target, "--since", since, "--all")[0]
        )
        out["jobs_grpc_s"] = _best(runs, lambda: _cli("jobs", "--scaler", target)[0])
    return out


def measure_render() -> dict[str, float]:
    """The same rows drawn by rich (every table on a terminal, before) and plain."""
    from rich.console import Console
    from rich.table import Table

    from tide.services.cli import render
    from tide.services.cli.output import plain_table
    from tide.v1 import common_pb2, scaler_pb2

    decisions = [
        scaler_pb2.Decision(
            id=i, job_id=BUSY, from_replicas=2, to_replicas=4,
            reason=common_pb2.DECISION_REASON_SUSTAINED_HIGH_UTILIZATION,
            trigger=common_pb2.DECISION_TRIGGER_POLICY,
            state=common_pb2.DECISION_STATE_COMPLETED,
            message="sustained_high_utilization: 2 -> 4", pause_s=2.5,
        )
        for i in range(RENDER_ROWS)
    ]  # fmt: skip
    headers, rows = render.history_rows(decisions)
    t0 = time.perf_counter()
    t = Table(show_edge=False)
    for h in headers:
        t.add_column(h)
    for r in rows:
        t.add_row(*r)
    Console(file=io.StringIO(), width=200, force_terminal=True).print(t)
    rich_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    plain_table(headers, rows, no_headers=False)
    return {"rich_table_s": rich_s, "plain_table_s": time.perf_counter() - t0}


# --- the store's API and the scaler ----------------------------------------------------------


def measure_queries(url: str) -> dict[str, float]:
    from sqlalchemy import select

    from tide.services.scaler import store as repo
    from tide.services.store import db
    from tide.services.store.models.scaler import Decision

    engine = db.make_engine(url)
    factory = db.make_session_factory(engine)
    finals = ["COMPLETED", "ABORTED", "FAILED"]
    out: dict[str, float] = {}
    try:
        with db.session_scope(factory, write=False) as s:

            def old_check(job: str) -> Any:
                return s.scalars(
                    select(Decision)
                    .where(Decision.job_id == job, Decision.state.not_in(finals))
                    .order_by(Decision.created_at.desc(), Decision.id.desc())
                    .limit(1)
                ).first()

            for name, fn in (
                ("exclusivity_not_in_ms", lambda: old_check(BUSY)),
                ("exclusivity_index_ms", lambda: repo.active_decision(s, BUSY)),
            ):
                fn()
                times = []
                for _ in range(20):
                    t0 = time.perf_counter()
                    fn()
                    times.append((time.perf_counter() - t0) * 1000)
                out[name] = statistics.median(times)
            jobs = repo.list_jobs(s)
            t0 = time.perf_counter()
            for j in jobs:
                old_check(j.job_id)
            out["jobs_per_job_queries_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            repo.list_jobs(s)
            repo.active_decisions(s)
            out["jobs_two_queries_s"] = time.perf_counter() - t0
            pages = []
            token = ""
            for _ in range(20):
                t0 = time.perf_counter()
                page = repo.list_decisions(s, job_id=BUSY, page_size=500, page_token=token)
                pages.append((time.perf_counter() - t0) * 1000)
                token = page.next_page_token
            out["list_page_p50_ms"] = statistics.median(pages)
            out["list_page_p99_ms"] = _percentile(pages, 0.99)
    finally:
        engine.dispose()
    return out


async def measure_scaler(url: str, decisions: int) -> dict[str, Any]:
    from tide.services.scaler import store as repo
    from tide.services.scaler.engine.core import ScalerCore
    from tide.services.scaler.store import DecisionState, DecisionStore
    from tide.services.store import db
    from tide.services.testing.actuators import InMemoryActuator
    from tide.services.testing.clock import FakeClock
    from tide.services.testing.coordinator import InMemoryCoordinator

    out: dict[str, Any] = {}
    engine = db.make_engine(url)
    clock = FakeClock(NOW.timestamp())
    try:
        # The old start: two transactions per job.
        store = DecisionStore(engine, "bench-old", clock)
        t0 = time.perf_counter()
        for job in await store.list_jobs():
            await store.acquire(job.job_id)
            await store.last_completed(job.job_id)
        await store.non_final()
        out["startup_per_job_s"] = time.perf_counter() - t0

        store = DecisionStore(engine, "bench", clock)
        core = ScalerCore(
            store=store, actuator=InMemoryActuator(), coordinator=InMemoryCoordinator(), clock=clock
        )
        t0 = time.perf_counter()
        await core.start()
        out["startup_s"] = time.perf_counter() - t0
        await core.close()

        async def lives(job: str, n: int) -> list[float]:
            times = []
            for _ in range(n):
                clock.advance(60.0)
                t0 = time.perf_counter()
                d = await store.create(
                    job_id=job,
                    from_replicas=4,
                    to_replicas=5,
                    reason="SUSTAINED_HIGH_UTILIZATION",
                    trigger="POLICY",
                    message="bench",
                    inputs=json.loads(INPUTS),
                )
                times.append((time.perf_counter() - t0) * 1000)
                for st in (DecisionState.PREPARING, DecisionState.ACTUATING):
                    d = await store.transition(d, st, st.value)
                await store.transition(
                    d, DecisionState.COMPLETED, "done", pause_s=1.0, generation=d.id
                )
            return times

        # A job of its own with no history: the same path without the 20,000 rows.
        fresh = "bench/fresh"
        with db.session_scope(store.factory) as s:
            repo.upsert_job(s, fresh, min_replicas=1, max_replicas=64, now=NOW)
        await store.acquire(fresh)
        await lives(BUSY, 3)  # warm the statements
        busy = await lives(BUSY, 60)
        empty = await lives(fresh, 60)
        out["decision_p50_ms"] = statistics.median(busy)
        out["decision_p99_ms"] = _percentile(busy, 0.99)
        out["decision_p99_ms_fresh_job"] = _percentile(empty, 0.99)
        out["busy_job_decisions"] = BUSY_DECISIONS
        out["store_decisions"] = decisions
    finally:
        engine.dispose()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="100,000 decisions, one run each")
    ap.add_argument("--pg", default=os.environ.get("TIDE_TEST_PG_URL", DEFAULT_PG))
    ap.add_argument("--sqlite", action="store_true", help="a SQLite file instead of PostgreSQL")
    ap.add_argument("--decisions", type=int, default=0)
    args = ap.parse_args()
    total = args.decisions or (100_000 if args.quick else 1_000_000)
    runs = 1 if args.quick else 3
    result: dict[str, Any] = {"decisions": total, "jobs": JOBS + 1, "quick": args.quick}

    def run(url: str) -> None:
        result["seed_s"] = seed(url, total)
        print(f"seeded {total} decisions over {JOBS} jobs in {result['seed_s']:.1f} s", flush=True)
        result.update(measure_queries(url))
        result.update(asyncio.run(measure_scaler(url, total)))
        result.update(measure_cli(url, runs))
        result.update(measure_api(url, runs))
        result.update(measure_render())

    if args.sqlite:
        result["store"] = "sqlite"
        with tempfile.TemporaryDirectory() as d:
            run(f"sqlite:///{Path(d) / 'tide.db'}")
    else:
        result["store"] = "postgresql"
        with pg_schema(args.pg) as url:
            run(url)
    for k, v in list(result.items()):
        if isinstance(v, float):
            result[k] = round(v, 4)
        print(f"  {k:<28} {result[k]}")
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
