"""A worker that dies at every start: how many generations the job forms before it is
FAILED, and how the restarts back off.

    python -m bench.crashloop            # 2 pods, restart budget 5
    python -m bench.crashloop --quick    # 2 pods, restart budget 3, shorter backoff

A real coordinator (in memory, its tick loop on the wall clock) and real launchers in
one process; each worker is tests/trainer/fake_worker.py, which restores and then
segfaults in its first step, as a broken kernel does in its first backward. The
baseline, in the same run and for as long as the limited run took, is the coordinator
without a limit (a budget nobody reaches, no backoff): the job re-forms as fast as its
workers can die. The last line is ``RESULT {json}``: crash_loop_generations (re-forms
after the first generation; at most crash_loop_budget), the start delay each generation's
RENDEZVOUS carried and the time between generations (seconds), whether the failure names
the worker's signal and its log's end, the worker logs left per pod, and the baseline's
generations in the same time.

bench/parity.py calls :func:`parity_keys` for its ``crash_loop_generations``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from tide.services.common.clock import SystemClock
from tide.services.common.config import CommonSettings
from tide.services.common.server import ServiceSpec, start_server
from tide.services.coordinator.domain import DirectiveKind
from tide.services.coordinator.engine import Coordinator
from tide.services.coordinator.servicer import SERVICE_NAME, CoordinatorServicer
from tide.services.coordinator.settings import Tuning
from tide.services.coordinator.store import MemoryStore
from tide.trainer.launcher import Launcher, LauncherSettings
from tide.trainer.launcher.logs import LOG_GLOB
from tide.v1 import coordinator_pb2 as pb
from tide.v1 import coordinator_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "trainer" / "fake_worker.py"
JOB = "bench/crashloop"
BASE = Tuning(heartbeat_timeout_s=10.0, heartbeat_interval_s=1.0, tick_interval_s=0.1)
QUICK = dataclasses.replace(
    BASE, restart_budget=3, restart_backoff_initial_s=0.25, restart_backoff_max_s=2.0
)
FULL = dataclasses.replace(
    BASE, restart_budget=5, restart_backoff_initial_s=0.25, restart_backoff_max_s=4.0
)
# The coordinator before the limit: it re-forms at once, forever.
UNLIMITED = dataclasses.replace(
    BASE,
    restart_budget=1_000_000,
    restart_backoff_initial_s=1e-3,
    restart_backoff_max_s=1e-3,
)
WORKER_LOGS_KEPT = 4


async def crash_loop(
    tuning: Tuning, workdir: Path, pods: int = 2, limit_s: float = 60.0
) -> dict[str, Any]:
    """Run the job until it is FAILED (or ``limit_s`` passes) and describe what happened."""
    coord = Coordinator(MemoryStore(), SystemClock(), tuning)
    coord.load()
    ticking = asyncio.create_task(coord.run())
    server = await start_server(
        CommonSettings(listen="127.0.0.1:0"),
        [
            ServiceSpec(
                pb_grpc.add_CoordinatorServicer_to_server, CoordinatorServicer(coord), SERVICE_NAME
            )
        ],
    )
    target = f"127.0.0.1:{server.port}"
    launchers = [_launcher(target, workdir / f"pod-{i}", i) for i in range(pods)]
    runs = [asyncio.create_task(launcher.run()) for launcher in launchers]
    channel = grpc.aio.insecure_channel(target)
    stub = pb_grpc.CoordinatorStub(channel)
    started = time.monotonic()
    st = pb.JobStatus()
    try:
        await _watch_until(stub, lambda s: len(s.members) >= pods, limit_s)
        resize = stub.Resize(
            pb.ResizeRequest(decision_id=1, job_id=JOB, target_world_size=pods, deadline_s=30.0)
        )
        async for _ in resize:
            pass
        st = await _watch_until(stub, lambda s: s.failed, limit_s - (time.monotonic() - started))
        wall_s = time.monotonic() - started
        rt = coord.jobs[JOB]
        created = [g.created_at for g in rt.generations.values()]
        # What each generation's RENDEZVOUS told its launchers to wait.
        told = {
            d.generation: d.rendezvous.start_delay_s
            for d in rt.directives.values()
            if d.rendezvous is not None and d.kind is DirectiveKind.RENDEZVOUS
        }
    finally:
        for launcher in launchers:
            launcher.stop()
        for run in runs:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(run, 10)
        await channel.close()
        await server.stop(0)
        ticking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticking
    return {
        "generations": len(created),
        "re_forms": len(created) - 1,
        "gaps_s": [round(b - a, 2) for a, b in itertools.pairwise(created)],
        "start_delays_s": [told[g] for g in sorted(told)],
        "failed": int(st.failed),
        "failure": st.failure,
        "wall_s": round(wall_s, 2),
    }


async def _watch_until(
    stub: pb_grpc.CoordinatorStub, done: Callable[[pb.JobStatus], bool], limit_s: float
) -> pb.JobStatus:
    """The job's status once ``done`` holds for it, or the last one seen at ``limit_s``."""
    last = pb.JobStatus()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(limit_s):
            while True:
                try:
                    watch: Any = stub.WatchJob(pb.GetJobStatusRequest(job_id=JOB))
                    async for st in watch:
                        last = pb.JobStatus()
                        last.CopyFrom(st)
                        if done(last):
                            return last
                except grpc.aio.AioRpcError as exc:
                    # No launcher has registered yet: the job is not known.
                    if exc.code() != grpc.StatusCode.NOT_FOUND:
                        raise
                await asyncio.sleep(0.05)
    return last


def _launcher(target: str, state_dir: Path, index: int) -> Launcher:
    return Launcher(
        LauncherSettings(
            coordinator=target,
            job_id=JOB,
            command=(sys.executable, str(WORKER)),
            pod_name=f"crashloop-{index}",
            pod_index=index,
            state_dir=str(state_dir),
            use_zygote=False,
            prewarm=False,
            exit_grace_s=0.5,
            worker_logs_kept=WORKER_LOGS_KEPT,
        )
    )


@contextlib.contextmanager
def worker_env() -> Iterator[None]:
    """The fake worker segfaults at its first step and imports tide.trainer.* from this tree;
    the environment is as it was afterwards (bench/parity.py runs real jobs next)."""
    saved = {k: os.environ.get(k) for k in ("FAKE_SEGFAULT_AT_FIRST_STEP", "PYTHONPATH")}
    os.environ["FAKE_SEGFAULT_AT_FIRST_STEP"] = "1"
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def measure(quick: bool, workdir: Path, baseline: bool = True) -> dict[str, Any]:
    with worker_env():
        return _measure(quick, workdir, baseline)


def _measure(quick: bool, workdir: Path, baseline: bool) -> dict[str, Any]:
    tuning = QUICK if quick else FULL
    limited = asyncio.run(crash_loop(tuning, workdir / "limited"))
    logs = [len(list(p.rglob(LOG_GLOB))) for p in (workdir / "limited").iterdir() if p.is_dir()]
    result: dict[str, Any] = {
        "crash_loop_generations": limited["re_forms"],
        "crash_loop_budget": tuning.restart_budget,
        "crash_loop_failed": limited["failed"],
        "crash_loop_start_delays_s": limited["start_delays_s"],
        "crash_loop_generation_gaps_s": limited["gaps_s"],
        "crash_loop_wall_s": limited["wall_s"],
        "crash_loop_worker_logs_max": max(logs, default=0),
        "crash_loop_worker_logs_kept": WORKER_LOGS_KEPT,
        "crash_loop_cause_reported": int(
            "SIGSEGV" in limited["failure"] and "Segmentation fault" in limited["failure"]
        ),
    }
    if baseline:
        free = asyncio.run(crash_loop(UNLIMITED, workdir / "unlimited", limit_s=limited["wall_s"]))
        result["crash_loop_unlimited_generations"] = free["re_forms"]
    result["crash_loop_targets_met"] = (
        result["crash_loop_failed"] == 1
        and result["crash_loop_generations"] <= tuning.restart_budget
        and result["crash_loop_cause_reported"] == 1
        and result["crash_loop_worker_logs_max"] <= WORKER_LOGS_KEPT
    )
    return result


def parity_keys(workdir: Path) -> dict[str, Any]:
    """What bench/parity.py reports of the crash loop (the quick run, no baseline)."""
    r = measure(True, workdir, baseline=False)
    keys = ("crash_loop_generations", "crash_loop_budget", "crash_loop_failed")
    return {k: r[k] for k in keys}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="restart budget 3, shorter backoff")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tide-crashloop-") as tmp:
        result = measure(args.quick, Path(tmp))
    print("RESULT " + json.dumps(result))
    return 0 if result["crash_loop_targets_met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
