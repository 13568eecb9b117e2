"""Policy pass benchmark: the CPU of ScalerCore's pass over every job (``tick``), with
unchanged jobs answered from their last answer and with every job decided.

    python -m bench.tick [--quick] [--agents N] [--passes P]

One process, a fake clock, SQLite in a temporary directory, the in-memory actuator
and coordinator; bench.scale's fleet shape and policy (8 GPUs per agent, 4 agents
per job, bucket 2 s, sustain 4 s). Each simulated second every agent's report is
processed (``Ingest.process``), then the pass runs and its CPU time
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

``tipping`` (``--tipping``, or after the three above; ``--only-tipping`` alone): issue
18's target "all 1,000 jobs on 2 s buckets decide within one bucket of their tipping
sample", in real time. One ScalerCore with its own loop (``ScalerCore.run``: the slot
triggers and the 1 s pass), SQLite (or PostgreSQL, ``--pg URL``: in a throw-away
schema, so that no run starts from the last run's jobs), 1,000 jobs
(``--jobs``) of 4 agents of 8 GPUs, each agent reporting once a second at its own
phase within the second, every report stamped with the second it was due (a report the
feeder delivers late counts its delay against the decision). Every GPU is at 50 %
(between the thresholds) until the flip, a known second after the windows are full,
then 95 %. A job's tipping sample is the first report after which its window, read
right after that report, meets the sustain condition (``policy.sustained``, the check
the core's triggers make): the bench checks after every report, the core only when a
slot opens, so the bench's tipping time is never later than the core's. Its decision is
committed when the core's observer sees it PENDING (written). Reported:
``tipping_within_bucket`` (the share of jobs decided within one bucket, 2 s, of their
tipping sample), ``tip_to_decision_p50_ms``/``p99_ms``/``max_ms`` and ``undecided``;
the RESULT line repeats ``tipping_within_bucket`` and the p99 (``tipping_p99_ms``) at
its top level.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.fleet import varint
from bench.history_seed import pg_schema
from bench.ingest import _base
from bench.scale import NODES_PER_JOB

T0 = 1_800_000_000.0


async def run(agents: int, passes: int, db_dir: str) -> dict[str, Any]:
    from tide.services.scaler.engine.core import ScalerCore
    from tide.services.scaler.ingest import IngestSettings
    from tide.services.scaler.policy import PolicySettings
    from tide.services.scaler.store import DecisionStore
    from tide.services.store import db
    from tide.services.testing.actuators import InMemoryActuator
    from tide.services.testing.clock import FakeClock
    from tide.services.testing.coordinator import InMemoryCoordinator, follow_actuator
    from tide.v1 import telemetry_pb2

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
    streams = [core.ingest.open_stream() for _ in nodes]
    seq = [0]

    def second(reports: list[bytes]) -> None:
        clock.advance(1.0)
        seq[0] += 1
        t = clock.now()
        sec = int(t)
        ts = b"\x08" + varint(sec) + b"\x10" + varint(int((t - sec) * 1e9))
        tail = b"\x18" + varint(seq[0]) + b"\x22" + varint(len(ts)) + ts
        for st, base in zip(streams, reports, strict=True):
            core.ingest.process(st, telemetry_pb2.NodeReport.FromString(base + tail))

    async def phase(pick: Any, reuse: bool) -> dict[str, float]:
        core.pipeline.reuse_answers = reuse
        for _ in range(6):  # fill the window (4 s) before timing
            second(pick())
            await core.tick()
        cpu: list[float] = []
        reused0 = core.pipeline.reused
        for _ in range(passes):
            second(pick())
            t0 = time.process_time()
            await core.tick()
            cpu.append(time.process_time() - t0)
        ms = statistics.median(cpu) * 1000
        return {
            "pass_ms": round(ms, 1),
            "us_per_job": round(ms * 1000 / jobs, 1),
            "reused_pct": round(100 * (core.pipeline.reused - reused0) / (passes * jobs), 1),
        }

    out = {
        "steady": await phase(lambda: steady, True),
        "decide_all": await phase(lambda: steady, False),
        "noisy": await phase(lambda: [rng.choice(v) for v in noisy], True),
    }
    await core.close()
    engine.dispose()
    return {"agents": agents, "jobs": jobs, **out}


TIP_BUCKET_S = 2.0
TIP_SUSTAIN_S = 4.0


async def run_tipping(
    jobs: int, url: str, flip_after_s: float, wait_s: float, spread_s: float
) -> dict[str, Any]:
    """The ``tipping`` phase (module docstring): real clock, the core's own loop."""
    from tide.services.common.clock import SystemClock
    from tide.services.scaler import policy as pol
    from tide.services.scaler.engine.core import ScalerCore
    from tide.services.scaler.ingest import IngestSettings
    from tide.services.scaler.store import DecisionStore
    from tide.services.scaler.tuning import tune_process
    from tide.services.store import db
    from tide.services.testing.actuators import InMemoryActuator
    from tide.services.testing.coordinator import InMemoryCoordinator, follow_actuator
    from tide.v1 import telemetry_pb2

    tune_process()  # as the scaler process does
    db.upgrade(url)
    clock = SystemClock()
    actuator, coordinator = InMemoryActuator(), InMemoryCoordinator()
    follow_actuator(coordinator, actuator)
    engine = db.make_engine(url)
    policy = pol.PolicySettings(
        bucket_s=TIP_BUCKET_S,
        sustain_s=TIP_SUSTAIN_S,
        cooldown_s=0.0,
        scale_down_stabilization_s=0.0,
        min_replicas=2,
        max_replicas=8,
    )
    store = DecisionStore(engine, "bench", clock)
    core = ScalerCore(
        store=store,
        actuator=actuator,
        coordinator=coordinator,
        clock=clock,
        defaults=policy,
        ingest=IngestSettings(stale_after_s=5.0),
    )
    await core.start()
    await store.warm_up()
    # bench.ingest._base's pods are j{job}-trainer-*, the in-memory coordinator's
    # members of bench/j{job}.
    job_ids = [f"bench/j{j}" for j in range(jobs)]
    for job_id in job_ids:
        await core.upsert_job(job_id, {}, gpus_per_replica=4)
    decided: dict[str, float] = {}

    def observe(d: Any, _detail: str) -> None:
        if d.state.name == "PENDING" and d.reason != "JOB_STARTED":
            decided.setdefault(d.job_id, clock.now())

    core.feed.observers.append(observe)
    loop_task = asyncio.create_task(core.run(), name="bench-core")
    # The jobs' start decisions complete (in-memory coordinator) before any sample.
    deadline = time.monotonic() + 60.0
    while any(core.active.get(j) for j in job_ids) and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    agents = jobs * NODES_PER_JOB
    nodes = [(f"tnode-{i}", i // NODES_PER_JOB, i % NODES_PER_JOB) for i in range(agents)]
    low = [_base(n, j, k, 50.0) for n, j, k in nodes]
    high = [_base(n, j, k, 95.0) for n, j, k in nodes]
    streams = [core.ingest.open_stream() for _ in nodes]
    phase = [i / agents for i in range(agents)]  # each agent's offset within the second
    start = math.ceil(clock.now()) + 1.0
    flip = start + flip_after_s
    # Job j flips spread_s * j / jobs after the first (0: all at once).
    flips = [flip + spread_s * j / jobs for j in range(jobs)]
    end = flip + spread_s + wait_s
    tipped: dict[str, float] = {}
    seq = [0] * agents
    feed_lag: list[float] = []
    checking = [True]

    async def slides() -> None:
        # Time alone slides a window too (its buckets end at the slot holding "now"):
        # a job may come to meet its condition at a slot boundary with no new sample,
        # and the 1 s pass then decides it. Each job's boundaries since the flip are
        # checked here, a little after they pass; a report of the slot that began
        # at the boundary and came in meanwhile can only make the job look tipped
        # earlier, so its latency longer.
        nxt: dict[str, float] = {}
        while checking[0]:
            now = clock.now()
            for j, job_id in enumerate(job_ids):
                if job_id in tipped or flips[j] > now:
                    continue
                w = core.ingest.windows.get(job_id)
                if w is None:
                    continue
                b = nxt.get(job_id)
                if b is None:
                    b = w.offset_s + math.ceil((flips[j] - w.offset_s) / w.slot_s) * w.slot_s
                while b <= now:
                    view = core.ingest.window_view(job_id, b, 0, 0)
                    if pol.sustained(view, core.policies[job_id]) > 0:
                        tipped[job_id] = b
                        break
                    b += w.slot_s
                nxt[job_id] = b
            await asyncio.sleep(0.05)

    slide_task = asyncio.create_task(slides(), name="bench-slides")
    second = start
    while second < end and len(decided) < jobs:
        for i, (_n, j, _k) in enumerate(nodes):
            due = second + phase[i]
            now = clock.now()
            if due > now:
                await asyncio.sleep(due - now)
            else:
                feed_lag.append(now - due)
            seq[i] += 1
            sec = int(due)
            ts = b"\x08" + varint(sec) + b"\x10" + varint(int((due - sec) * 1e9))
            tail = b"\x18" + varint(seq[i]) + b"\x22" + varint(len(ts)) + ts
            base = high[i] if due >= flips[j] else low[i]
            core.ingest.process(streams[i], telemetry_pb2.NodeReport.FromString(base + tail))
            job_id = job_ids[j]
            if due >= flips[j] and job_id not in tipped:
                view = core.ingest.window_view(job_id, due, 0, 0)
                if pol.sustained(view, core.policies[job_id]) > 0:
                    tipped[job_id] = due
        second += 1.0
    # The last reports' decisions: give them a bucket to land.
    await asyncio.sleep(TIP_BUCKET_S)
    checking[0] = False
    await slide_task
    # Why the undecided were not decided: their last answer's reason.
    why: dict[str, int] = {}
    for job_id in job_ids:
        if job_id in tipped and job_id not in decided:
            ev = core.evaluations.get(job_id)
            r = ev.decision.reason.name if ev is not None else "never evaluated"
            why[r] = why.get(r, 0) + 1
    loop_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await loop_task
    await core.close()
    engine.dispose()
    lat = sorted(decided[j] - tipped[j] for j in tipped if j in decided)
    early = [j for j in decided if j not in tipped or decided[j] < tipped[j]]
    within = sum(1 for x in lat if x <= TIP_BUCKET_S)
    lag = sorted(feed_lag) or [0.0]
    return {
        "jobs": jobs,
        "agents": agents,
        "tipped": len(tipped),
        "decided": len(lat),
        "undecided": len(tipped) - len(lat),
        "undecided_last_reason": why,
        "decided_before_tipping": len(early),
        "tipping_within_bucket": round(within / max(1, len(tipped)), 4),
        "tip_to_decision_p50_ms": round(_pct(lat, 0.5) * 1000, 1),
        "tip_to_decision_p99_ms": round(_pct(lat, 0.99) * 1000, 1),
        "tip_to_decision_max_ms": round((lat[-1] if lat else 0.0) * 1000, 1),
        "feed_lag_p99_ms": round(_pct(lag, 0.99) * 1000, 1),
        "bucket_s": TIP_BUCKET_S,
        "flips_spread_s": spread_s,
        "store": url.split(":", 1)[0],
    }


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tick", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="1,200 agents, 5 timed passes")
    ap.add_argument("--agents", type=int, default=0)
    ap.add_argument("--passes", type=int, default=0)
    ap.add_argument("--only-tipping", action="store_true", help="the tipping phase alone")
    ap.add_argument("--jobs", type=int, default=0, help="tipping phase: jobs (1,000; 250 quick)")
    ap.add_argument("--pg", default="", help="PostgreSQL URL for the tipping phase")
    ap.add_argument(
        "--spread",
        type=float,
        default=10.0,
        help="the tipping phase's jobs flip evenly over this many seconds (0: all at once)",
    )
    args = ap.parse_args(argv)
    agents = args.agents or (1200 if args.quick else 5000)
    passes = args.passes or (5 if args.quick else 10)
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        if not args.only_tipping:
            res = asyncio.run(run(agents, passes, d))
            for name in ("steady", "decide_all", "noisy"):
                print(f"{name}: {json.dumps(res[name])}", flush=True)
            res["decide_all_over_steady"] = round(
                res["decide_all"]["pass_ms"] / max(1e-9, res["steady"]["pass_ms"]), 2
            )
        # PostgreSQL: a throw-away schema. In the database itself the jobs of the last
        # run are still there, at the replicas they grew to: after a few runs they are
        # at their maximum, or their windows short of the GPUs they are expected to
        # have, and decide nothing (a run at 0 % that measured the previous runs).
        with (
            pg_schema(args.pg)
            if args.pg
            else contextlib.nullcontext(f"sqlite:///{Path(d) / 'tipping.db'}") as url
        ):
            # The windows fill (sustain 4 s, one bucket spare) before the flip; then
            # the jobs have a sustain and 10 s more to decide.
            jobs = args.jobs or (250 if args.quick else 1000)
            tipping = asyncio.run(run_tipping(jobs, url, 8.0, TIP_SUSTAIN_S + 10.0, args.spread))
    print(f"tipping: {json.dumps(tipping)}", flush=True)
    res["tipping"] = tipping
    # The figures, at the top: the share decided within one bucket, and the p99.
    res["tipping_within_bucket"] = tipping["tipping_within_bucket"]
    res["tipping_p99_ms"] = tipping["tip_to_decision_p99_ms"]
    print("RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
