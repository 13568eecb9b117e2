"""A data-parallel Paddle script: an MLP on synthetic points, fed by a DataLoader.

train_dp_stock.py is the stock script (``python -m paddle.distributed.launch --nnodes 2
train_dp_stock.py``); train_dp_tide.py is the same script under Tide; docs/migrate.md shows
the diff (tests/trainer/test_migrate_docs.py).
"""

import argparse

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F


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
    dist.init_parallel_env()
    net = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.ReLU(), paddle.nn.Linear(16, 2))
    model = paddle.DataParallel(net)
    lr = paddle.optimizer.lr.CosineAnnealingDecay(0.1, T_max=cli.epochs * 8)
    optimizer = paddle.optimizer.Momentum(learning_rate=lr, parameters=model.parameters())
    sampler = paddle.io.DistributedBatchSampler(dataset, batch_size=16, shuffle=True)
    loader = paddle.io.DataLoader(dataset, batch_sampler=sampler)
    for epoch in range(cli.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.clear_grad()
            lr.step()


if __name__ == "__main__":
    main()
