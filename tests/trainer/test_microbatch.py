"""Micro-batches: accumulation chunks, virtual ranks and padding (tide/trainer/sampler.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tide.trainer.sampler import (
    MicroBatch,
    ResumableSampler,
    SamplerConfig,
    micro_batches,
    owned_virtual_ranks,
)

pytestmark = pytest.mark.unit


def _all(step: int, world: int, v: int, acc: int, n: int = 50, b: int = 12) -> list[MicroBatch]:
    sampler = ResumableSampler(SamplerConfig(n, b, seed=1))
    out = []
    for rank in range(world):
        out += micro_batches(sampler.plan(step, rank, world), rank, world, v, acc)
    return out


@given(
    world=st.integers(1, 6),
    v=st.integers(0, 5),
    acc=st.integers(1, 3),
    step=st.integers(1, 12),
)
def test_every_sample_of_the_global_batch_once_and_weights_sum_to_one(
    world: int, v: int, acc: int, step: int
) -> None:
    mbs = _all(step, world, v, acc)
    real = [mb for mb in mbs if not mb.padding]
    ids = sorted(int(i) for mb in real for i in mb.local_indices)
    assert ids == sorted(int(i) for i in mbs[0].global_indices)
    assert sum(mb.weight for mb in mbs) == pytest.approx(1.0)
    assert all(mb.weight == 0 for mb in mbs if mb.padding)
    # Each rank has at least one micro-batch and exactly one last one.
    assert sum(mb.last for mb in mbs) == world


@given(w1=st.integers(1, 4), w2=st.integers(1, 4), step=st.integers(1, 12))
def test_virtual_micro_batches_do_not_depend_on_the_world(w1: int, w2: int, step: int) -> None:
    def by_virtual(world: int) -> dict[tuple[int, int], list[int]]:
        return {
            (
                mb.virtual_rank,
                mb.index - min(m.index for m in mbs if m.virtual_rank == mb.virtual_rank),
            ): [int(i) for i in mb.local_indices]
            for mbs in [_all(step, world, 4, 2)]
            for mb in mbs
            if not mb.padding
        }

    assert by_virtual(w1) == by_virtual(w2)


def test_a_rank_without_samples_runs_one_padding_batch() -> None:
    # The epoch's tail has 50 % 12 = 2 samples; 4 ranks.
    tail = _all(5, 4, 0, 1)
    assert [mb.padding for mb in tail] == [False, False, True, True]
    assert all(len(mb.local_indices) == 1 for mb in tail)
    # Virtual ranks 0-3 over 3 ranks: 2, 1, 1.
    assert [list(owned_virtual_ranks(4, r, 3)) for r in range(3)] == [[0, 1], [2], [3]]
    # More ranks than virtual ranks: the extra rank pads every step.
    five = _all(1, 5, 4, 1)
    assert [mb.padding for mb in five] == [False] * 4 + [True]
