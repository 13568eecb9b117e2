"""One rank of tests/trainer/test_fused_sync.py: a fleet stage-1 job (plain Paddle, no
session) trained a few steps with fleet's per-tensor reduce and broadcast, then from the same
start with tide/trainer/fused_sync.py's bundled ones; each rank writes both runs' parameters
and how many of those collectives each run made."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.distributed import fleet

from tide.trainer import fused_sync, gloo_groups

STEPS = 3


def model() -> paddle.nn.Layer:
    paddle.seed(7)
    # Small tensors of two dtypes' worth of sizes, and one of 1 MiB that travels alone.
    return paddle.nn.Sequential(
        paddle.nn.Linear(16, 512),
        paddle.nn.LayerNorm(512),
        paddle.nn.Linear(512, 512),
        paddle.nn.ReLU(),
        paddle.nn.Linear(512, 3),
    )


def train(fused: bool, rank: int) -> tuple[list[np.ndarray], int]:
    net = model()
    # SGD: a rounding difference in a summed gradient stays that size (AdamW, early on,
    # would turn it into a full step: docs/sharded.md).
    opt = paddle.optimizer.SGD(0.01, parameters=net.parameters())
    net = fleet.distributed_model(net)
    opt = fleet.distributed_optimizer(opt)
    inner = opt._inner_opt
    if fused:
        fused_sync.install(inner)
        installed = inner.__dict__["reduce_gradients"], inner.__dict__["_sharding_sync_parameters"]
        fused_sync.install(inner)  # twice: a no-op, nothing wrapped again
        again = inner.__dict__["reduce_gradients"], inner.__dict__["_sharding_sync_parameters"]
        assert all(a is b for a, b in zip(installed, again, strict=True))
    calls = 0
    real_broadcast, real_reduce = dist.broadcast, dist.reduce

    def counting(real: Any) -> Any:
        def call(*a: object, **k: object) -> object:
            nonlocal calls
            calls += 1
            return real(*a, **k)

        return call

    dist.broadcast = counting(real_broadcast)
    dist.reduce = counting(real_reduce)
    try:
        rng = np.random.default_rng(rank)
        for _ in range(STEPS):
            x = paddle.to_tensor(rng.standard_normal((4, 16)).astype("float32"))
            loss = net(x).square().mean()
            loss.backward()
            opt.step()
            opt.clear_grad()
    finally:
        dist.broadcast, dist.reduce = real_broadcast, real_reduce
    return [p.numpy() for p in net.parameters()], calls


def main() -> int:
    out = Path(sys.argv[1])
    rank = int(os.environ["PADDLE_TRAINER_ID"])
    world = int(os.environ["PADDLE_TRAINERS_NUM"])
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {
        "dp_degree": 1,
        "mp_degree": 1,
        "pp_degree": 1,
        "sharding_degree": world,
    }
    # As the session does: Paddle 3.3's gloo hangs forming a second group over the whole
    # world at 3 ranks or more (tide/trainer/gloo_groups.py).
    dist.init_parallel_env()
    gloo_groups.share_world_context()
    fleet.init(is_collective=True, strategy=strategy)
    plain, plain_calls = train(False, rank)
    fused, fused_calls = train(True, rank)
    np.savez(out / f"plain-{rank}.npz", *plain)
    np.savez(out / f"fused-{rank}.npz", *fused)
    (out / f"calls-{rank}.json").write_text(
        json.dumps({"plain": plain_calls, "fused": fused_calls})
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
