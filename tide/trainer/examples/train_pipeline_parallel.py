"""The MLP of train_mlp.py, one hidden layer, split into two pipeline stages by hand over gloo
and elastic along its replicas under Tide (docs/sharded.md "Pipeline-parallel jobs").

Each replica is a whole pipeline of two ranks, stated in ``SessionConfig.model_parallel =
ModelParallel(pp_degree=2)``: stage 0 runs the first Linear and the tanh, stage 1 the second
Linear and the loss. For each micro-batch stage 0 sends its activations to stage 1 with
``session.pipeline.send`` and calls ``session.step()``, which waits for the gradient of what
it sent and runs its backward from it; stage 1 takes them with ``session.pipeline.recv()``
and calls ``session.step(loss)``, which weighs the loss, runs its backward and sends the
input's gradient back (tide/trainer/pipeline.py). Both stages iterate the session's plans:
every rank of a replica trains on the same samples, and each step checks the batch on both.

With ``--mp-degree=N`` (default 1) each stage is split over N ranks by tensor parallelism as
in train_tensor_parallel.py (the first Linear by columns, the second by rows, one all_reduce
over the stage's tensor group): stage 0's tensor rank k sends its share of the hidden units to
stage 1's tensor rank k, so a replica is 2 x N ranks.

Every generation has W / (2 x N) replicas; the session sums each slice's gradients over the
ranks holding it, one per replica. The weights start from one seeded full model (the
tensor-parallel example's), cut by stage and tensor rank, so runs at any world start alike.
With ``--log-dir`` the first replica's ranks save their slice's final parameters and
optimizer state (``final-slice-pp{s}-sep0-mp{k}.npz``; the parity tests compare every one
with a fixed-size run's).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any

import numpy as np
import paddle

from tide.trainer import ElasticSession
from tide.trainer.examples.train_mlp import make_dataset, parse_args, session_config
from tide.trainer.examples.train_tensor_parallel import (
    SumOverGroup,
    after_micro_batch,
    finish,
    full_weights,
    shard,
    take_flag,
)
from tide.trainer.layout import ModelParallel

STAGES = 2


class FirstStage(paddle.nn.Layer):
    """The hidden layer (this tensor rank's columns of it): ``tanh(x @ w1 + b1)``."""

    def __init__(self, part: dict[str, np.ndarray]) -> None:
        super().__init__()
        self.fc1 = paddle.nn.Linear(*part["w1"].shape)
        self.fc1.weight.set_value(part["w1"])
        self.fc1.bias.set_value(part["b1"])

    def forward(self, x: Any) -> Any:
        return paddle.tanh(self.fc1(x))


class LastStage(paddle.nn.Layer):
    """The logits: ``h @ w2 + b2``, from this tensor rank's rows of ``w2`` and the partial
    sums added over ``group`` (None: one tensor rank). The bias is a parameter of its own,
    as in the tensor-parallel example, so that both save the same arrays."""

    def __init__(self, part: dict[str, np.ndarray], group: Any) -> None:
        super().__init__()
        self.group = group
        rows, classes = part["w2"].shape
        self.fc2 = paddle.nn.Linear(rows, classes, bias_attr=False)
        self.bias2 = self.create_parameter([part["b2"].shape[0]], is_bias=True)
        self.fc2.weight.set_value(part["w2"])
        self.bias2.set_value(part["b2"])

    def forward(self, h: Any) -> Any:
        partial = self.fc2(h)
        if self.group is not None:
            sum_over_group: Any = SumOverGroup
            partial = sum_over_group.apply(partial, self.group)
        return partial + self.bias2


def build_stage(
    stage: int, hidden: int, seed: int, mp_rank: int = 0, mp_degree: int = 1, group: Any = None
) -> paddle.nn.Layer:
    """Stage ``stage`` of the full model at tensor rank ``mp_rank``, with its share of the
    full model's weights (``group``: the stage's tensor group)."""
    part = shard(full_weights(hidden, seed), mp_rank, mp_degree)
    return FirstStage(part) if stage == 0 else LastStage(part, group)


def main(argv: list[str] | None = None) -> int:
    mp_text, rest = take_flag(sys.argv[1:] if argv is None else argv, "mp-degree", "1")
    args = parse_args(rest)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    mp_degree = int(mp_text)
    config = dataclasses.replace(
        session_config(args),
        model_parallel=ModelParallel(mp_degree=mp_degree, pp_degree=STAGES),
    )
    session = ElasticSession.from_env(config)
    x_all, y_all = make_dataset(args.dataset_size, args.seed)
    paddle.seed(args.seed)
    session.init_process_group()
    c = session.layout.coord
    net = build_stage(c.pp, args.hidden, args.seed, c.mp, mp_degree, session.tensor_group)
    lr = paddle.optimizer.lr.StepDecay(learning_rate=args.lr, step_size=50, gamma=0.5)
    optimizer = paddle.optimizer.AdamW(
        learning_rate=lr, parameters=net.parameters(), weight_decay=0.01
    )
    session.attach(net, optimizer, lr)
    session.restore()
    pipe = session.pipeline
    for mb in session.plans():
        if pipe.first:
            out = net(paddle.to_tensor(x_all[mb.local_indices]))
            pipe.send(out)
            session.step()
        else:
            logits = net(pipe.recv())
            labels = paddle.to_tensor(y_all[mb.local_indices])
            session.step(paddle.nn.functional.cross_entropy(logits, labels))
        after_micro_batch(args, session, mb)
    return finish(args, session, net, optimizer)


if __name__ == "__main__":
    raise SystemExit(main())
