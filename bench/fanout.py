"""A newcomers-only transfer against the broadcast over the whole group, at one size.

    python -m bench.fanout                  # 256 MB, 2 stayers + 2 newcomers, 3 rounds
    python -m bench.fanout --mb 1024 --rounds 2

Four plain Paddle gloo processes on loopback (no Tide session): ranks 0 and 1 hold the
state (stayers), 2 and 3 lack it (newcomers). Each round, in the same processes and in this
order: ``world``: tide/trainer/transfer.py's ``send_tensors`` without a fanout (a broadcast over
the whole group, stayer 1 dropping the bytes); ``one``: with a fanout of one sender (a group
of rank 0 and the newcomers); ``two``: two senders, a share each. Each is timed from a
barrier to a barrier after it (every rank done), the groups' formation included; every
newcomer checks its bytes. The last line is ``RESULT {json}``: the median seconds of each,
``one_over_world`` and ``two_over_world`` (ratios; below 1: faster than the broadcast).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tide.services.testing.localjob import ROOT, gloo_env
from tide.services.testing.ports import free_port

_RANK = """
import json, os, sys, time
import numpy as np, paddle.distributed as dist
from tide.trainer.gloo_groups import share_world_context
from tide.trainer.transfer import Fanout, send_tensors
dist.init_parallel_env()
share_world_context()
rank = dist.get_rank()
mb, rounds, out_path = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
nbytes = int(mb * 2**20)
keepers, newcomers = (0, 1), (2, 3)
mine = {"w": np.arange(nbytes // 4, dtype=np.float32)} if rank in keepers else None
want = np.arange(nbytes // 4, dtype=np.float32)
times = {"world": [], "one": [], "two": []}
for _ in range(rounds):
    for case, senders in (("world", 0), ("one", 1), ("two", 2)):
        fanout = Fanout(keepers, newcomers, 0, senders) if senders else None
        into = {"w": np.zeros(nbytes // 4, np.float32)} if rank in newcomers else None
        dist.barrier()
        t = time.monotonic()
        moved = send_tensors(mine, 0, rank, 64 * 2**20, rank in newcomers or rank == 0,
                             into=into, fanout=fanout)
        dist.barrier()
        times[case].append(time.monotonic() - t)
        if rank in newcomers:
            assert moved.intact and np.array_equal(moved.arrays["w"], want), case
with open(out_path + f".{rank}", "w") as f:
    json.dump(times, f)
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=256.0, help="state size, MB")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tide-fanout-"))
    script = work / "rank.py"
    script.write_text(_RANK)
    ports = [free_port() for _ in range(4)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(args.mb), str(args.rounds), str(work / "times")],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": f"{ROOT}", **gloo_env(r, ports)},
        )
        for r in range(4)
    ]
    codes = [p.wait(timeout=600) for p in procs]
    if any(codes):
        raise SystemExit(f"ranks exited {codes}; scripts in {work}")
    per_rank = [json.loads((work / f"times.{r}").read_text()) for r in range(4)]
    median = {}
    for case in ("world", "one", "two"):
        worst = sorted(max(r[case][i] for r in per_rank) for i in range(args.rounds))
        median[case] = round(worst[len(worst) // 2], 3)
    result = {
        "mb": args.mb,
        "rounds": args.rounds,
        "median_s": median,
        "one_over_world": round(median["one"] / median["world"], 2),
        "two_over_world": round(median["two"] / median["world"], 2),
        "loadavg": round(os.getloadavg()[0], 2),
    }
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
