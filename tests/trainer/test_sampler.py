"""The resharding sampler: every sample once per epoch, for any sequence of world sizes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tide.base.errors import ConfigError
from tide.trainer.sampler import ResumableSampler, SamplerConfig, rank_slice

pytestmark = pytest.mark.unit


def test_world_size_changes_do_not_change_the_global_batch() -> None:
    sampler = ResumableSampler(SamplerConfig(dataset_size=100, global_batch=12, seed=7))
    for step in range(1, 30):
        reference = sampler.plan(step, 0, 1).global_indices
        for world in (2, 3, 4):
            parts = [sampler.plan(step, r, world).local_indices for r in range(world)]
            assert np.array_equal(np.concatenate(parts), reference)


@settings(max_examples=60, deadline=None)
@given(
    dataset_size=st.integers(1, 80),
    batch=st.integers(1, 80),
    seed=st.integers(0, 2**31),
    worlds=st.lists(st.integers(1, 5), min_size=1, max_size=40),
)
def test_elastic_schedule_uses_every_sample_once_per_epoch(
    dataset_size: int, batch: int, seed: int, worlds: list[int]
) -> None:
    batch = min(batch, dataset_size)
    cfg = SamplerConfig(dataset_size=dataset_size, global_batch=batch, seed=seed)
    sampler = ResumableSampler(cfg)
    seen: dict[int, list[int]] = {}
    # One world size per step: the harshest possible resize schedule.
    for step, world in enumerate(worlds * 3, start=1):
        for rank in range(world):
            plan = sampler.plan(step, rank, world)
            seen.setdefault(plan.epoch, []).extend(int(i) for i in plan.local_indices)
    last_epoch = max(seen)
    for epoch, ids in seen.items():
        assert len(ids) == len(set(ids)), f"epoch {epoch} repeats a sample"
        if epoch < last_epoch:
            assert sorted(ids) == list(range(dataset_size)), f"epoch {epoch} misses samples"


def test_epoch_tail_is_the_remainder_and_next_epoch_starts_fresh() -> None:
    sampler = ResumableSampler(SamplerConfig(dataset_size=10, global_batch=4, seed=1))
    assert sampler.config.steps_per_epoch == 3
    tail = sampler.plan(3, 0, 1)
    assert (tail.epoch, tail.cursor, tail.global_batch_size) == (0, 8, 2)
    nxt = sampler.plan(4, 0, 1)
    assert (nxt.epoch, nxt.cursor, nxt.global_batch_size) == (1, 0, 4)
    # A tail smaller than the world leaves some ranks empty, deterministically.
    assert [len(sampler.plan(3, r, 3).local_indices) for r in range(3)] == [1, 1, 0]


def test_permutation_depends_on_seed_and_epoch_only() -> None:
    a = ResumableSampler(SamplerConfig(dataset_size=50, global_batch=5, seed=3))
    b = ResumableSampler(SamplerConfig(dataset_size=50, global_batch=5, seed=3))
    assert np.array_equal(a.permutation(2), b.permutation(2))
    assert not np.array_equal(a.permutation(0), a.permutation(1))
    c = ResumableSampler(SamplerConfig(dataset_size=50, global_batch=5, seed=4))
    assert not np.array_equal(a.permutation(0), c.permutation(0))


def test_rank_slice_sizes_differ_by_at_most_one() -> None:
    assert [rank_slice(10, r, 3) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(ValueError, match="rank"):
        rank_slice(10, 3, 3)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"dataset_size": 0, "global_batch": 1, "seed": 0}, "dataset_size"),
        ({"dataset_size": 5, "global_batch": 0, "seed": 0}, "global_batch"),
        ({"dataset_size": 5, "global_batch": 6, "seed": 0}, "global_batch"),
        ({"dataset_size": 5, "global_batch": 2, "seed": -1}, "seed"),
    ],
)
def test_bad_config_names_the_field(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        SamplerConfig(**kwargs)
