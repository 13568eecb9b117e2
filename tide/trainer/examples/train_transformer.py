"""A small transformer encoder (token classification of synthetic sequences) with dropout,
an LR warm-up schedule, gradient accumulation and optional AMP, fed by a DataLoader.

Dropout draws random masks: in the plain mode they depend on how the batch is split among
the ranks, so a resized run is the same run only in distribution. With ``--virtual-ranks V``
each of the V micro-batches draws from its own RNG stream, seeded from (seed, step, virtual
rank), and the run is exact across resizes (docs/trainer.md, "When to use which").

``--sharded``: the same model trained the way a Paddle fleet script does, AdamW's state
sharded over the ranks (fleet's sharding stage 1, docs/sharded.md); with
``--sharding-degree-max N`` each generation shards over at most N ranks and replicates
data-parallel over the rest. bench/hybrid.py resizes it.

``python tide/trainer/examples/train_transformer.py --steps 20`` alone, or under the launcher.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import paddle

from tide.trainer import CheckpointSettings, ElasticSession, SessionConfig

VOCAB, LENGTH, CLASSES = 64, 16, 4


class SyntheticSequences(paddle.io.Dataset[tuple[np.ndarray, np.int64]]):
    """Random token sequences; the label is which quarter of the vocabulary is most common."""

    def __init__(self, size: int, seed: int) -> None:
        rng = np.random.Generator(np.random.PCG64(seed + 9_000_011))
        self.x = rng.integers(0, VOCAB, (size, LENGTH)).astype(np.int64)
        counts = np.stack([(self.x // (VOCAB // CLASSES) == c).sum(1) for c in range(CLASSES)])
        self.y = np.argmax(counts, axis=0).astype(np.int64)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.int64]:
        return self.x[i], self.y[i]

    def __len__(self) -> int:
        return len(self.x)


class Classifier(paddle.nn.Layer):
    def __init__(
        self, d_model: int, layers: int, dropout: float, attention_bias: bool = True
    ) -> None:
        super().__init__()
        self.embed = paddle.nn.Embedding(VOCAB, d_model)
        self.pos = paddle.create_parameter([1, LENGTH, d_model], "float32")
        layer = paddle.nn.TransformerEncoderLayer(
            d_model,
            nhead=2,
            dim_feedforward=2 * d_model,
            dropout=dropout,
            # (attention's, feed-forward's): False drops the attention's biases.
            bias_attr=None if attention_bias else [False, paddle.ParamAttr()],
        )
        self.encoder = paddle.nn.TransformerEncoder(layer, layers)
        self.head = paddle.nn.Linear(d_model, CLASSES)

    def forward(self, tokens: paddle.Tensor) -> paddle.Tensor:
        h = self.encoder(self.embed(tokens) + self.pos)
        out: paddle.Tensor = self.head(h.mean(axis=1))
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--dataset-size", type=int, default=512)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--virtual-ranks", type=int, default=0)
    p.add_argument("--accumulation-steps", type=int, default=1)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--loader-workers", type=int, default=0)
    p.add_argument("--ckpt-dir", default="ckpt")
    p.add_argument("--ckpt-every-steps", type=int, default=0)
    p.add_argument("--log-dir", default="")
    p.add_argument("--sharded", action="store_true", help="fleet sharding stage 1")
    p.add_argument(
        "--sharding-degree-max",
        type=int,
        default=0,
        help="with --sharded: cap the sharding degree, data parallel over the rest (0: none)",
    )
    # The keys' bias has no gradient (softmax ignores a shift of every key) but rounding:
    # AdamW turns that into full-size steps, which differ with the summation order, so
    # parity checks of every parameter drop the attention's biases (as Llama has none).
    p.add_argument("--no-attention-bias", action="store_true")
    p.add_argument("--step-delay-s", type=float, default=0.0, help="stand-in for heavier compute")
    args = p.parse_args(argv)
    if args.sharded and args.amp:
        p.error("--sharded with --amp: this example shards a float32 AdamW only")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    dataset = SyntheticSequences(args.dataset_size, args.seed)
    session = ElasticSession.from_env(
        SessionConfig(
            dataset_size=len(dataset),
            global_batch=args.global_batch,
            seed=args.seed,
            max_steps=args.steps,
            checkpoint_dir=args.ckpt_dir,
            checkpoint=CheckpointSettings(every_steps=args.ckpt_every_steps),
            log_dir=args.log_dir,
            virtual_ranks=args.virtual_ranks,
            accumulation_steps=args.accumulation_steps,
            sharding_degree_max=args.sharding_degree_max,
        )
    )
    paddle.seed(args.seed)
    model = Classifier(args.d_model, args.layers, args.dropout, not args.no_attention_bias)
    lr = paddle.optimizer.lr.LinearWarmup(
        paddle.optimizer.lr.CosineAnnealingDecay(1e-3, T_max=max(args.steps, 1)),
        warmup_steps=10,
        start_lr=0.0,
        end_lr=1e-3,
    )
    optimizer = paddle.optimizer.AdamW(learning_rate=lr, parameters=model.parameters())
    scaler = paddle.amp.GradScaler(enable=args.amp)
    session.init_process_group()
    net: paddle.nn.Layer = model
    if args.sharded:
        from paddle.distributed import fleet

        api: Any = fleet  # Paddle's fleet API is untyped; used as documented
        api.init(is_collective=True, strategy=session.fleet_strategy())
        if session.world_size > 1:
            # Alone, fleet has no layout to wrap the model in; the state is whole then.
            net = api.distributed_model(model)
            optimizer = api.distributed_optimizer(optimizer)
    session.attach(net, optimizer, lr, scaler)
    session.restore()
    loader = session.data_loader(dataset, num_workers=args.loader_workers)
    for tokens, labels in loader:
        with paddle.amp.auto_cast(enable=args.amp):
            loss = paddle.nn.functional.cross_entropy(net(tokens), labels)
        session.step(loss)
        if args.step_delay_s:
            time.sleep(args.step_delay_s)
    session.finish()
    if args.log_dir and session.rank == 0:
        params = {k: v.numpy() for k, v in model.state_dict().items()}
        np.savez(Path(args.log_dir) / "final_params.npz", **params)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
