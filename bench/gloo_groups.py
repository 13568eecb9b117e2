"""How often a CPU job's extra gloo groups fail to form, as Paddle ships and with Tide's
handling (tide/trainer/gloo_groups.py; docs/sharded.md).

    python -m bench.gloo_groups                     # groups over the world, worlds 3 and 4
    python -m bench.gloo_groups --tries 6           # quicker
    python -m bench.gloo_groups --case subgroups    # dp 2 x sharding 2's groups of 2 in 4

Each try starts ``world`` plain Paddle processes on loopback (no Tide session, no launcher),
``init_parallel_env()``, then per ``--case``:

- ``world``: ``fleet.init`` with the optimizer sharded over the world (two more gloo groups
  over every rank), then one all-reduce over the sharding group;
- ``subgroups`` (world 4): the groups fleet forms for ``dp_degree`` 2 x ``sharding_degree`` 2
  ([0, 1], [2, 3], [0, 2], [1, 3]) and one all-reduce on each of a rank's two.

``plain`` is Paddle as it ships; ``shared`` calls
:func:`tide.trainer.gloo_groups.share_world_context` after ``init_parallel_env`` (groups over the
world reuse its context; smaller ones form over a store of their own). A try fails when any
rank exits non-zero or is still running after ``--timeout-s``. The last line is
``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tide.services.testing.localjob import gloo_env
from tide.services.testing.ports import free_port

ROOT = Path(__file__).resolve().parents[1]

# The per-rank programs; argv[1] is "shared" or "plain".
_SETUP = """
import sys
import paddle
import paddle.distributed as dist
from paddle.distributed import fleet
dist.init_parallel_env()
if sys.argv[1] == "shared":
    from tide.trainer.gloo_groups import share_world_context
    share_world_context()
"""
_CASES = {
    "world": """
world = dist.get_world_size()
strategy = fleet.DistributedStrategy()
strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1,
                           "sharding_degree": world}
fleet.init(is_collective=True, strategy=strategy)
t = paddle.to_tensor([float(dist.get_rank())])
dist.all_reduce(t, group=fleet.get_hybrid_communicate_group().get_sharding_parallel_group())
assert t.item() == sum(range(world)), t.item()
""",
    "subgroups": """
rank = dist.get_rank()
specs = [[0, 1], [2, 3], [0, 2], [1, 3]]
groups = [dist.new_group(s) for s in specs]
for ranks, group in zip(specs, groups):
    if rank in ranks:
        t = paddle.to_tensor([float(rank)])
        dist.all_reduce(t, group=group)
        assert t.item() == sum(ranks), t.item()
""",
}


def one_try(case: str, mode: str, world: int, timeout_s: float) -> tuple[bool, float]:
    ports = [free_port() for _ in range(world)]
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SETUP + _CASES[case], mode],
            cwd=ROOT,
            env={**os.environ, **gloo_env(rank, ports)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for rank in range(world)
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tries", type=int, default=20)
    ap.add_argument("--case", choices=sorted(_CASES), default="world")
    ap.add_argument("--worlds", default="3,4", help="world sizes (--case world; subgroups: 4)")
    ap.add_argument("--timeout-s", type=float, default=40.0)
    args = ap.parse_args(argv)
    result: dict[str, object] = {"tries": args.tries, "case": args.case}
    worlds = [4] if args.case == "subgroups" else [int(w) for w in args.worlds.split(",")]
    for world in worlds:
        for mode in ("plain", "shared"):
            # Interleaved per try would be fairer to load, but a failed plain try hangs its
            # ranks until the timeout; in blocks, the counts are what matters.
            fails, seconds = 0, []
            for _ in range(args.tries):
                ok, took = one_try(args.case, mode, world, args.timeout_s)
                fails += not ok
                if ok:
                    seconds.append(took)
            print(f"world {world} {mode}: {fails}/{args.tries} failed", flush=True)
            result[f"w{world}_{mode}_failed"] = fails
            if seconds:
                result[f"w{world}_{mode}_median_s"] = round(sorted(seconds)[len(seconds) // 2], 2)
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
