"""tide/trainer/sharding.py: the strategy of a generation, what is refused before the first step,
and how the stepper and the state files see a fleet job (the resize itself:
tests/e2e/test_sharded.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tide.trainer import paddle_state, sharding
from tide.trainer.stepper import _sharded

paddle = pytest.importorskip("paddle")

pytestmark = [pytest.mark.unit, pytest.mark.paddle]


def _strategy(**hybrid: Any) -> Any:
    from paddle.distributed import fleet

    s = fleet.DistributedStrategy()
    for key, value in hybrid.items():
        if key == "sharding_configs":
            # A message field: set in place, as fleet's own scripts do.
            for name, flag in value.items():
                setattr(s.hybrid_configs["sharding_configs"], name, flag)
        else:
            s.hybrid_configs = {key: value}
    return s


def test_the_strategy_shards_over_the_whole_world() -> None:
    configs = sharding.fleet_strategy(3).hybrid_configs
    degrees = [configs[k] for k in ("sharding_degree", "dp_degree", "mp_degree", "pp_degree")]
    assert degrees == [3, 1, 1, 1]


@pytest.mark.parametrize(
    ("world", "cap", "dp", "shards"),
    [
        (4, 0, 1, 4),  # no cap: the whole world (the default)
        (4, 2, 2, 2),
        (3, 2, 3, 1),  # 3 has no divisor in 2..2: plain data parallel
        (2, 2, 1, 2),
        (6, 4, 2, 3),  # the largest divisor under the cap, not the cap
        (8, 4, 2, 4),
        (1, 2, 1, 1),
        (3, 8, 1, 3),  # a cap above the world is the world
    ],
)
def test_the_degree_rule(world: int, cap: int, dp: int, shards: int) -> None:
    assert sharding.degrees(world, cap) == (dp, shards)
    configs = sharding.fleet_strategy(world, None, cap).hybrid_configs
    assert (configs["dp_degree"], configs["sharding_degree"]) == (dp, shards)


def test_the_rule_divides_the_world_and_stays_under_the_cap() -> None:
    for world in range(1, 33):
        for cap in range(0, 10):
            dp, shards = sharding.degrees(world, cap)
            assert dp * shards == world
            assert (cap == 0 and shards == world) or shards <= cap
            better = [d for d in range(shards + 1, (cap or world) + 1) if world % d == 0]
            assert not better


def test_a_negative_cap_is_refused_naming_it(tmp_path: Any) -> None:
    from tide.base.errors import ConfigError
    from tide.trainer import SessionConfig

    with pytest.raises(ConfigError, match="sharding_degree_max"):
        SessionConfig(8, 4, 0, 1, str(tmp_path), sharding_degree_max=-1)
    with pytest.raises(ConfigError, match="sharding_degree_max"):
        sharding.degrees(4, -1)


def test_degrees_other_than_the_rule_are_refused_at_attach() -> None:
    with pytest.raises(sharding.UnsupportedLayout, match="sharding_degree_max=2") as err:
        sharding._check_degrees({"dp_degree": 1, "sharding_degree": 4}, 4, 2)
    assert "dp_degree=2 x sharding_degree=2" in str(err.value)
    assert sharding._check_degrees({"dp_degree": 2, "sharding_degree": 2}, 4, 2) == (2, 2)


@pytest.mark.parametrize(
    ("hybrid", "named"),
    [
        ({"mp_degree": 2}, "mp_degree=2"),
        ({"pp_degree": 2}, "pp_degree=2"),
        ({"dp_degree": 2}, "sharding_degree_max"),
        ({"sharding_configs": {"split_param": True}}, "split_param=True"),
        ({"sharding_configs": {"tensor_fusion": True}}, "tensor_fusion=True"),
    ],
)
def test_a_layout_tide_cannot_resize_is_refused_naming_it(hybrid: Any, named: str) -> None:
    with pytest.raises(sharding.UnsupportedLayout, match=named) as err:
        sharding.fleet_strategy(2, _strategy(**hybrid))
    assert "not supported under Tide" in str(err.value)


def _bare(cls: type) -> Any:
    """An instance of a fleet class without its constructor (which needs a process group):
    what an isinstance check sees."""
    return object.__new__(cls)


def test_sharding_stage_2_and_3_are_refused_at_attach() -> None:
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_optimizer_stage2 import (
        GroupShardedOptimizerStage2,
    )
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_stage2 import (
        GroupShardedStage2,
    )
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_stage3 import (
        GroupShardedStage3,
    )

    plain = paddle.nn.Linear(2, 2)
    adam = paddle.optimizer.Adam(parameters=plain.parameters())
    with pytest.raises(sharding.UnsupportedLayout, match="sharding stage 2") as err:
        sharding.check_attached(_bare(GroupShardedStage2), adam, 2)
    # Says why (Paddle runs it on GPUs only), where the proof is, and what it would take.
    assert "GPUs and XPUs only" in str(err.value)
    assert "bench.stage2_probe" in str(err.value)
    assert "param2rank" in str(err.value)
    with pytest.raises(sharding.UnsupportedLayout, match="sharding stage 3"):
        sharding.check_attached(_bare(GroupShardedStage3), adam, 2)

    class Wrapper:
        _inner_opt = _bare(GroupShardedOptimizerStage2)

    with pytest.raises(sharding.UnsupportedLayout, match="GroupShardedOptimizerStage2"):
        sharding.check_attached(plain, Wrapper(), 2)


def test_a_plain_job_is_not_sharded() -> None:
    model = paddle.nn.Linear(2, 2)
    adam = paddle.optimizer.Adam(parameters=model.parameters())
    assert sharding.check_attached(model, adam, 1) is None
    assert not _sharded(adam)


def test_the_stepper_sees_a_wrapped_sharded_optimizer() -> None:
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.dygraph_sharding_optimizer import (
        DygraphShardingOptimizer,
    )

    class Hybrid:
        _inner_opt = _bare(DygraphShardingOptimizer)

    assert _sharded(Hybrid())


def test_checkpoints_keep_the_wrapped_layers_keys() -> None:
    from paddle.distributed.fleet.meta_parallel.sharding_parallel import ShardingParallel

    net = paddle.nn.Sequential(paddle.nn.Linear(2, 2))
    wrapped = _bare(ShardingParallel)
    paddle.nn.Layer.__init__(wrapped)
    wrapped._layers = net
    assert sorted(wrapped.state_dict()) == ["_layers.0.bias", "_layers.0.weight"]
    assert paddle_state.layers(wrapped) is net
    assert paddle_state.layers(net) is net


def test_a_prepared_worker_gets_the_sharded_strategy(tmp_path: Any) -> None:
    """Overlap mode: a worker formed ahead gets its generation's strategy like any other
    (it used to be refused while fleet's extra gloo groups failed to form; tide/trainer/
    gloo_groups.py)."""
    from tests.trainer.queue_channel import QueueChannel
    from tide.trainer import ElasticSession, SessionConfig
    from tide.trainer.distenv import DistEnv

    config = SessionConfig(
        dataset_size=8, global_batch=4, seed=0, max_steps=1, checkpoint_dir=str(tmp_path)
    )
    session = ElasticSession(config, DistEnv(prepared=True), QueueChannel())
    session.init_process_group()
    assert session.fleet_strategy().hybrid_configs["sharding_degree"] == 1


def test_the_layout_lines_parse_old_and_new(tmp_path: Any) -> None:
    from tide.services.testing.parity import fleet_layouts, sharding_degrees

    (tmp_path / "a.log").write_text(
        "x rank 0 of generation 2: optimizer state sharded over 3 ranks (stage 1)\n"
        "x rank 1 of generation 3: optimizer state sharded over 2 ranks (stage 1), "
        "2 data-parallel replicas\n"
    )
    logs = [tmp_path / "a.log"]
    assert fleet_layouts(logs) == {2: {0: (1, 3)}, 3: {1: (2, 2)}}
    assert sharding_degrees(logs) == {2: {0: 3}, 3: {1: 2}}
