"""A gloo group of plain processes on loopback: one script run as every rank."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tide.services.testing.localjob import ROOT, gloo_env
from tide.services.testing.ports import free_port
from tide.trainer import template


def run_ranks(script: str, workdir: Path, world: int, timeout_s: float = 120.0) -> None:
    """Run ``script workdir`` as ranks 0..world-1 of one gloo group (each rank's output in
    ``workdir/rank<N>.log``); fail with their logs' tails unless every rank exits 0."""
    ports = [free_port() for _ in range(world)]
    procs = []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": f"{ROOT}", **gloo_env(rank, ports)}
        with open(workdir / f"rank{rank}.log", "wb") as log:
            procs.append(
                template.popen(
                    [sys.executable, script, str(workdir)],
                    cwd=str(ROOT),
                    env=env,
                    stdout=log,
                    stderr=log,
                )
            )
    codes = [p.wait(timeout=timeout_s) for p in procs]
    logs = "\n".join((workdir / f"rank{r}.log").read_text()[-2000:] for r in range(world))
    assert codes == [0] * world, logs
