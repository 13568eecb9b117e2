"""Policy pass benchmark: the CPU of ScalerCore's pass over every job (``tick``), with
unchanged jobs answered from their last answer and with every job decided.

    python -m bench.tick [--quick] [--agents N] [--passes P]

One process, a fake clock, SQLite in a temporary directory, the in-memory actuator
and coordinator; bench.scale's fleet shape and policy (8 GPUs per agent, 4 agents
per job, bucket 2 s, sustain 4 s). Each simulated second every agent's report is
processed (``IngestEngine.process``), then the pass runs and its CPU time
(``time.process_time``) is taken; nothing else runs meanwhile. Phases, on the same
fleet one after the other:

1. ``steady``: every GPU at 50 % (bench.scale's jobs that do not resize): the
   windows' means do not move, and the pass answers every job from its last answer;
2. ``decide_all``: the same, with ``ScalerCore.reuse_answers`` off (the pass as it
   was: every job decided);
3. ``noisy``: every sample 40–60 % at random, so every window moves every second and
   no answer is reused: what comparing the inputs costs on top of deciding.

The last line is ``RESULT {json}``: per phase the median pass in ms and µs per job,
and the share of answers reused.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.ingest import _base, _varint
from bench.scale import NODES_PER_JOB

T0 = 1_800_000_000.0


async def run(agents: int, passes: int, db_dir: str) -> dict[str, Any]:
    from tide.v1 import telemetry_pb2

    from services.scaler.ingest import IngestSettings
    from services.scaler.policy import PolicySettings
    from services.scaler.service import ScalerCore
    from services.scaler.store import DecisionStore
    from services.store import db
    from services.testing.actuators import InMemoryActuator
    from services.testing.clock import FakeClock
    from services.testing.coordinator import InMemoryCoordinator, follow_actuator

    url = f"sqlite:///{Path(db_dir) / 'tick.db'}"
    db.upgrade(url)
    clock = FakeClock(T0)
    actuator, coordinator = InMemoryActuator(), InMemoryCoordinator()
    follow_actuator(coordinator, actuator)
    engine = db.make_engine(url)
    core = ScalerCore(
        store=DecisionStore(engine, "bench", clock),
        actuator=actuator,
        coordinator=coordinator,
        clock=clock,
        defaults=PolicySettings(
            bucket_s=2.0,
            sustain_s=4.0,
            cooldown_s=0.0,
            scale_down_stabilization_s=0.0,
            min_replicas=2,
            max_replicas=8,
        ),
        ingest=IngestSettings(stale_after_s=5.0),
    )
    await core.start()
    jobs = max(1, agents // NODES_PER_JOB)
    for j in range(jobs):
        await core.upsert_job(f"bench/j{j}", {}, gpus_per_replica=4)
    await asyncio.sleep(0.1)  # the members' watches deliver
    nodes = [(f"node-{i}", i // NODES_PER_JOB % jobs, i % NODES_PER_JOB) for i in range(agents)]
    steady = [_base(n, j, k, 50.0) for n, j, k in nodes]
    rng = random.Random(7)
    noisy = [[_base(n, j, k, rng.uniform(40.0, 60.0)) for _ in range(4)] for n, j, k in nodes]
    streams = [core.engine.open_stream() for _ in nodes]
    seq = [0]

    def second(reports: list[bytes]) -> None:
        clock.advance(1.0)
        seq[0] += 1
        t = clock.now()
        sec = int(t)
        ts = b"\x08" + _varint(sec) + b"\x10" + _varint(int((t - sec) * 1e9))
        tail = b"\x18" + _varint(seq[0]) + b"\x22" + _varint(len(ts)) + ts
        for st, base in zip(streams, reports, strict=True):
            core.engine.process(st, telemetry_pb2.NodeReport.FromString(base + tail))

    async def phase(pick: Any, reuse: bool) -> dict[str, float]:
        core.reuse_answers = reuse
        for _ in range(6):  # fill the window (4 s) before timing
            second(pick())
            await core.tick()
        cpu: list[float] = []
        reused0 = core.reused
        for _ in range(passes):
            second(pick())
            t0 = time.process_time()
            await core.tick()
            cpu.append(time.process_time() - t0)
        ms = statistics.median(cpu) * 1000
        return {
            "pass_ms": round(ms, 1),
            "us_per_job": round(ms * 1000 / jobs, 1),
            "reused_pct": round(100 * (core.reused - reused0) / (passes * jobs), 1),
        }

    out = {
        "steady": await phase(lambda: steady, True),
        "decide_all": await phase(lambda: steady, False),
        "noisy": await phase(lambda: [rng.choice(v) for v in noisy], True),
    }
    await core.close()
    engine.dispose()
    return {"agents": agents, "jobs": jobs, **out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tick", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="1,200 agents, 5 timed passes")
    ap.add_argument("--agents", type=int, default=0)
    ap.add_argument("--passes", type=int, default=0)
    args = ap.parse_args(argv)
    agents = args.agents or (1200 if args.quick else 5000)
    passes = args.passes or (5 if args.quick else 10)
    with tempfile.TemporaryDirectory() as d:
        res = asyncio.run(run(agents, passes, d))
    for name in ("steady", "decide_all", "noisy"):
        print(f"{name}: {json.dumps(res[name])}", flush=True)
    res["decide_all_over_steady"] = round(
        res["decide_all"]["pass_ms"] / max(1e-9, res["steady"]["pass_ms"]), 2
    )
    print("RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
