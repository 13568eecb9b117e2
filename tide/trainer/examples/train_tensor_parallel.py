"""The MLP of train_mlp.py, one hidden layer, split over ``--mp-degree`` ranks by tensor
parallelism and elastic along its replicas under Tide (docs/sharded.md "Layouts").

Each replica is a whole tensor group: the first Linear is split by columns (each tensor rank
computes its share of the hidden units), the second by rows (each computes a partial sum of
the logits), and one all_reduce over the tensor group adds the partial sums (its backward
passes the gradient through unchanged to every share); the second Linear's bias, the same on
every tensor rank, is added after it. ``--tensor-parallel=hand`` (the default) does this by
hand over ``session.tensor_group``, with the layout stated in ``SessionConfig.model_parallel``:
the CPU's way, since fleet forms tensor groups on GPUs only. ``--tensor-parallel=fleet`` runs
the same model through fleet's ``ColumnParallelLinear``/``RowParallelLinear`` with the
strategy's ``mp_degree`` (scripts/gpu_check.py runs it on GPUs).

Every generation has W / mp_degree replicas; the session splits each global batch by replica
(every rank of one replica trains on the same samples) and sums gradients over each slice's
data-parallel group. The weights start from one seeded full matrix, cut by tensor rank, so
runs at any world start alike. With ``--log-dir`` the first replica's ranks save their slice's
final parameters and optimizer state (``final-slice-pp0-sep0-mp{k}.npz``; the parity test
compares every one with a fixed-size run's).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import paddle

from tide.trainer import ElasticSession
from tide.trainer.examples import step_gate
from tide.trainer.examples.train_mlp import (
    CLASSES,
    FEATURES,
    make_dataset,
    parse_args,
    session_config,
)
from tide.trainer.layout import ModelParallel


class SumOverGroup(paddle.autograd.PyLayer):
    """The row-parallel layer's partial sums added over the tensor group; every share's
    gradient is the sum's."""

    @staticmethod
    def forward(ctx: Any, partial: Any, group: Any) -> Any:
        import paddle.distributed as dist

        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return grad


def full_weights(hidden: int, seed: int) -> dict[str, np.ndarray]:
    """The unsplit model's weights, the same in every process and world."""
    rng = np.random.Generator(np.random.PCG64(seed + 7))
    return {
        "w1": (rng.standard_normal((FEATURES, hidden)) / np.sqrt(FEATURES)).astype(np.float32),
        "b1": (0.1 * rng.standard_normal(hidden)).astype(np.float32),
        "w2": (rng.standard_normal((hidden, CLASSES)) / np.sqrt(hidden)).astype(np.float32),
        "b2": (0.1 * rng.standard_normal(CLASSES)).astype(np.float32),
    }


def shard(full: dict[str, np.ndarray], mp_rank: int, mp_degree: int) -> dict[str, np.ndarray]:
    """Tensor rank ``mp_rank``'s share: w1 and b1 by columns, w2 by rows, b2 whole."""
    hidden = full["b1"].shape[0]
    if hidden % mp_degree:
        raise ValueError(f"--hidden {hidden} is not a multiple of --mp-degree {mp_degree}")
    n = hidden // mp_degree
    cols = slice(mp_rank * n, (mp_rank + 1) * n)
    return {
        "w1": full["w1"][:, cols],
        "b1": full["b1"][cols],
        "w2": full["w2"][cols],
        "b2": full["b2"],
    }


class HandTensorParallel(paddle.nn.Layer):
    """The split MLP, tensor parallelism by hand over ``group``."""

    def __init__(self, part: dict[str, np.ndarray], group: Any) -> None:
        super().__init__()
        self.group = group
        self.fc1 = paddle.nn.Linear(*part["w1"].shape)
        self.fc2 = paddle.nn.Linear(part["w2"].shape[0], CLASSES, bias_attr=False)
        self.bias2 = self.create_parameter([CLASSES], is_bias=True)
        self.fc1.weight.set_value(part["w1"])
        self.fc1.bias.set_value(part["b1"])
        self.fc2.weight.set_value(part["w2"])
        self.bias2.set_value(part["b2"])

    def forward(self, x: Any) -> Any:
        partial = self.fc2(paddle.tanh(self.fc1(x)))
        sum_over_group: Any = SumOverGroup
        return sum_over_group.apply(partial, self.group) + self.bias2


def build_fleet(part: dict[str, np.ndarray], hidden: int) -> paddle.nn.Layer:
    """The same model through fleet's tensor-parallel layers (GPUs only)."""
    import importlib

    # Paddle's fleet API is untyped; the layers are used as documented.
    mpu: Any = importlib.import_module("paddle.distributed.fleet.meta_parallel")

    class FleetTensorParallel(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = mpu.ColumnParallelLinear(FEATURES, hidden, gather_output=False)
            self.fc2 = mpu.RowParallelLinear(hidden, CLASSES, input_is_parallel=True)
            self.fc1.weight.set_value(part["w1"])
            self.fc1.bias.set_value(part["b1"])
            self.fc2.weight.set_value(part["w2"])
            self.fc2.bias.set_value(part["b2"])

        def forward(self, x: Any) -> Any:
            return self.fc2(paddle.tanh(self.fc1(x)))

    return FleetTensorParallel()


def final_state(net: paddle.nn.Layer, optimizer: Any) -> dict[str, np.ndarray]:
    """This rank's slice: parameters and optimizer slots by the model's structured names, the
    same by hand and through fleet (the hand model's second bias is saved as ``fc2.bias``,
    fleet's place for it), so that runs of both modes compare."""
    canonical = {"bias2": "fc2.bias"}
    names = {p.name: canonical.get(k, k) for k, p in net.named_parameters()}
    state = {f"param.{names[p.name]}": p.numpy() for p in net.parameters()}
    inner = getattr(optimizer, "_inner_opt", optimizer)
    for key, value in inner.state_dict().items():
        owner = max((n for n in names if key.startswith(n + "_")), key=len, default=None)
        if owner is not None and hasattr(value, "numpy"):
            state[f"opt.{names[owner]}{key[len(owner) :]}"] = value.numpy()
    return state


def take_flag(argv: list[str], name: str, default: str) -> tuple[str, list[str]]:
    values = [a.removeprefix(f"--{name}=") for a in argv if a.startswith(f"--{name}=")]
    return (values[-1] if values else default), [a for a in argv if not a.startswith(f"--{name}=")]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    mode, argv = take_flag(argv, "tensor-parallel", "hand")
    mp_text, argv = take_flag(argv, "mp-degree", "2")
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    mp_degree = int(mp_text)
    config = session_config(args)
    if mode == "hand":
        config = dataclasses.replace(config, model_parallel=ModelParallel(mp_degree=mp_degree))
    session = ElasticSession.from_env(config)
    x_all, y_all = make_dataset(args.dataset_size, args.seed)
    paddle.seed(args.seed)
    session.init_process_group()
    full = full_weights(args.hidden, args.seed)
    model: Any
    if mode == "fleet":
        from paddle.distributed import fleet

        api: Any = fleet
        strategy: Any = api.DistributedStrategy()
        strategy.hybrid_configs = {"mp_degree": mp_degree}
        api.init(is_collective=True, strategy=session.fleet_strategy(strategy))
        part = shard(full, session.layout.coord.mp, mp_degree)
        net = build_fleet(part, args.hidden)
    else:
        part = shard(full, session.layout.coord.mp, mp_degree)
        net = HandTensorParallel(part, session.tensor_group)
    lr = paddle.optimizer.lr.StepDecay(learning_rate=args.lr, step_size=50, gamma=0.5)
    optimizer: Any = paddle.optimizer.AdamW(
        learning_rate=lr, parameters=net.parameters(), weight_decay=0.01
    )
    model = net
    if mode == "fleet":
        model = api.distributed_model(net)
        optimizer = api.distributed_optimizer(optimizer)
    session.attach(model, optimizer, lr)
    session.restore()
    for mb in session.plans():
        logits = model(paddle.to_tensor(x_all[mb.local_indices]))
        loss = paddle.nn.functional.cross_entropy(logits, paddle.to_tensor(y_all[mb.local_indices]))
        session.step(loss)
        after_micro_batch(args, session, mb)
    return finish(args, session, net, optimizer)


def after_micro_batch(args: Any, session: ElasticSession, mb: Any) -> None:
    """The tests' pacing after a step's last micro-batch (``--step-delay-s``, the step gate)."""
    if args.step_delay_s and mb.last:
        time.sleep(args.step_delay_s)
    if mb.last:
        step_gate.wait_past(args.test_step_gate, session.step_done)


def finish(args: Any, session: ElasticSession, net: paddle.nn.Layer, optimizer: Any) -> int:
    """The session's end; with ``--log-dir`` the first replica's ranks save their slice."""
    session.finish()
    if args.log_dir and session.layout.writes_durable:
        out = Path(args.log_dir) / f"final-{session.layout.slice_name}.npz"
        np.savez(out, **final_state(net, optimizer))  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
