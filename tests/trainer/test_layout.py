"""tide/trainer/layout.py: the coordinates, groups and resize transfer of a tensor/pipeline-
parallel job along its data-parallel dimension (pure; the GPU run is scripts/gpu_check.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tide.base.errors import ConfigError
from tide.trainer.layout import (
    ModelParallel,
    check_world,
    coordinates,
    dp_groups,
    plan_transfer,
    rank_of,
    stayers_by_replica,
)

pytestmark = pytest.mark.unit

models = st.builds(
    ModelParallel,
    mp_degree=st.integers(1, 4),
    pp_degree=st.integers(1, 3),
    sep_degree=st.integers(1, 2),
)


def test_fleets_order_model_parallel_fastest() -> None:
    # fleet's CommunicateTopology: ranks 0, 1 are one tensor-parallel pair of replica 0.
    model = ModelParallel(mp_degree=2, pp_degree=2)
    coords = coordinates(8, model)
    assert [(c.dp, c.pp, c.mp) for c in coords[:4]] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert dp_groups(8, model) == [[0, 4], [1, 5], [2, 6], [3, 7]]


@given(models, st.integers(1, 4))
def test_coordinates_are_a_bijection_and_groups_partition(model: ModelParallel, dp: int) -> None:
    world = dp * model.group_size
    coords = coordinates(world, model)
    assert len(set(coords)) == world
    assert [rank_of(c, model) for c in coords] == list(range(world))
    groups = dp_groups(world, model)
    assert sorted(r for g in groups for r in g) == list(range(world))
    assert all(len(g) == dp for g in groups)
    assert all(len({coords[r].slice for r in g}) == 1 for g in groups)


@given(models, st.integers(1, 40))
def test_a_world_of_partial_replicas_is_refused_naming_the_settings(
    model: ModelParallel, world: int
) -> None:
    if world % model.group_size == 0:
        assert check_world(world, model) == world // model.group_size
        return
    with pytest.raises(ConfigError, match="replica_multiple") as err:
        check_world(world, model)
    assert "mp_degree" in str(err.value)


@given(models, st.integers(1, 4), st.integers(1, 4), st.data())
def test_every_new_rank_gets_its_slice_from_a_stayer_that_held_it(
    model: ModelParallel, old_dp: int, new_dp: int, data: st.DataObject
) -> None:
    g = model.group_size
    old_world, new_world = old_dp * g, new_dp * g
    # Some processes stay, with new ranks in any order (pods regrouped by the layout),
    # at least one whole replica among them.
    kept = data.draw(st.integers(1, min(old_dp, new_dp)))
    old_ranks = data.draw(st.permutations(range(old_world)))
    new_ranks = data.draw(st.permutations(range(new_world)))
    extra = data.draw(st.integers(0, min(old_world, new_world) - kept * g))
    stayers = dict(zip(new_ranks[: kept * g + extra], old_ranks[: kept * g + extra], strict=True))
    # ...where one whole replica is guaranteed: the first kept replicas stay in place.
    stayers = {**{n: o for n, o in stayers.items() if n >= kept * g and o >= kept * g}}
    stayers.update(stayers_by_replica(kept * g, kept * g, model))
    plan = plan_transfer(old_world, new_world, model, stayers)
    old, new = coordinates(old_world, model), coordinates(new_world, model)
    assert sorted([*plan.keeps, *(m.to for m in plan.moves)]) == list(range(new_world))
    for to, own in plan.keeps.items():
        assert stayers[to] == own and old[own].slice == new[to].slice
    for m in plan.moves:
        assert m.source in stayers.values()
        assert old[m.source].slice == new[m.to].slice == m.slice


def test_a_newcomer_at_mp_rank_1_receives_from_the_stayer_at_mp_rank_1() -> None:
    model = ModelParallel(mp_degree=2)
    plan = plan_transfer(2, 4, model, stayers_by_replica(2, 4, model))
    assert plan.keeps == {0: 0, 1: 1}
    assert [(m.to, m.source, m.slice) for m in plan.moves] == [(2, 0, (0, 0, 0)), (3, 1, (0, 0, 1))]
    assert plan.sources() == {0: [2], 1: [3]}


def test_losing_every_holder_of_a_slice_is_refused() -> None:
    model = ModelParallel(mp_degree=2)
    # Only the mp-rank-0 halves of both replicas stay: nobody holds mp rank 1's slice.
    with pytest.raises(ConfigError, match="no staying rank holds"):
        plan_transfer(4, 2, model, {0: 0, 1: 2})
