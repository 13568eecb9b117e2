"""How often gloo groups over a subset of the ranks fail to form on the CPU, as Paddle forms
them and over a TCP store of their own (trainer/gloo_groups.py; docs/sharded.md).

    python -m bench.gloo_subgroups --tries 3

Each try starts 4 plain Paddle processes on loopback (no Tide session, no launcher):
``init_parallel_env()``, then the groups fleet forms for ``dp_degree`` 2 x
``sharding_degree`` 2 ([0, 1], [2, 3], [0, 2], [1, 3]) and one all-reduce on each of a
rank's two. ``plain`` is Paddle as it ships; ``own_store`` calls
:func:`trainer.gloo_groups.share_world_context` first, which forms each subgroup over a store
of its own. A try fails when any rank exits non-zero or is still running after
``--timeout-s``. The last line is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from services.testing.localjob import free_port, gloo_env

ROOT = Path(__file__).resolve().parents[1]

_RANK = """
import sys
import paddle
import paddle.distributed as dist
dist.init_parallel_env()
if sys.argv[1] == "own_store":
    from trainer.gloo_groups import share_world_context
    share_world_context()
rank = dist.get_rank()
specs = [[0, 1], [2, 3], [0, 2], [1, 3]]
groups = [dist.new_group(s) for s in specs]
for ranks, group in zip(specs, groups):
    if rank in ranks:
        t = paddle.to_tensor([float(rank)])
        dist.all_reduce(t, group=group)
        assert t.item() == sum(ranks), t.item()
"""


def one_try(mode: str, timeout_s: float) -> tuple[bool, float]:
    ports = [free_port() for _ in range(4)]
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, mode],
            cwd=ROOT,
            env={**os.environ, **gloo_env(rank, ports)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for rank in range(4)
    ]
    ok = True
    for p in procs:
        try:
            ok = p.wait(timeout=max(0.1, timeout_s - (time.monotonic() - started))) == 0 and ok
        except subprocess.TimeoutExpired:
            ok = False
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    return ok, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--tries", type=int, default=5)
    ap.add_argument("--timeout-s", type=float, default=40.0)
    args = ap.parse_args(argv)
    result: dict[str, object] = {"tries": args.tries, "world": 4}
    for mode in ("plain", "own_store"):
        fails, seconds = 0, []
        for _ in range(args.tries):
            ok, took = one_try(mode, args.timeout_s)
            fails += not ok
            if ok:
                seconds.append(took)
        print(f"{mode}: {fails}/{args.tries} failed", flush=True)
        result[f"{mode}_failed"] = fails
        if seconds:
            result[f"{mode}_median_s"] = round(sorted(seconds)[len(seconds) // 2], 2)
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
