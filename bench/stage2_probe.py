"""Does Paddle's sharding stage 2 (gradients sharded too) train on this machine's CPU?

Plain Paddle, no Tide: two processes on loopback with gloo (bench.gloo_groups' way),
``fleet.init(is_collective=True)``, a small MLP and AdamW, then each way of asking for stage 2
in turn, three steps each:

- ``api``: ``paddle.distributed.sharding.group_sharded_parallel(model, opt, level="os_g")``,
  the documented entry;
- ``direct``: ``GroupShardedOptimizerStage2`` and ``GroupShardedStage2`` built by hand with
  ``device="cpu"``;
- ``patched``: ``direct`` with the two device checks it meets patched away
  (``core.is_compiled_with_cuda`` true, ``paddle.get_device()`` "cpu:0"): whether anything
  past the checks would run on the CPU.

bench.hybrid runs it for ``stage2_rel_diff``'s reason (null while no way trains). Paddle 3.3.1
here: every way fails (docs/sharded.md "Stage 2").

    python -m bench.stage2_probe

The last line is ``RESULT {json}``: per way, ``trained`` or the first error rank 0 met.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tide.services.testing.localjob import gloo_env
from tide.services.testing.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("api", "direct", "patched")

_RANK = """
import json, sys
import numpy as np
import paddle
import paddle.distributed as dist
from paddle.distributed import fleet

paddle.set_device("cpu")
fleet.init(is_collective=True)
rank = dist.get_rank()


def attempt(way):
    paddle.seed(1)
    model = paddle.nn.Sequential(
        paddle.nn.Linear(8, 16), paddle.nn.ReLU(), paddle.nn.Linear(16, 4)
    )
    opt = paddle.optimizer.AdamW(learning_rate=0.01, parameters=model.parameters())
    if way == "api":
        from paddle.distributed.sharding import group_sharded_parallel

        model, opt, _ = group_sharded_parallel(model, opt, level="os_g")
    else:
        from paddle.distributed.fleet.meta_parallel.sharding import (
            group_sharded_optimizer_stage2 as o2,
        )
        from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_stage2 import (
            GroupShardedStage2,
        )

        saved = (o2.core.is_compiled_with_cuda, paddle.get_device)
        if way == "patched":
            o2.core.is_compiled_with_cuda = lambda: True
            paddle.get_device = lambda: "cpu:0"
        try:
            opt = o2.GroupShardedOptimizerStage2(
                params=opt._parameter_list, optim=opt, device="cpu"
            )
            model = GroupShardedStage2(model, opt, device="cpu")
        finally:
            o2.core.is_compiled_with_cuda, paddle.get_device = saved
    x = paddle.to_tensor(np.random.RandomState(rank).rand(4, 8).astype("float32"))
    for _ in range(3):
        model(x).mean().backward()
        opt.step()
        opt.clear_grad()


out = {}
for way in sys.argv[1].split(","):
    try:
        attempt(way)
        out[way] = "trained"
    except Exception as e:
        out[way] = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
print("STAGE2 " + json.dumps(out), flush=True)
"""


def probe(timeout_s: float = 120.0) -> dict[str, Any]:
    """Per way (:data:`WAYS`), ``"trained"`` or rank 0's first error; ``"hung"`` when a rank
    ran past ``timeout_s`` (a way that fails on one rank only can leave the other waiting)."""
    ports = [free_port() for _ in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, ",".join(WAYS)],
            cwd=ROOT,
            env={**os.environ, **gloo_env(rank, ports)},
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for rank in range(2)
    ]
    outs: list[str] = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout_s)[0])
    except subprocess.TimeoutExpired:
        return {way: "hung" for way in WAYS}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    lines = [ln for ln in outs[0].splitlines() if ln.startswith("STAGE2 ")]
    if not lines:
        return {way: f"rank 0 exited {procs[0].returncode} without an answer" for way in WAYS}
    found: dict[str, Any] = json.loads(lines[-1][len("STAGE2 ") :])
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout-s", type=float, default=120.0, help="per probe, both ranks")
    args = ap.parse_args(argv)
    result: dict[str, Any] = probe(args.timeout_s)
    result["trains_on_cpu"] = any(v == "trained" for v in result.values())
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
