"""The exact resharding sampler: a fixed global batch split among however many workers there are.

Every epoch has one permutation of the dataset drawn from (seed, epoch) with numpy's Generator,
so it does not depend on Paddle's RNG nor on the world size. A step consumes the next
``global_batch`` indices of the permutation; rank r of W takes a contiguous slice of them. The
position in the epoch is a pure function of the global step, so a job restored at step S in any
world size continues with exactly the samples a fixed-size run would have used.

The last step of an epoch takes what is left (``dataset_size % global_batch`` samples) rather
than dropping it or wrapping into the next epoch: every sample is used exactly once per epoch.
The loss must then be normalised by that step's ``global_batch_size``, which every rank knows.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import numpy.typing as npt

from tide.base.errors import ConfigError

IndexArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class SamplerConfig:
    dataset_size: int
    global_batch: int
    seed: int

    def __post_init__(self) -> None:
        if self.dataset_size < 1:
            raise ConfigError(f"dataset_size must be >= 1, got {self.dataset_size}")
        if self.global_batch < 1:
            raise ConfigError(f"global_batch must be >= 1, got {self.global_batch}")
        if self.global_batch > self.dataset_size:
            raise ConfigError(
                f"global_batch must be <= dataset_size ({self.dataset_size}), "
                f"got {self.global_batch}"
            )
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, got {self.seed}")

    @property
    def steps_per_epoch(self) -> int:
        return -(-self.dataset_size // self.global_batch)


@dataclass(frozen=True)
class Position:
    """Where a global step sits: its epoch and the samples consumed in that epoch before it."""

    epoch: int
    cursor: int


@dataclass(frozen=True)
class StepPlan:
    """What one rank does in one global step (steps are numbered from 1)."""

    step: int
    epoch: int
    # Samples of the epoch consumed before this step.
    cursor: int
    # Size of this step's global batch: ``global_batch`` except in an epoch's last step.
    global_batch_size: int
    # This rank's share of the global batch (may be empty when the tail is smaller than W).
    local_indices: IndexArray
    # The whole global batch, in order; the same on every rank.
    global_indices: IndexArray


def derive_seed(*parts: object) -> int:
    """A 31-bit seed from where a random draw sits in the run (seed, step, sample...), never
    from who draws it: every seed of the data path and of virtual ranks is made here."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@lru_cache(maxsize=4)
def _permutation(dataset_size: int, seed: int, epoch: int) -> IndexArray:
    # SeedSequence mixes seed and epoch so that neighbouring epochs are not correlated.
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    perm = rng.permutation(dataset_size).astype(np.int64)
    perm.setflags(write=False)
    return perm


def rank_slice(batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous share: sizes differ by at most one, low ranks first."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    base, extra = divmod(batch_size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class ResumableSampler:
    """Stateless apart from its config: a plan is a function of (step, rank, world size)."""

    def __init__(self, config: SamplerConfig) -> None:
        self.config = config

    def position(self, completed_steps: int) -> Position:
        """The position after ``completed_steps`` steps (the start of step completed_steps+1)."""
        if completed_steps < 0:
            raise ValueError(f"completed_steps must be >= 0, got {completed_steps}")
        spe = self.config.steps_per_epoch
        epoch, in_epoch = divmod(completed_steps, spe)
        return Position(epoch=epoch, cursor=in_epoch * self.config.global_batch)

    def permutation(self, epoch: int) -> IndexArray:
        return _permutation(self.config.dataset_size, self.config.seed, epoch)

    def plan(self, step: int, rank: int, world_size: int) -> StepPlan:
        if step < 1:
            raise ValueError(f"steps are numbered from 1, got {step}")
        pos = self.position(step - 1)
        perm = self.permutation(pos.epoch)
        end = min(pos.cursor + self.config.global_batch, self.config.dataset_size)
        global_indices = perm[pos.cursor : end]
        lo, hi = rank_slice(len(global_indices), rank, world_size)
        return StepPlan(
            step=step,
            epoch=pos.epoch,
            cursor=pos.cursor,
            global_batch_size=len(global_indices),
            local_indices=global_indices[lo:hi],
            global_indices=global_indices,
        )


@dataclass(frozen=True)
class MicroBatch:
    """One forward and backward of one rank in one global step.

    A rank's share of a step is one micro-batch, or several: ``accumulation_steps`` chunks
    of it (gradient accumulation), or one per virtual rank it runs (a fixed logical
    data-parallel degree, see :func:`micro_batches`). ``weight`` is the micro-batch's share
    of the global batch (its size over ``global_batch_size``): the session multiplies the
    micro-batch's mean loss by it, so the gradients of all micro-batches of all ranks sum to
    the global batch's. A rank with nothing to do in a step still runs one *padding*
    micro-batch (one sample, weight 0), so that every rank joins the step's collectives and
    a DataLoader loop sees one batch per step on every rank.
    """

    step: int
    epoch: int
    cursor: int
    global_batch_size: int
    local_indices: IndexArray
    global_indices: IndexArray
    weight: float
    # Position among this rank's micro-batches of the step, and how many there are.
    index: int
    count: int
    # The virtual rank whose BatchNorm state and RNG this micro-batch uses; -1: none.
    virtual_rank: int = -1
    padding: bool = False
    # Which accumulation chunk of its (virtual) rank's share this is: with ``index``, which
    # depends on how many virtual ranks this rank runs, it names the micro-batch in any world.
    chunk: int = 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def owned_virtual_ranks(virtual_ranks: int, rank: int, world_size: int) -> range:
    """The virtual ranks physical ``rank`` runs: contiguous, low ranks take the extra ones."""
    lo, hi = rank_slice(virtual_ranks, rank, world_size)
    return range(lo, hi)


def micro_batches(
    plan: StepPlan,
    rank: int,
    world_size: int,
    virtual_ranks: int = 0,
    accumulation_steps: int = 1,
) -> list[MicroBatch]:
    """This rank's micro-batches of ``plan``'s step.

    Plain (``virtual_ranks`` 0): this rank's contiguous share of the global batch, cut into
    ``accumulation_steps`` chunks. Virtual: the global batch is cut into ``virtual_ranks``
    micro-batches whatever the world size, and this rank runs those of the virtual ranks it
    owns (each cut again into ``accumulation_steps`` chunks), so every micro-batch, and the
    BatchNorm statistics computed over it, is the same in any world."""
    g = plan.global_indices
    n = plan.global_batch_size
    pieces: list[tuple[IndexArray, int, int]] = []
    if virtual_ranks:
        for v in owned_virtual_ranks(virtual_ranks, rank, world_size):
            lo, hi = rank_slice(n, v, virtual_ranks)
            pieces.extend((c, v, j) for j, c in enumerate(_chunks(g[lo:hi], accumulation_steps)))
    else:
        lo, hi = rank_slice(n, rank, world_size)
        pieces.extend((c, -1, j) for j, c in enumerate(_chunks(g[lo:hi], accumulation_steps)))
    if not pieces:
        pieces = [(g[:0], -1, 0)]
    out = []
    for i, (chunk, v, j) in enumerate(pieces):
        pad = len(chunk) == 0
        out.append(
            MicroBatch(
                step=plan.step,
                epoch=plan.epoch,
                cursor=plan.cursor,
                global_batch_size=n,
                local_indices=g[:1] if pad else chunk,
                global_indices=g,
                weight=0.0 if pad else len(chunk) / n,
                index=i,
                count=len(pieces),
                virtual_rank=v,
                padding=pad,
                chunk=j,
            )
        )
    return out


def _chunks(indices: IndexArray, parts: int) -> list[IndexArray]:
    """``indices`` cut into ``parts`` contiguous chunks, empty ones left out."""
    out = []
    for j in range(parts):
        lo, hi = rank_slice(len(indices), j, parts)
        if hi > lo:
            out.append(indices[lo:hi])
    return out
