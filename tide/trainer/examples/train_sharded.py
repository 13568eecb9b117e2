"""The MLP of train_mlp.py trained the way a Paddle fleet script does: ``fleet.init`` with a
strategy, ``fleet.distributed_model`` and ``fleet.distributed_optimizer``, AdamW's state
sharded over the ranks (fleet's sharding stage 1), elastic under Tide (docs/sharded.md).

What Tide changes in such a script: the strategy comes from ``session.fleet_strategy()`` (the
data-parallel and sharding degrees are each generation's, by ``--sharding-degree-max``: 0, the
default, shards over the whole world), and ``session.step(loss)`` replaces
backward/step/clear_grad. Run it under ``python -m tide.trainer.launch`` or with Paddle's own
launcher; ``--hybrid=KEY:VALUE`` asks for a layout Tide refuses (tests).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import paddle
from paddle.distributed import fleet

from tide.trainer import ElasticSession
from tide.trainer.examples import step_gate
from tide.trainer.examples.train_mlp import build_model, make_dataset, parse_args, session_config


def main(argv: list[str] | None = None) -> int:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    extra = [a for a in argv if a.startswith("--hybrid=")]
    # "--sharding-degree-max=N": the cap of the degree rule (SessionConfig.sharding_degree_max).
    caps = [a for a in argv if a.startswith("--sharding-degree-max=")]
    args = parse_args([a for a in argv if a not in extra and a not in caps])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = session_config(args)
    if caps:
        config = dataclasses.replace(
            config, sharding_degree_max=int(caps[-1].removeprefix("--sharding-degree-max="))
        )
    session = ElasticSession.from_env(config)
    x_all, y_all = make_dataset(args.dataset_size, args.seed)
    paddle.seed(args.seed)
    net = build_model(args.hidden)
    lr = paddle.optimizer.lr.StepDecay(learning_rate=args.lr, step_size=50, gamma=0.5)
    optimizer: paddle.optimizer.Optimizer = paddle.optimizer.AdamW(
        learning_rate=lr, parameters=net.parameters(), weight_decay=0.01
    )

    def warmup() -> None:
        logits = net(paddle.to_tensor(x_all[:8]))
        paddle.nn.functional.cross_entropy(logits, paddle.to_tensor(y_all[:8])).backward()

    session.init_process_group(warmup=warmup)
    # Paddle's fleet API is untyped; the script uses it as documented.
    api: Any = fleet
    strategy: Any = api.DistributedStrategy()
    for item in extra:
        # "--hybrid=mp_degree:2": a layout of the script's own, for Tide to check.
        key, value = item.removeprefix("--hybrid=").split(":")
        strategy.hybrid_configs = {key: int(value)}
    api.init(is_collective=True, strategy=session.fleet_strategy(strategy))
    model: paddle.nn.Layer = net
    if session.world_size > 1:
        # Alone, fleet has no layout to wrap the model in (its pipeline wrapper asserts);
        # the optimizer's state is whole then.
        model = api.distributed_model(net)
        optimizer = api.distributed_optimizer(optimizer)
    session.attach(model, optimizer, lr)
    session.restore()
    for mb in session.plans():
        logits = model(paddle.to_tensor(x_all[mb.local_indices]))
        loss = paddle.nn.functional.cross_entropy(logits, paddle.to_tensor(y_all[mb.local_indices]))
        session.step(loss)
        if args.step_delay_s and mb.last:
            time.sleep(args.step_delay_s)
        if mb.last:
            step_gate.wait_past(args.test_step_gate, session.step_done)
    session.finish()
    if args.log_dir and session.rank == 0:
        params = {k: v.numpy() for k, v in net.state_dict().items()}
        np.savez(Path(args.log_dir) / "final_params.npz", **params)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
