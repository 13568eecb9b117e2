"""The Tide batch sampler for ``paddle.io.DataLoader``.

``DataLoader(dataset, batch_sampler=session.batch_sampler(), num_workers=4,
collate_fn=...)``: the loader keeps its worker processes, prefetching and collate function;
only which samples make each batch comes from Tide. The batches are this rank's
micro-batches (trainer/sampler.py: ``micro_batches``) from the step after the restored one
to the budget's end, so a worker that starts in a new generation, at any world size,
continues with exactly the samples a fixed-size run would use: every sample once per
epoch. The sampler reads the session's position when iteration starts, which is after
``restore()``; prefetching ahead is safe because the plan of a step is a pure function of
(step, rank, world size).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import paddle

if TYPE_CHECKING:
    from trainer.session import ElasticSession


class TideBatchSampler(paddle.io.BatchSampler):
    def __init__(self, session: ElasticSession) -> None:
        # Not BatchSampler.__init__: it wants a dataset or a sampler, and this one has its
        # own plan. DataLoader only iterates it and asks its length.
        self.session = session
        self.batch_size = session.config.global_batch
        self.shuffle = False
        self.drop_last = False

    def _steps(self) -> range:
        return range(self.session.step_done + 1, self.session.config.max_steps + 1)

    def __iter__(self) -> Iterator[list[int]]:
        for step in self._steps():
            for mb in self.session.micro_batches(step):
                yield [int(i) for i in mb.local_indices]

    def __len__(self) -> int:
        return sum(len(self.session.micro_batches(step)) for step in self._steps())
