"""The store's part of one decision's life: create, PREPARING, ACTUATING, COMPLETED.

    python -m bench.lifecycle [--sqlite] [--pg URL] [--decisions N]

One job, ``--decisions`` lives one after the other through ``DecisionStore`` (its
worker threads, its transactions), on PostgreSQL (a throw-away schema) or SQLite.
Reported: ``life_p50_ms``/``life_p99_ms`` (wall, a whole life), ``transition_p50_ms``
(one transition) and ``cpu_ms_per_life`` (the process's CPU, every thread, per life:
what the lifecycle costs a busy replica). The before/after of a change to the store
is this same command run on both trees, alternately, in one session (docs/scaler.md,
"Measured"). The last line is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.history_seed import DEFAULT_PG, pg_schema

WARM = 10


async def run(url: str, n: int) -> dict[str, Any]:
    from tide.services.scaler import store as repo
    from tide.services.scaler.store import DecisionState, DecisionStore
    from tide.services.store import db
    from tide.services.testing.clock import FakeClock

    db.upgrade(url)
    engine = db.make_engine(url)
    clock = FakeClock(1_800_000_000.0)
    store = DecisionStore(engine, "bench-lifecycle", clock)
    with db.session_scope(store.factory) as s:
        now = datetime.fromtimestamp(clock.now(), UTC)
        repo.upsert_job(s, "bench/life", min_replicas=1, max_replicas=64, now=now)
    await store.acquire("bench/life")
    lives: list[float] = []
    steps: list[float] = []
    cpu0 = 0.0
    for i in range(n + WARM):
        if i == WARM:
            cpu0 = time.process_time()
        clock.advance(60.0)
        t0 = time.perf_counter()
        d = await store.create(
            job_id="bench/life",
            from_replicas=4,
            to_replicas=5,
            reason="SUSTAINED_HIGH_UTILIZATION",
            trigger="POLICY",
            message="bench",
            inputs={"window": {"mean_pct": 92.0}},
        )
        t1 = time.perf_counter()
        for st in (DecisionState.PREPARING, DecisionState.ACTUATING):
            d = await store.transition(d, st, st.value)
        await store.transition(d, DecisionState.COMPLETED, "done", pause_s=1.0, generation=d.id)
        t2 = time.perf_counter()
        if i >= WARM:
            lives.append((t2 - t0) * 1000)
            steps.append((t2 - t1) * 1000 / 3)
    cpu_ms = (time.process_time() - cpu0) * 1000 / n
    store.close()
    engine.dispose()
    lives.sort()
    return {
        "decisions": n,
        "life_p50_ms": round(statistics.median(lives), 2),
        "life_p99_ms": round(lives[min(len(lives) - 1, int(0.99 * len(lives)))], 2),
        "transition_p50_ms": round(statistics.median(steps), 2),
        "cpu_ms_per_life": round(cpu_ms, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pg", default=os.environ.get("TIDE_TEST_PG_URL", DEFAULT_PG))
    ap.add_argument("--sqlite", action="store_true", help="a SQLite file instead of PostgreSQL")
    ap.add_argument("--decisions", type=int, default=300)
    args = ap.parse_args()
    if args.sqlite:
        with tempfile.TemporaryDirectory() as d:
            res = asyncio.run(run(f"sqlite:///{Path(d) / 'life.db'}", args.decisions))
        res["store"] = "sqlite"
    else:
        with pg_schema(args.pg) as url:
            res = asyncio.run(run(url, args.decisions))
        res["store"] = "postgresql"
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
