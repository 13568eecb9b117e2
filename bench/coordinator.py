"""How much the coordinator itself adds to a resize, and how many heartbeats it takes.

    python -m bench.coordinator                  # 16 members: in memory, then SQLite
    python -m bench.coordinator --quick          # 8 members, 1 s of heartbeats
    python -m bench.coordinator --db pg          # PostgreSQL (a schema of its own) instead

Server and fake launchers share one process and event loop (so one core): the
figures are an upper bound of the coordinator's own cost. The in-memory store runs
first as the baseline: the difference is what the database adds. The last line is
``RESULT {json}`` with one entry per store (register_ms, heartbeats_per_s,
resize_to_all_checkpoint_ms, last_ack_to_all_rendezvous_ms, commit_p50_ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import sqlalchemy as sa

from tests.coordinator.fakes import FakeLauncher, ResizeWatch
from tests.support.pg import with_search_path
from tests.support.poll import eventually
from tide.services.common.clock import SystemClock
from tide.services.common.config import CommonSettings
from tide.services.common.server import ServiceSpec, start_server
from tide.services.coordinator.engine import Coordinator
from tide.services.coordinator.servicer import SERVICE_NAME, CoordinatorServicer
from tide.services.coordinator.settings import Tuning
from tide.services.coordinator.sql_store import SqlStore
from tide.services.coordinator.store import CoordinatorStore, MemoryStore
from tide.services.store import db
from tide.v1 import coordinator_pb2 as pb
from tide.v1 import coordinator_pb2_grpc as pb_grpc

JOB = "bench/job"
K = pb.Directive.Kind


async def run(members: int, url: str, heartbeat_s: float) -> dict[str, Any]:
    clock = SystemClock()
    engine: sa.Engine | None = None
    store: CoordinatorStore
    if url == "memory":
        store = MemoryStore()
    else:
        db.upgrade(url)
        engine = db.make_engine(url)
        store = SqlStore(db.make_session_factory(engine), clock.now)
    coord = Coordinator(store, clock, Tuning(heartbeat_timeout_s=60, heartbeat_interval_s=5))
    coord.load()
    server = await start_server(
        CommonSettings(listen="127.0.0.1:0"),
        [
            ServiceSpec(
                pb_grpc.add_CoordinatorServicer_to_server,
                CoordinatorServicer(coord),
                SERVICE_NAME,
            )
        ],
    )
    target = f"127.0.0.1:{server.port}"
    channel = grpc.aio.insecure_channel(target)
    stub = pb_grpc.CoordinatorStub(channel)
    ls = [FakeLauncher(target, clock, JOB, i) for i in range(members + 1)]
    try:
        t0 = time.perf_counter()
        for fl in ls:
            await fl.join()
        register_s = (time.perf_counter() - t0) / len(ls)
        w = ResizeWatch(stub, JOB, 1, members, deadline_s=60)
        await eventually(lambda: all(fl.generation == 1 for fl in ls[:members]), 60)
        for fl in ls[:members]:
            await fl.heartbeat()
        await w.final(60)

        # Heartbeats: every launcher beats as fast as it can for heartbeat_s seconds.
        stop = time.perf_counter() + heartbeat_s
        counts = [0] * members

        async def beat(i: int) -> None:
            while time.perf_counter() < stop:
                await ls[i].heartbeat()
                counts[i] += 1

        await asyncio.gather(*(beat(i) for i in range(members)))
        hb_rate = sum(counts) / heartbeat_s

        # Grow by one: how long the coordinator's part of the pause takes.
        ack_times: list[float] = []

        def timed(fl: FakeLauncher) -> None:
            orig = fl.ack

            async def timed_ack(d: pb.Directive, **fields: object) -> None:
                await orig(d, **fields)
                if d.kind == K.KIND_CHECKPOINT:
                    ack_times.append(time.perf_counter())

            fl.ack = timed_ack  # type: ignore[method-assign]

        for fl in ls[:members]:
            timed(fl)
        t_resize = time.perf_counter()
        w = ResizeWatch(stub, JOB, 2, members + 1, deadline_s=60)
        await eventually(lambda: all(K.KIND_CHECKPOINT in fl.kinds() for fl in ls[:members]), 60)
        t_ck = time.perf_counter()
        await eventually(lambda: all(fl.generation == 2 for fl in ls), 60)
        t_rdv = time.perf_counter()
        acks_done = max(ack_times[:members]) if ack_times else t_ck
        for fl in ls:
            await fl.heartbeat()
        final = await w.final(60)
        result = {
            "db": url.split(":")[0],
            "members": members,
            "register_ms": round(register_s * 1e3, 2),
            "heartbeats_per_s": round(hb_rate),
            "resize_to_all_checkpoint_ms": round(1e3 * (t_ck - t_resize), 1),
            "last_ack_to_all_rendezvous_ms": round(1e3 * (t_rdv - acks_done), 1),
            "phase": pb.ResizePhase.Name(final.phase),
            "commit_p50_ms": round(1e3 * _p50(coord), 3),
        }
        print(" ".join(f"{k}={v}" for k, v in result.items()), flush=True)
        return result
    finally:
        for fl in ls:
            await fl.close()
        await channel.close()
        await server.stop(0)
        if engine is not None:
            engine.dispose()


def _p50(coord: Coordinator) -> float:
    # Histogram buckets do not give a median; re-time a few commits of the job row instead.
    rt = coord.jobs[JOB]
    samples = []
    for _ in range(50):
        rt.outbox.touch_job()
        t = time.perf_counter()
        rt.outbox.commit()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def _pg(members: int, heartbeat_s: float) -> dict[str, Any]:
    # A schema of its own: tide_test is shared with everyone else's tests.
    base = "postgresql+psycopg://postgres@127.0.0.1:5432/tide_test"
    schema = f"coord_bench_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    try:
        url = with_search_path(base, schema)
        return asyncio.run(run(members, url, heartbeat_s))
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--members", type=int, default=0, help="default 16, 8 with --quick")
    p.add_argument("--db", choices=["sqlite", "pg"], default="sqlite")
    p.add_argument("--heartbeat-s", type=float, default=0.0, help="default 3, 1 with --quick")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    members = args.members or (8 if args.quick else 16)
    heartbeat_s = args.heartbeat_s or (1.0 if args.quick else 3.0)
    results = [asyncio.run(run(members, "memory", heartbeat_s))]
    if args.db == "pg":
        results.append(_pg(members, heartbeat_s))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            url = f"sqlite:///{Path(tmp) / 'bench.db'}"
            results.append(asyncio.run(run(members, url, heartbeat_s)))
    print("RESULT " + json.dumps({r["db"]: r for r in results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
