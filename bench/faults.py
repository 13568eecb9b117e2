"""Resizes with the store failed in each phase, and health through a store outage (issue 30).

    python -m bench.faults --quick       # 3 phases x 2 faults on SQLite; 5 s outages
    python -m bench.faults               # the same on memory and SQLite; 20 s outages

Part 1, in process (a fake clock and fake launchers, tests/coordinator/
test_store_faults.py's scenarios): resize 2 -> 3 with the store failing in
WAITING_FOR_MEMBERS, CHECKPOINTING and RENDEZVOUS, once or for longer than the retry
budget. A resize counts as truthfully ended when it COMPLETED, or ended with a message
that names no restart (none happened); a false reason is a message that names one.

Part 2, real processes over a private PostgreSQL (tests/support/pgserver.py): the
coordinator and the scaler, kept busy with writes, answer liveness every 50 ms; the
p99 with the store up is the baseline of the same run, then PostgreSQL is stopped hard.

The last line is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

# The services this bench starts listen on loopback only, without TLS (as the tests').
os.environ.setdefault("TIDE_INSECURE", "1")

from tests.coordinator.fakes import FakeLauncher
from tests.coordinator.support import JOB, close_env, make_env
from tests.coordinator.test_store_faults import FAULTS, SCENARIOS
from tests.reliability.test_loop_lag import HealthSampler, _service
from tests.reliability.test_store_outage import hot_agent
from tests.support.pgserver import private_postgres
from tests.support.poll import wait_for
from tide.services.common.clock import SystemClock
from tide.services.coordinator.sql_store import SqlStore
from tide.services.coordinator.store import CoordinatorStore, MemoryStore
from tide.services.store import db
from tide.services.testing.clock import FakeClock
from tide.services.testing.flaky_store import FlakyStore
from tide.v1 import scaler_pb2, scaler_pb2_grpc


async def resizes(stores: list[str]) -> dict[str, Any]:
    tried = truthful = false_reasons = lost = 0
    outcomes: list[str] = []
    for kind_of_store in stores:
        for phase, scenario in SCENARIOS.items():
            for fault in FAULTS:
                with tempfile.TemporaryDirectory() as tmp:
                    engine = None
                    inner: CoordinatorStore
                    if kind_of_store == "memory":
                        inner = MemoryStore()
                    else:
                        url = f"sqlite:///{Path(tmp) / 'coord.db'}"
                        db.upgrade(url)
                        engine = db.make_engine(url)
                        inner = SqlStore(db.make_session_factory(engine), FakeClock().now)
                    store = FlakyStore(inner)
                    env = await make_env(store)
                    tried += 1
                    try:
                        final = await scenario(env, store, fault)
                        restart_named = "restart" in final.message
                        false_reasons += restart_named
                        truthful += not restart_named
                        lost += (await env.status()).lost_steps_total
                        outcomes.append(f"{kind_of_store}/{phase}/{fault}: {final.phase}")
                    except Exception as exc:  # an unfinished resize is counted, not fatal
                        outcomes.append(f"{kind_of_store}/{phase}/{fault}: error {exc!r}")
                    finally:
                        await close_env(env)
                        if engine is not None:
                            engine.dispose()
    print("\n".join(outcomes), file=sys.stderr)
    return {
        "resizes_tried": tried,
        "resizes_completed_or_truthfully_ended": truthful,
        "false_reasons": false_reasons,
        "lost_steps": lost,
    }


def _p99_ms(sampler: HealthSampler) -> float:
    xs = sorted(sampler.latencies_s)
    return round(xs[int(0.99 * (len(xs) - 1))] * 1000, 2) if xs else float("nan")


async def coordinator_health(outage_s: float) -> dict[str, float]:
    with private_postgres() as pg:
        coord = _service(
            "-m",
            "tide.services.coordinator",
            "--listen",
            "127.0.0.1:0",
            "--db",
            pg.url,
            "--heartbeat-timeout-s",
            "60",
            "--tick-interval-s",
            "0.2",
        )
        launchers = [FakeLauncher(coord.target, SystemClock(), JOB, i) for i in range(2)]
        try:
            for fl in launchers:
                await fl.join()

            async def busy(seconds: float) -> None:
                end, n = time.monotonic() + seconds, len(launchers)
                while time.monotonic() < end:
                    for fl in launchers:
                        with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
                            await asyncio.wait_for(fl.heartbeat(), 3.0)
                    newcomer = FakeLauncher(coord.target, SystemClock(), JOB, n)
                    with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
                        await asyncio.wait_for(newcomer.register(), 3.0)
                    await newcomer.close()
                    n += 1
                    await asyncio.sleep(0.2)

            with HealthSampler(coord.target) as up:
                await busy(min(outage_s, 5.0))
            with HealthSampler(coord.target) as down:
                pg.stop_hard()
                await busy(outage_s)
            return {
                "coordinator_health_p99_ms_store_up": _p99_ms(up),
                "coordinator_health_p99_ms_during_outage": _p99_ms(down),
            }
        finally:
            for fl in launchers:
                await fl.close()
            coord.kill()


def scaler_health(outage_s: float) -> dict[str, float]:
    with private_postgres() as pg:
        scaler = _service(
            "-m",
            "tide.services.testing.scaler",
            "--coordinator",
            "memory",
            "--actuator",
            "memory",
            "--db",
            pg.url,
            "--listen",
            "127.0.0.1:0",
        )
        ch = grpc.insecure_channel(scaler.target)
        stub = scaler_pb2_grpc.ScalerStub(ch)
        agent = None
        try:
            stub.UpsertJob(
                scaler_pb2.UpsertJobRequest(
                    job_id=JOB,
                    initial_replicas=2,
                    policy=scaler_pb2.Policy(
                        min_replicas=1, max_replicas=4, bucket_s=1.0, sustain_s=2.0
                    ),
                ),
                timeout=10,
            )
            wait_for(
                lambda: (
                    stub.GetJob(scaler_pb2.GetJobRequest(job_id=JOB), timeout=10).current_replicas
                    > 0
                ),
                timeout_s=30,
                what="the job's start",
            )

            def busy(seconds: float) -> None:
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    with contextlib.suppress(grpc.RpcError):
                        stub.RequestResize(
                            scaler_pb2.RequestResizeRequest(
                                job_id=JOB, replicas=2, reason="bench", requested_by="bench"
                            ),
                            timeout=3,
                        )
                    time.sleep(0.2)

            with HealthSampler(scaler.target) as up:
                busy(min(outage_s, 5.0))
            with HealthSampler(scaler.target) as down:
                pg.stop_hard()
                agent = hot_agent(scaler.target, ["uid-lag-0", "uid-lag-1"])
                busy(outage_s)
            return {
                "scaler_health_p99_ms_store_up": _p99_ms(up),
                "scaler_health_p99_ms_during_outage": _p99_ms(down),
            }
        finally:
            if agent is not None:
                agent.kill()
                agent.wait(timeout=10)
            ch.close()
            scaler.kill()


async def main_async(quick: bool) -> dict[str, Any]:
    result: dict[str, Any] = {"quick": quick}
    result.update(await resizes(["sqlite"] if quick else ["memory", "sqlite"]))
    outage_s = 5.0 if quick else 20.0
    result["outage_s"] = outage_s
    result.update(await coordinator_health(outage_s))
    result.update(await asyncio.to_thread(scaler_health, outage_s))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="SQLite only, 5 s outages")
    args = ap.parse_args(argv)
    result = asyncio.run(main_async(args.quick))
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
