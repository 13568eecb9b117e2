"""Paddle fleet's sharded optimizer (stage 1) under Tide: the layout of each generation, what
is refused, and the optimizer state gathered whole at every checkpoint (docs/sharded.md).

**Layout.** A sharded job states it once, by calling :func:`fleet_strategy` (through
``session.fleet_strategy()``) for the strategy it passes to ``fleet.init``: the optimizer
state is sharded over the whole data-parallel world Tide gives each generation
(``sharding_degree`` = world size, ``dp_degree`` = ``mp_degree`` = ``pp_degree`` = 1). A
resize changes the sharding degree, so each new rank owns other parameters' moments.

**Exact across a resize.** fleet's ``DygraphShardingOptimizer`` gives each parameter one
owner (its own rule: parameters by size, largest first, each to the rank holding the fewest
elements so far) and keeps that parameter's optimizer slots (Adam's moments and beta powers,
AMP's master weight) on the owner alone. Tide's checkpoints (the durable one and the pod's
handover alike) hold the whole optimizer state instead: at a checkpoint step every rank
sends its shard to every other one (:func:`gather`, over trainer/transfer.py's
``send_tensors``, one source rank after another), so any rank's state is a whole one. At a
restore, fleet's own ``set_state_dict`` keeps the slots of the parameters the rank owns under
the *new* degree, so the next step runs as if the job had started at that size. The price: a
transient whole copy of the optimizer state on every rank at each checkpoint, and the gather's
time in the resize's pause (docs/sharded.md has the figures).

**Refused** (:class:`UnsupportedLayout`, at ``fleet_strategy`` or ``attach``, before step 1):
tensor, pipeline or sequence parallelism (``mp_degree``/``pp_degree``/``sep_degree`` > 1: their
groups are fixed by the model, and fleet needs a GPU for them), data parallelism beside
sharding (``dp_degree`` > 1), sharding stage 2 and 3 (``GroupShardedStage2/3``, the
``split_param`` optimizer: their slots and gradients are flat slices, not per parameter),
fleet's ``tensor_fusion``/``comm_overlap`` (fused buffers), and a time-based checkpoint
cadence (``every_s``: the gather needs every rank at the same step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tidebase.errors import ConfigError
from trainer import paddle_state
from trainer.transfer import TransferSettings, send_tensors

# An AMP master weight travels under its parameter's name and this suffix (so that it is
# renamed by position like the parameter's other slots).
_MASTER = "_tide_master"
# The optimizer state entries that are not per-parameter tensors (equal on every rank).
_SHARED_ENTRIES = ("LR_Scheduler",)


class UnsupportedLayout(ConfigError):
    """A fleet layout or feature Tide cannot keep exact across a resize; the message names it."""


def _refuse(what: str, why: str) -> UnsupportedLayout:
    return UnsupportedLayout(
        f"{what} is not supported under Tide: {why}. Tide resizes fleet jobs with the "
        "optimizer sharded over the data-parallel world only (sharding stage 1, "
        "sharding_degree = world size); see docs/sharded.md"
    )


def _check_degrees(configs: Any, world_size: int | None) -> None:
    for name, why in (
        ("mp_degree", "tensor-parallel groups are fixed by the model"),
        ("pp_degree", "pipeline stages are fixed by the model"),
        ("sep_degree", "sequence-parallel groups are fixed by the model"),
        ("dp_degree", "data parallelism beside sharding is not resharded"),
    ):
        value = int(configs.get(name, 1) if isinstance(configs, dict) else getattr(configs, name))
        if value > 1:
            raise _refuse(f"{name}={value}", why)
    if world_size is not None:
        degree = int(
            configs.get("sharding_degree", 1)
            if isinstance(configs, dict)
            else configs.sharding_degree
        )
        if degree not in (1, world_size) or (degree == 1 and world_size > 1):
            raise _refuse(
                f"sharding_degree={degree} in a world of {world_size}",
                "the sharding degree is the generation's world size "
                "(take the strategy from session.fleet_strategy())",
            )


def _check_sharding_configs(strategy: Any) -> None:
    cfg = strategy.hybrid_configs["sharding_configs"]
    for name, why in (
        ("split_param", "sharding stage 2 slices parameters and their slots"),
        ("tensor_fusion", "fused buffers hold the slots, not the parameters"),
        ("comm_overlap", "fused buffers hold the gradients"),
    ):
        if bool(getattr(cfg, name, False)):
            raise _refuse(f"sharding_configs.{name}=True", why)


def fleet_strategy(world_size: int, strategy: Any = None) -> Any:
    """The ``fleet.DistributedStrategy`` of a generation of ``world_size`` ranks: the
    script's own (or a new one) with the optimizer sharded over the whole world. Raises
    :class:`UnsupportedLayout` for a degree or sharding option Tide cannot resize."""
    from paddle.distributed import fleet

    strategy = strategy if strategy is not None else fleet.DistributedStrategy()
    mine = strategy.hybrid_configs
    _check_degrees(
        {k: mine[k] for k in ("mp_degree", "pp_degree", "sep_degree", "dp_degree")}, None
    )
    _check_sharding_configs(strategy)
    strategy.hybrid_configs = {
        "dp_degree": 1,
        "mp_degree": 1,
        "pp_degree": 1,
        "sep_degree": 1,
        "sharding_degree": world_size,
    }
    return strategy


def _unwrap(optimizer: Any) -> list[Any]:
    """``optimizer`` and the optimizers it wraps (fleet's wrappers keep ``_inner_opt``)."""
    chain = [optimizer]
    while (inner := getattr(chain[-1], "_inner_opt", None)) is not None and len(chain) < 8:
        chain.append(inner)
    return chain


def check_attached(model: Any, optimizer: Any, world_size: int) -> Sharded | None:
    """What Tide resizes about the attached model and optimizer: a :class:`Sharded` for
    fleet's stage 1, None for a plain (or ``paddle.DataParallel``) job; raises
    :class:`UnsupportedLayout` for what it cannot resize."""
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer import (
        dygraph_sharding_optimizer as dso,
    )
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer import (
        hybrid_parallel_optimizer as hpo,
    )
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_optimizer_stage2 import (
        GroupShardedOptimizerStage2,
    )
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_stage2 import (
        GroupShardedStage2,
    )
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_stage3 import (
        GroupShardedStage3,
    )

    why23 = "its gradients (stage 2) and parameters (stage 3) are flat slices across ranks"
    if isinstance(model, GroupShardedStage2 | GroupShardedStage3):
        raise _refuse(f"sharding stage {2 if isinstance(model, GroupShardedStage2) else 3}", why23)
    chain = _unwrap(optimizer) if optimizer is not None else []
    for opt in chain:
        if isinstance(opt, GroupShardedOptimizerStage2):
            raise _refuse("sharding stage 2 (GroupShardedOptimizerStage2)", why23)
        if isinstance(opt, dso.DygraphShardingOptimizerV2):
            raise _refuse(
                "sharding_configs.split_param=True", "stage 2 slices parameters and their slots"
            )
    hybrid = any(isinstance(o, hpo.HybridParallelOptimizer) for o in chain)
    if hybrid:
        from paddle.distributed import fleet

        hcg = fleet.get_hybrid_communicate_group()
        _check_degrees(
            {
                "mp_degree": hcg.get_model_parallel_world_size(),
                "pp_degree": hcg.get_pipe_parallel_world_size(),
                "sep_degree": hcg.get_sep_parallel_world_size(),
                "dp_degree": hcg.get_data_parallel_world_size(),
                "sharding_degree": hcg.get_sharding_parallel_world_size(),
            },
            world_size,
        )
        _check_sharding_configs(fleet.fleet._user_defined_strategy)
    for opt in chain:
        if isinstance(opt, dso.DygraphShardingOptimizer):
            return Sharded(opt, world_size)
    return None


@dataclass
class Gathered:
    """The whole optimizer state, by parameter name as ``optimizer.state_dict()`` has it:
    what a checkpoint of a sharded job saves in place of this rank's shard."""

    state: dict[str, Any]
    step: int
    seconds: float
    nbytes: int

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)


class Sharded:
    """A job whose optimizer is fleet's ``DygraphShardingOptimizer`` (stage 1)."""

    def __init__(self, sharding_optimizer: Any, world_size: int) -> None:
        self.optimizer = sharding_optimizer
        self.degree = world_size

    def owners(self) -> dict[str, int]:
        """Each parameter's owning sharding rank, by name (fleet's own assignment)."""
        return dict(self.optimizer._param2rank)

    def gather(
        self,
        model: Any,
        optimizer: Any,
        step: int,
        rank: int,
        settings: TransferSettings | None = None,
    ) -> Gathered:
        """Every rank's shard of the optimizer state on every rank: one ``send_tensors``
        per source rank, each over the whole group. A collective: every rank calls it at the
        same step."""
        import paddle

        started = time.monotonic()
        chunk = (settings or TransferSettings.from_env()).chunk_bytes
        own = optimizer.state_dict()
        mine = _arrays(model, own)
        merged: dict[str, Any] = {}
        nbytes = 0
        for source in range(self.degree):
            moved = send_tensors(mine if rank == source else None, source, rank, chunk)
            if not moved.intact:
                raise ConnectionError(
                    f"rank {rank}: the optimizer shard of rank {source} arrived damaged"
                )
            for key, array in moved.arrays.items():
                merged.setdefault(key, array)
                nbytes += int(array.nbytes)
        state: dict[str, Any] = {k: v for k, v in own.items() if k in _SHARED_ENTRIES}
        masters: dict[str, Any] = {}
        by_name = paddle_state.positional(model, merged, to_positions=False)
        for key, array in by_name.items():
            tensor = paddle.to_tensor(np.asarray(array))
            if key.endswith(_MASTER):
                masters[key[: -len(_MASTER)]] = tensor
            else:
                state[key] = tensor
        if masters:
            state["master_weights"] = masters
        return Gathered(state, step, time.monotonic() - started, nbytes)


def _arrays(model: Any, state: dict[str, Any]) -> dict[str, Any]:
    """This rank's shard as arrays by positional name (names are per-process counters)."""
    flat: dict[str, Any] = {}
    for key, value in state.items():
        if key in _SHARED_ENTRIES:
            continue
        if key == "master_weights":
            flat.update({k + _MASTER: v for k, v in value.items()})
        else:
            flat[key] = value
    out: dict[str, Any] = {}
    for key, value in paddle_state.positional(model, flat, to_positions=True).items():
        array = paddle_state.raw_array(value)
        if array is None:
            raise _refuse(
                f"optimizer slot {key} of dtype {getattr(value, 'dtype', type(value))}",
                "only tensors of plain dtypes (not bfloat16) are gathered",
            )
        out[key] = np.ascontiguousarray(array)
    return out
