"""A data-parallel Paddle script: an MLP on synthetic points, fed by a DataLoader.

train_dp_stock.py is the stock script (``python -m paddle.distributed.launch --nnodes 2
train_dp_stock.py``); train_dp_tide.py is the same script under Tide; docs/migrate.md shows
the diff (tests/trainer/test_migrate_docs.py).
"""

import argparse

import numpy as np
import paddle
import paddle.nn.functional as F

from tide.trainer import ElasticSession, SessionConfig


class Points(paddle.io.Dataset[tuple[np.ndarray, np.int64]]):
    def __init__(self, size: int) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(size, 8)).astype(np.float32)
        self.y = (self.x.sum(1) > 0).astype(np.int64)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.int64]:
        return self.x[i], self.y[i]

    def __len__(self) -> int:
        return len(self.x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--ckpt-dir", default="ckpt")
    cli = p.parse_args()
    paddle.seed(0)
    dataset = Points(256)
    session = ElasticSession.from_env(SessionConfig(
        dataset_size=len(dataset), global_batch=16 * 2, seed=0,
        max_steps=cli.epochs * 8, checkpoint_dir=cli.ckpt_dir))  # fmt: skip
    net = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.ReLU(), paddle.nn.Linear(16, 2))
    session.init_process_group()
    model = paddle.DataParallel(net)
    lr = paddle.optimizer.lr.CosineAnnealingDecay(0.1, T_max=cli.epochs * 8)
    optimizer = paddle.optimizer.Momentum(learning_rate=lr, parameters=model.parameters())
    session.attach(model, optimizer, lr)
    session.restore()
    for x, y in session.data_loader(dataset):
        loss = F.cross_entropy(model(x), y)
        session.step(loss)
    session.finish()


if __name__ == "__main__":
    main()
