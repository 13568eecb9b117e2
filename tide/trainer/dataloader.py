"""The Tide batch sampler for ``paddle.io.DataLoader``, and the data path's random streams.

``DataLoader(dataset, batch_sampler=session.batch_sampler(), num_workers=4,
collate_fn=...)``: the loader keeps its worker processes, prefetching and collate function;
only which samples make each batch comes from Tide. The batches are this rank's
micro-batches (tide/trainer/sampler.py: ``micro_batches``) from the step after the restored one
to the budget's end, so a worker that starts in a new generation, at any world size,
continues with exactly the samples a fixed-size run would use: every sample once per
epoch. The sampler reads the session's position when iteration starts, which is after
``restore()``; prefetching ahead is safe because the plan of a step is a pure function of
(step, rank, world size).

**Random streams.** Each batch is a :class:`PlannedBatch`: when the loader's fetch iterates
it (``dataset[i]`` for each index, in a worker process or in the loader's thread), it seeds
Paddle's, numpy's and Python's global generators from (seed, epoch, sample) before each
sample. Augmentation drawn inside ``__getitem__`` is then a function of the sample and its
epoch alone: the same whichever worker process, world size or generation fetches it. A
``collate_fn`` that draws continues the last sample's stream in a worker process.

With ``num_workers=0`` Paddle fetches in a thread of the training process, and its draws
raced with the training loop's own (the per-micro-batch ``paddle.seed()`` of virtual ranks,
dropout): two identical runs differed. There the fetch of a step's batch waits until the
loop has stepped the batch before it (:meth:`Deliveries.wait_turn`), then seeds per sample
and puts the training process's generator states back: nothing draws concurrently.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import paddle

from tide.trainer.sampler import derive_seed

if TYPE_CHECKING:
    from tide.trainer.contract import Deliveries
    from tide.trainer.session import ElasticSession


def seed_all(seed: int) -> None:
    """Paddle's (every device's), numpy's and Python's global generators."""
    paddle.seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed a sample's fetch runs under: where it sits in the run, not who fetches it."""
    return derive_seed("sample", seed, epoch, index)


class _SavedRng:
    """The training process's generator states around a fetch in the loader thread."""

    def __init__(self) -> None:
        self.places = ["cpu"]
        current = str(paddle.device.get_device())
        if current != "cpu":
            self.places.append(current)
        self.paddle = [paddle.get_rng_state(p) for p in self.places]
        self.numpy = np.random.get_state()
        self.python = random.getstate()

    def put_back(self) -> None:
        for place, state in zip(self.places, self.paddle, strict=True):
            paddle.set_rng_state(state, place)
        np.random.set_state(self.numpy)
        random.setstate(self.python)


def _loader_stopped() -> bool:
    """Whether the DataLoader iterator whose thread runs this has been shut down (its
    ``_thread_done_event``): a fetch waiting at the gate must not outlive it, or Paddle's
    shutdown joins the thread for ever. False where that cannot be told."""
    target = getattr(threading.current_thread(), "_target", None)
    done = getattr(getattr(target, "__self__", None), "_thread_done_event", None)
    return bool(done is not None and done.is_set())


class PlannedBatch:
    """The sample indices of one micro-batch, as the DataLoader's fetch iterates them.

    Picklable (to a worker process) without its gate; iterating it seeds per sample."""

    def __init__(
        self,
        ids: tuple[int, ...],
        seed: int,
        epoch: int,
        run: int,
        seq: int,
        gate: Deliveries | None,
    ) -> None:
        self.ids = ids
        self.seed = seed
        self.epoch = epoch
        self.run = run
        self.seq = seq
        self.gate = gate

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> int:
        return self.ids[i]

    def __repr__(self) -> str:
        return f"PlannedBatch({list(self.ids)})"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "gate": None}

    def __iter__(self) -> Iterator[int]:
        saved = None
        if self.gate is not None:
            # In the training process (a worker process gets no gate): num_workers=0's
            # loader thread, beside the training loop, waits its turn; either way the
            # loop's generator states are put back after the fetch.
            if threading.current_thread() is not threading.main_thread():
                self.gate.wait_turn(self.run, self.seq, _loader_stopped)
            saved = _SavedRng()
        try:
            for i in self.ids:
                seed_all(sample_seed(self.seed, self.epoch, i))
                yield i
        finally:
            if saved is not None:
                saved.put_back()


@dataclass(frozen=True)
class SeedWorker:
    """A ``worker_init_fn``: each loader worker's generators seeded from (seed, worker id)
    rather than Paddle's per-iterator random ``base_seed``, for whatever a worker draws
    outside a sample's fetch (its own start-up). Chains the script's own."""

    seed: int
    then: Callable[[int], None] | None = None

    def __call__(self, worker_id: int) -> None:
        seed_all(derive_seed("worker", self.seed, worker_id))
        if self.then is not None:
            self.then(worker_id)


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

    def __iter__(self) -> Iterator[PlannedBatch]:  # type: ignore[override]
        # Not a generator: the pass starts (and the session's order is checked) when the
        # DataLoader's iterator is made, before Paddle draws its base seed from numpy's
        # global generator; the first batch is drawn after.
        self.session.lifecycle.training("iterating session.batch_sampler()")
        deliveries = self.session.deliveries
        run = deliveries.start()
        numpy_state = np.random.get_state()
        return self._batches(deliveries, run, numpy_state)

    def _batches(
        self, deliveries: Deliveries, run: int, numpy_state: Any
    ) -> Iterator[PlannedBatch]:
        if threading.current_thread() is threading.main_thread():
            # Worker processes: Paddle drew one number from the training process's numpy
            # generator for their base seed since __iter__ (they are seeded per sample and
            # by SeedWorker instead); a resized run would draw once per generation.
            np.random.set_state(numpy_state)
        seq = 0
        seed = self.session.config.seed
        for step in self._steps():
            for mb in self.session.micro_batches(step):
                ids = tuple(int(i) for i in mb.local_indices)
                deliveries.drawn(mb.step, mb.index, ids)
                yield PlannedBatch(ids, seed, mb.epoch, run, seq, deliveries)
                seq += 1

    def __len__(self) -> int:
        return sum(len(self.session.micro_batches(step)) for step in self._steps())


def data_loader(session: ElasticSession, dataset: Any, **kwargs: Any) -> paddle.io.DataLoader:
    """``paddle.io.DataLoader(dataset, batch_sampler=session.batch_sampler(),
    worker_init_fn=<Tide's, then the script's>, **kwargs)``."""
    for name in ("batch_sampler", "batch_size", "shuffle", "sampler", "drop_last"):
        if name in kwargs:
            from tide.trainer.contract import UsageError

            raise UsageError(
                f"session.data_loader() makes the batches itself: drop {name}= (the global "
                "batch is SessionConfig.global_batch)"
            )
    init = SeedWorker(session.config.seed, kwargs.pop("worker_init_fn", None))
    return paddle.io.DataLoader(
        dataset, batch_sampler=TideBatchSampler(session), worker_init_fn=init, **kwargs
    )
