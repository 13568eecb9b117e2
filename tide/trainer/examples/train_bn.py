"""A BatchNorm CNN trained the way a stock Paddle script does: a ``paddle.io.Dataset``, a
``paddle.io.DataLoader`` with worker processes, optionally ``paddle.DataParallel`` and AMP.

What Tide changes in such a script is the batch sampler (``session.batch_sampler()``), the
``session.step(loss)`` call in place of backward/step/clear_grad, and a few set-up lines
(docs/trainer.md shows the diff). With ``--virtual-ranks V`` the run is exact under resizes
even with BatchNorm: the global batch is cut into V micro-batches in any world, each with
its own BatchNorm statistics.

The images are made from the seed (a fixed random teacher labels them), so nothing is
downloaded. ``python tide/trainer/examples/train_bn.py --steps 20`` alone, or under the launcher.
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
from tide.trainer.examples import step_gate

CHANNELS, SIZE, CLASSES = 3, 8, 4


class SyntheticImages(paddle.io.Dataset[tuple[np.ndarray, np.int64, np.int64]]):
    """Gaussian images labelled by a fixed random linear teacher; item i is (x, y, i)."""

    def __init__(self, size: int, seed: int, augment: bool = False) -> None:
        self.augment = augment
        rng = np.random.Generator(np.random.PCG64(seed + 7_000_003))
        self.x = rng.standard_normal((size, CHANNELS, SIZE, SIZE)).astype(np.float32)
        teacher = rng.standard_normal((CHANNELS * SIZE * SIZE, CLASSES)).astype(np.float32)
        self.y = np.argmax(self.x.reshape(size, -1) @ teacher, axis=1).astype(np.int64)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.int64, np.int64]:
        x = self.x[i]
        if self.augment:
            # A random horizontal flip and a little noise, drawn from Paddle's global RNG
            # inside the loader (a worker process, or the loader's thread): the session
            # seeds it per sample, so it is the same in any world and any worker.
            if float(paddle.rand([1]).numpy()[0]) < 0.5:
                x = x[:, :, ::-1]
            x = x + 0.1 * paddle.randn(x.shape).numpy()
        return np.ascontiguousarray(x, dtype=np.float32), self.y[i], np.int64(i)

    def __len__(self) -> int:
        return len(self.x)


def build_model(width: int) -> paddle.nn.Layer:
    # No bias before a BatchNorm (as in ResNets): BatchNorm subtracts it again.
    return paddle.nn.Sequential(
        paddle.nn.Conv2D(CHANNELS, width, 3, padding=1, bias_attr=False),
        paddle.nn.BatchNorm2D(width),
        paddle.nn.ReLU(),
        paddle.nn.Conv2D(width, width, 3, padding=1, bias_attr=False),
        paddle.nn.BatchNorm2D(width),
        paddle.nn.ReLU(),
        paddle.nn.AdaptiveAvgPool2D(1),
        paddle.nn.Flatten(),
        paddle.nn.Linear(width, CLASSES),
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--dataset-size", type=int, default=512)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--virtual-ranks", type=int, default=0, help="0: plain data parallel")
    p.add_argument("--accumulation-steps", type=int, default=1)
    p.add_argument("--data-parallel", action="store_true", help="wrap in paddle.DataParallel")
    p.add_argument("--amp", action="store_true", help="paddle.amp with a GradScaler")
    p.add_argument("--loader-workers", type=int, default=0, help="DataLoader num_workers")
    p.add_argument("--augment", action="store_true", help="random flips and noise, Paddle RNG")
    p.add_argument("--ckpt-dir", default="ckpt")
    p.add_argument("--ckpt-every-steps", type=int, default=0)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--log-dir", default="")
    p.add_argument("--step-delay-s", type=float, default=0.0)
    step_gate.add_argument(p)
    # Two mistakes the session stops at step 1 (tests and bench/parity.py show it does).
    p.add_argument(
        "--forget-sampler",
        action="store_true",
        help="a plain DataLoader(shuffle=True) without session.batch_sampler()",
    )
    p.add_argument(
        "--summed-loss", action="store_true", help="sum / global batch, the API's older form"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    dataset = SyntheticImages(args.dataset_size, args.seed, args.augment)
    session = ElasticSession.from_env(
        SessionConfig(
            dataset_size=len(dataset),
            global_batch=args.global_batch,
            seed=args.seed,
            max_steps=args.steps,
            checkpoint_dir=args.ckpt_dir,
            checkpoint=CheckpointSettings(keep=args.keep, every_steps=args.ckpt_every_steps),
            log_dir=args.log_dir,
            virtual_ranks=args.virtual_ranks,
            accumulation_steps=args.accumulation_steps,
        )
    )
    paddle.seed(args.seed)
    net = build_model(args.width)
    lr = paddle.optimizer.lr.StepDecay(learning_rate=args.lr, step_size=40, gamma=0.5)
    optimizer = paddle.optimizer.Momentum(
        learning_rate=lr, momentum=0.9, parameters=net.parameters()
    )
    scaler = paddle.amp.GradScaler(enable=args.amp, init_loss_scaling=1024.0)

    def warmup() -> None:
        net.eval()  # a warm-up must not move BatchNorm's running statistics
        out = net(paddle.to_tensor(dataset.x[:1]))
        paddle.nn.functional.cross_entropy(out, paddle.to_tensor(dataset.y[:1])).backward()
        net.clear_gradients()
        net.train()

    session.init_process_group(warmup=warmup)
    model: Any = net
    if args.data_parallel and session.world_size > 1:
        # After the group (DataParallel needs it), before attach.
        model = paddle.DataParallel(net)
    session.attach(model, optimizer, lr, scaler)
    session.restore()
    loader = session.data_loader(dataset, num_workers=args.loader_workers)
    if args.forget_sampler:
        loader = paddle.io.DataLoader(
            dataset, batch_size=args.global_batch, shuffle=True, num_workers=args.loader_workers
        )
    for x, y, idx in loader:
        with paddle.amp.auto_cast(enable=args.amp):
            if args.summed_loss:
                loss = paddle.nn.functional.cross_entropy(model(x), y, reduction="sum")
                loss = loss / args.global_batch
            else:
                loss = paddle.nn.functional.cross_entropy(model(x), y)
        # The batch carries its sample ids: the session checks them against its plan.
        last = session.step(loss, indices=idx) is not None
        if args.step_delay_s and last:
            time.sleep(args.step_delay_s)
        if last:
            step_gate.wait_past(args.test_step_gate, session.step_done)
    session.finish()
    if args.log_dir and session.rank == 0:
        params = {k: v.numpy() for k, v in net.state_dict().items()}
        np.savez(Path(args.log_dir) / "final_params.npz", **params)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
