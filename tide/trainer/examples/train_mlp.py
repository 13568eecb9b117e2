"""A small real Paddle model for tests, the demo and the benchmarks: an MLP classifier.

The data is generated from the seed (a fixed random teacher network labels Gaussian inputs), so
nothing is downloaded and every process sees the same dataset. Run it alone
(``python tide/trainer/examples/train_mlp.py --steps 20``) or under ``python -m tide.trainer.launch``.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import numpy as np
import paddle

from tide.trainer import CheckpointSettings, ElasticSession, SessionConfig
from tide.trainer.examples import step_gate

FEATURES = 32
CLASSES = 4


def make_dataset(size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.Generator(np.random.PCG64(seed + 1_000_003))
    x = rng.standard_normal((size, FEATURES)).astype(np.float32)
    teacher = rng.standard_normal((FEATURES, CLASSES)).astype(np.float32)
    y = np.argmax(np.tanh(x @ teacher) + 0.1 * rng.standard_normal((size, CLASSES)), axis=1)
    return x, y.astype(np.int64)


def build_model(hidden: int) -> paddle.nn.Layer:
    return paddle.nn.Sequential(
        paddle.nn.Linear(FEATURES, hidden),
        paddle.nn.Tanh(),
        paddle.nn.Linear(hidden, hidden),
        paddle.nn.Tanh(),
        paddle.nn.Linear(hidden, CLASSES),
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=60, help="global steps to train in total")
    p.add_argument("--dataset-size", type=int, default=1000)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--ckpt-dir", default="ckpt")
    p.add_argument("--ckpt-every-steps", type=int, default=0)
    p.add_argument("--ckpt-every-s", type=float, default=0.0)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--log-dir", default="", help="sample-id and loss logs, final parameters")
    p.add_argument("--step-delay-s", type=float, default=0.0, help="stand-in for heavier compute")
    step_gate.add_argument(p)
    return p.parse_args(argv)


def session_config(args: argparse.Namespace) -> SessionConfig:
    """The session's settings from this script's flags (bench/statesize_train.py's too)."""
    return SessionConfig(
        dataset_size=args.dataset_size,
        global_batch=args.global_batch,
        seed=args.seed,
        max_steps=args.steps,
        checkpoint_dir=args.ckpt_dir,
        checkpoint=CheckpointSettings(
            keep=args.keep, every_steps=args.ckpt_every_steps, every_s=args.ckpt_every_s
        ),
        log_dir=args.log_dir,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    session = ElasticSession.from_env(session_config(args))
    # Build before joining the group: group init waits for the slowest rank anyway.
    x_all, y_all = make_dataset(args.dataset_size, args.seed)
    paddle.seed(args.seed)
    model = build_model(args.hidden)
    lr = paddle.optimizer.lr.StepDecay(learning_rate=args.lr, step_size=50, gamma=0.5)
    optimizer = paddle.optimizer.Adam(learning_rate=lr, parameters=model.parameters())

    def warmup() -> None:
        logits = model(paddle.to_tensor(x_all[:8]))
        paddle.nn.functional.cross_entropy(logits, paddle.to_tensor(y_all[:8])).backward()

    # The canonical order (docs/trainer.md): group, attach, restore.
    session.init_process_group(warmup=warmup)
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
        params = {k: v.numpy() for k, v in model.state_dict().items()}
        np.savez(Path(args.log_dir) / "final_params.npz", **params)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
