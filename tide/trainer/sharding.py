"""Paddle fleet's sharded optimizer (stage 1) under Tide: the layout of each generation, what
is refused, and the optimizer state gathered whole at every checkpoint (docs/sharded.md).

**Layout.** A sharded job states it once, by calling :func:`fleet_strategy` (through
``session.fleet_strategy()``) for the strategy it passes to ``fleet.init``. Each generation of
W ranks runs ``dp_degree`` x ``sharding_degree`` = W by :func:`degrees`: the sharding degree is
the largest divisor of W not above ``SessionConfig.sharding_degree_max`` (0, the default: W
itself, the optimizer sharded over the whole world), the data-parallel degree the rest
(``mp_degree`` = ``pp_degree`` = ``sep_degree`` = 1). A resize changes the degrees, so each new
rank owns other parameters' moments.

**Exact across a resize.** fleet's ``DygraphShardingOptimizer`` gives each parameter one
owner (its own rule: parameters by size, largest first, each to the rank holding the fewest
elements so far) and keeps that parameter's optimizer slots (Adam's moments and beta powers,
AMP's master weight) on the owner alone. Tide's checkpoints (the durable one and the pod's
handover alike) hold the whole optimizer state instead: at a checkpoint step the ranks of one
sharding group (the first data-parallel replica's: every replica holds the same shards) send
their shards to every rank of the world (:func:`gather`, over tide/trainer/transfer.py's
``send_tensors``, one source rank after another), so any rank's state is a whole one. At a
restore, fleet's own ``set_state_dict`` keeps the slots of the parameters the rank owns under
the *new* degree, so the next step runs as if the job had started at that size. The price: a
transient whole copy of the optimizer state on every rank at each checkpoint, and the gather's
time in the resize's pause (docs/sharded.md has the figures).

**Tensor parallelism** (``mp_degree`` > 1, from the strategy or ``SessionConfig.model_parallel``)
is elastic along the replicas only: ``dp_degree`` = W / ``mp_degree``, no sharding
(:func:`layout_degrees`; the session's side is tide/trainer/layout.py and slices.py).
**Pipeline parallelism by hand** (``SessionConfig.model_parallel.pp_degree`` > 1, alone or with
``mp_degree``) is elastic the same way, each replica a whole pipeline: the script runs its own
stage and exchanges activations and gradients through ``session.pipeline``
(tide/trainer/pipeline.py); it runs plain models only (:func:`check_pipeline_attached`).

**Refused** (:class:`UnsupportedLayout`, at ``fleet_strategy`` or ``attach``, before step 1):
fleet's pipeline parallelism (a strategy's ``pp_degree`` > 1: it runs its own schedule,
:data:`_WHY_PP`) and sequence parallelism (``sep_degree`` > 1), a pipeline by hand under
fleet, ``paddle.DataParallel`` or an AMP ``GradScaler``, sharding beside tensor or pipeline
parallelism, degrees other than :func:`degrees` gives (a ``dp_degree`` of the script's own:
the cap is the setting ``sharding_degree_max``), sharding stage 2 (Paddle runs it on GPUs
only: :data:`WHY_STAGE2`), stage 3 and the ``split_param`` optimizer (their slots are flat
slices, not per parameter), fleet's ``tensor_fusion``/``comm_overlap`` (fused buffers), and a
time-based checkpoint cadence (``every_s``: the gather needs every rank at the same step).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from tide.base.errors import ConfigError
from tide.trainer import paddle_state
from tide.trainer.layout import ModelParallel, RankLayout, check_world
from tide.trainer.transfer import TransferSettings, send_tensors

# An AMP master weight travels under its parameter's name and this suffix (so that it is
# renamed by position like the parameter's other slots).
_MASTER = "_tide_master"
# The optimizer state entries that are not per-parameter tensors (equal on every rank).
_SHARED_ENTRIES = ("LR_Scheduler",)


# Why stage 2 is refused: it could not be built or tested here (docs/sharded.md "Stage 2").
WHY_STAGE2 = (
    "Paddle 3.3 runs sharding stage 2 on GPUs and XPUs only (on the CPU "
    "group_sharded_parallel and GroupShardedOptimizerStage2 assert a device, and its storage "
    "moves every parameter to one: python -m bench.stage2_probe), so its resharding could "
    "not be built and checked on a CPU; on a GPU it would take the stage-1 gather with "
    "GroupShardedOptimizerStage2.param2rank as the owners (parameters in order, each to the "
    "rank holding the fewest elements), a check that its gradient storages are empty at the "
    "checkpoint step, and the restored slots kept for the new owners only"
)
_WHY_STAGE3 = "its parameters and their slots are flat slices across ranks"
_WHY_SPLIT = (
    "fleet's sharding V2 (DygraphShardingOptimizerV2) keeps parameters and their slots as "
    "flat slices across ranks"
)


class UnsupportedLayout(ConfigError):
    """A fleet layout or feature Tide cannot keep exact across a resize; the message names it."""


def _refuse(what: str, why: str) -> UnsupportedLayout:
    return UnsupportedLayout(
        f"{what} is not supported under Tide: {why}. Tide resizes fleet jobs along the "
        "data-parallel world only (sharding stage 1, dp_degree x sharding_degree = world "
        "size by SessionConfig.sharding_degree_max; or whole tensor- or pipeline-parallel "
        "replicas, dp_degree = world size / (mp_degree x pp_degree)); see docs/sharded.md"
    )


def degrees(world_size: int, sharding_degree_max: int = 0) -> tuple[int, int]:
    """``(dp_degree, sharding_degree)`` of a generation of ``world_size`` ranks: the sharding
    degree is the largest divisor of the world size not above ``sharding_degree_max`` (0: no
    cap, the whole world), the data-parallel degree the rest. The largest such divisor keeps
    the least optimizer state per rank the cap allows; a divisor, because fleet's groups
    tile the world."""
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    if sharding_degree_max < 0:
        raise ConfigError(f"sharding_degree_max must be >= 0, got {sharding_degree_max}")
    cap = world_size if sharding_degree_max == 0 else min(sharding_degree_max, world_size)
    sharding = max(d for d in range(1, cap + 1) if world_size % d == 0)
    return world_size // sharding, sharding


def _get(configs: Any, name: str) -> int:
    return int(configs.get(name, 1) if isinstance(configs, dict) else getattr(configs, name))


# Why the layouts beside tensor parallelism are refused (docs/sharded.md "What is refused").
_WHY_PP = (
    "fleet's PipelineParallel runs forward, backward and the optimizer inside its own "
    "train_batch schedule, where session.step(loss) can neither weigh the loss nor sum the "
    "gradients (and the loss exists on the last stage only); run the stages by hand instead, "
    "with SessionConfig.model_parallel = ModelParallel(pp_degree=...) and session.pipeline's "
    "send/recv (tide/trainer/examples/train_pipeline_parallel.py)"
)
_WHY_SEP = (
    "sequence parallelism is planned by tide/trainer/layout.py but its session path is not "
    "built nor checked"
)
_WHY_MP_SHARDING = (
    "the optimizer state of a tensor- or pipeline-parallel job is not sharded under Tide "
    "(its gather and the slice transfer are not combined): leave the strategy's "
    "sharding_degree at 1 and SessionConfig.sharding_degree_max at 0 or 1"
)


def describe(model_parallel: ModelParallel) -> str:
    """The degrees above 1 of ``model_parallel``, as a message names them."""
    named = [
        f"{name}={getattr(model_parallel, name)}"
        for name in ("mp_degree", "pp_degree", "sep_degree")
        if getattr(model_parallel, name) > 1
    ]
    return " x ".join(named) or "mp_degree=1"


def model_parallel_of(configs: Any) -> ModelParallel:
    """The model-parallel degrees a strategy's ``hybrid_configs`` state; refuses pipeline
    and sequence parallelism."""
    for name, why in (("pp_degree", _WHY_PP), ("sep_degree", _WHY_SEP)):
        value = _get(configs, name)
        if value > 1:
            raise _refuse(f"{name}={value}", why)
    return ModelParallel(mp_degree=_get(configs, "mp_degree"))


def resolve_model_parallel(strategy: Any, configured: ModelParallel) -> ModelParallel:
    """The job's model-parallel degrees: ``SessionConfig.model_parallel`` where it states
    them, else the script's strategy's; both stated and different is refused."""
    if strategy is None:
        return configured
    mine = strategy.hybrid_configs
    stated = model_parallel_of({k: mine[k] for k in ("mp_degree", "pp_degree", "sep_degree")})
    if configured.group_size > 1 and stated.group_size > 1 and stated != configured:
        raise _refuse(
            f"mp_degree={stated.mp_degree} in the strategy",
            f"SessionConfig.model_parallel states mp_degree={configured.mp_degree}",
        )
    return configured if configured.group_size > 1 else stated


def check_replicas(world_size: int, model_parallel: ModelParallel) -> None:
    """Refuses a world that is not whole model-parallel replicas, naming the degrees."""
    try:
        check_world(world_size, model_parallel)
    except ConfigError as exc:
        raise _refuse(f"{describe(model_parallel)} in a world of {world_size}", str(exc)) from exc


def check_beside_model_parallel(
    model_parallel: ModelParallel,
    virtual_ranks: int,
    sharding_degree_max: int,
    checkpoint_every_s: float,
) -> None:
    """Refuses what the session cannot run beside tensor or pipeline parallelism, naming the
    setting: ``SessionConfig`` and a strategy's ``mp_degree`` alike (session_startup.py's
    ``_use_model_parallel``, which both pass through)."""
    if model_parallel.group_size == 1:
        return
    degrees = describe(model_parallel)
    if sharding_degree_max > 1:
        raise _refuse(f"sharding_degree_max={sharding_degree_max} with {degrees}", _WHY_MP_SHARDING)
    if virtual_ranks:
        raise _refuse(
            f"virtual_ranks={virtual_ranks} with {degrees}",
            "virtual ranks beside tensor or pipeline parallelism are not built",
        )
    if checkpoint_every_s > 0:
        raise _refuse(
            f"checkpoint every_s={checkpoint_every_s} with {degrees}",
            "each slice's writer would find a timed cadence due at its own steps, its store "
            "holding steps the other slices' lack; use every_steps",
        )


def check_pipeline_attached(
    model_parallel: ModelParallel, model: Any, scaler: Any, fleet_job: Any
) -> None:
    """Refuses what a pipeline by hand (``pp_degree`` > 1) cannot run: fleet's wrappers
    (``fleet_job``: what :func:`check_attached` found), ``paddle.DataParallel`` (its reducer
    averages, and a stage before the last runs its backward from a received gradient) and an
    AMP ``GradScaler`` (the stages' scaling is not built nor checked)."""
    if model_parallel.pp_degree == 1:
        return
    import paddle

    pp = describe(model_parallel)
    what = (
        "fleet's wrappers"
        if fleet_job is not None
        else "paddle.DataParallel"
        if isinstance(model, paddle.DataParallel)
        else "an AMP GradScaler"
        if scaler is not None
        else ""
    )
    if what:
        raise _refuse(
            f"{what} with {pp}",
            "a pipeline by hand runs each stage's plain model, session.step sums its "
            "gradients over the stage's data-parallel group and the loss is not scaled: "
            "attach the stage's plain model, without a scaler",
        )


def layout_degrees(
    world_size: int, sharding_degree_max: int, model_parallel: ModelParallel
) -> tuple[int, int]:
    """``(dp_degree, sharding_degree)`` of a generation: :func:`degrees`, or with tensor
    parallelism the replicas and no sharding (a ConfigError for a world that is not whole
    replicas, a refusal for a sharding cap above 1)."""
    if model_parallel.group_size == 1:
        return degrees(world_size, sharding_degree_max)
    if sharding_degree_max > 1:
        raise _refuse(
            f"sharding_degree_max={sharding_degree_max} with {describe(model_parallel)}",
            _WHY_MP_SHARDING,
        )
    return check_world(world_size, model_parallel), 1


def _check_degrees(
    configs: Any,
    world_size: int | None,
    sharding_degree_max: int = 0,
    model_parallel: ModelParallel | None = None,
) -> tuple[int, int]:
    """Refuses pipeline and sequence parallelism, a tensor-parallel degree other than the
    job's ``model_parallel``, and degrees other than the rule's for ``world_size`` (None: the
    script's own strategy, whose dp_degree is refused: the rule sets it). Returns the (dp,
    sharding) degrees checked (the rule's)."""
    model_parallel = model_parallel or ModelParallel()
    stated = model_parallel_of(configs)
    if stated.mp_degree != model_parallel.mp_degree:
        raise _refuse(
            f"mp_degree={stated.mp_degree}",
            f"this job's tensor-parallel degree is {model_parallel.mp_degree} "
            "(SessionConfig.model_parallel, or the strategy given to session.fleet_strategy())",
        )
    if world_size is None:
        dp = _get(configs, "dp_degree")
        if dp > 1:
            raise _refuse(
                f"dp_degree={dp} in the script's strategy",
                "Tide sets the data-parallel and sharding degrees of each generation; cap "
                "the sharding degree with SessionConfig.sharding_degree_max instead",
            )
        return 1, 1
    want = layout_degrees(world_size, sharding_degree_max, model_parallel)
    got = (_get(configs, "dp_degree"), _get(configs, "sharding_degree"))
    if got != want:
        raise _refuse(
            f"dp_degree={got[0]} x sharding_degree={got[1]} in a world of {world_size}",
            f"the degrees of this generation are dp_degree={want[0]} x "
            f"sharding_degree={want[1]} (sharding_degree_max={sharding_degree_max}; take "
            "the strategy from session.fleet_strategy())",
        )
    return want


def _check_sharding_configs(strategy: Any) -> None:
    cfg = strategy.hybrid_configs["sharding_configs"]
    for name, why in (
        ("split_param", _WHY_SPLIT),
        ("tensor_fusion", "fused buffers hold the slots, not the parameters"),
        ("comm_overlap", "fused buffers hold the gradients"),
    ):
        if bool(getattr(cfg, name, False)):
            raise _refuse(f"sharding_configs.{name}=True", why)


def fleet_strategy(
    world_size: int,
    strategy: Any = None,
    sharding_degree_max: int = 0,
    model_parallel: ModelParallel | None = None,
) -> Any:
    """The ``fleet.DistributedStrategy`` of a generation of ``world_size`` ranks: the
    script's own (or a new one) with the degrees of :func:`layout_degrees`
    (``model_parallel``: the job's tensor-parallel degree, its replicas elastic). Raises
    :class:`UnsupportedLayout` for a degree or sharding option Tide cannot resize."""
    from paddle.distributed import fleet

    model_parallel = model_parallel or ModelParallel()
    if model_parallel.pp_degree > 1:
        raise _refuse(
            f"a fleet strategy with SessionConfig.model_parallel's {describe(model_parallel)}",
            "the stages of a pipeline by hand run without fleet (fleet_strategy would set "
            "pp_degree to 1, and fleet's own pipeline is refused: " + _WHY_PP + ")",
        )
    strategy = strategy if strategy is not None else fleet.DistributedStrategy()
    mine = dict(strategy.hybrid_configs)
    if model_parallel.group_size > 1 and _get(mine, "mp_degree") == 1:
        # The degree stated in SessionConfig.model_parallel alone: the strategy gets it.
        mine["mp_degree"] = model_parallel.mp_degree
    _check_degrees(
        {k: mine[k] for k in ("mp_degree", "pp_degree", "sep_degree", "dp_degree")},
        None,
        model_parallel=model_parallel,
    )
    if model_parallel.group_size > 1 and _get(mine, "sharding_degree") > 1:
        # Not set to 1 silently: the script asked for a sharded optimizer.
        raise _refuse(
            f"sharding_degree={_get(mine, 'sharding_degree')} in the strategy with "
            f"mp_degree={model_parallel.mp_degree}",
            _WHY_MP_SHARDING,
        )
    _check_sharding_configs(strategy)
    dp, sharding = layout_degrees(world_size, sharding_degree_max, model_parallel)
    strategy.hybrid_configs = {
        "dp_degree": dp,
        "mp_degree": model_parallel.mp_degree,
        "pp_degree": 1,
        "sep_degree": 1,
        "sharding_degree": sharding,
    }
    return strategy


def optimizer_chain(optimizer: Any) -> Iterator[Any]:
    """``optimizer`` and the optimizers it wraps (fleet's wrappers keep ``_inner_opt``), at
    most 8 deep, outermost first. Lazily: a caller that stops at the one it looks for never
    asks that one for ``_inner_opt`` (fleet's sharding optimizer forwards a missing
    attribute to its own ``_inner_opt``, endlessly when it has none)."""
    seen = 0
    while optimizer is not None and seen < 8:
        yield optimizer
        optimizer, seen = getattr(optimizer, "_inner_opt", None), seen + 1


@dataclass(frozen=True)
class Attached:
    """What a generation of a fleet job runs: its degrees, and for a sharded optimizer (a
    sharding degree above 1) what gathers its state."""

    dp_degree: int
    sharding_degree: int
    sharded: Sharded | None


def check_attached(
    model: Any,
    optimizer: Any,
    world_size: int,
    sharding_degree_max: int = 0,
    model_parallel: ModelParallel | None = None,
) -> Attached | None:
    """What Tide resizes about the attached model and optimizer: an :class:`Attached` for a
    fleet job (its ``sharded`` set for fleet's stage 1), None for a plain (or
    ``paddle.DataParallel``) job; raises :class:`UnsupportedLayout` for what it cannot
    resize."""
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

    if isinstance(model, GroupShardedStage3):
        raise _refuse("sharding stage 3 (GroupShardedStage3)", _WHY_STAGE3)
    if isinstance(model, GroupShardedStage2):
        raise _refuse("sharding stage 2 (GroupShardedStage2)", WHY_STAGE2)
    chain = list(optimizer_chain(optimizer)) if optimizer is not None else []
    for opt in chain:
        if isinstance(opt, GroupShardedOptimizerStage2):
            raise _refuse("sharding stage 2 (GroupShardedOptimizerStage2)", WHY_STAGE2)
        if isinstance(opt, dso.DygraphShardingOptimizerV2):
            raise _refuse("sharding_configs.split_param=True", _WHY_SPLIT)
    sharding_opt = next((o for o in chain if isinstance(o, dso.DygraphShardingOptimizer)), None)
    if not any(isinstance(o, hpo.HybridParallelOptimizer) for o in chain):
        return (
            None
            if sharding_opt is None
            else Attached(1, world_size, Sharded(sharding_opt, world_size))
        )
    from paddle.distributed import fleet

    hcg = fleet.get_hybrid_communicate_group()
    dp, degree = _check_degrees(
        {
            "mp_degree": hcg.get_model_parallel_world_size(),
            "pp_degree": hcg.get_pipe_parallel_world_size(),
            "sep_degree": hcg.get_sep_parallel_world_size(),
            "dp_degree": hcg.get_data_parallel_world_size(),
            "sharding_degree": hcg.get_sharding_parallel_world_size(),
        },
        world_size,
        sharding_degree_max,
        model_parallel,
    )
    _check_sharding_configs(fleet.fleet._user_defined_strategy)
    if sharding_opt is None or degree == 1:
        # Plain data parallel under fleet's wrapper: every rank's state is whole.
        return Attached(dp, degree, None)
    # The first data-parallel replica's sharding group, by sharding rank: the ranks whose
    # shards make up the whole state (every replica holds the same ones).
    sources = sorted(hcg.topology().get_axis_list("data", 0))
    return Attached(dp, degree, Sharded(sharding_opt, sources))


def check_data_parallel_group(model: Any, layout: RankLayout) -> None:
    """A tensor-parallel job's ``paddle.DataParallel`` must reduce over the ranks holding
    this rank's slice (``layout.dp_ranks``): over the whole world (no ``group``) its
    reducer would average the tensor ranks' gradients of different slices together, with
    no error when the slices have equal shapes."""
    import paddle

    if layout.model.group_size == 1 or not isinstance(model, paddle.DataParallel):
        return
    group = getattr(model, "group", None)
    ranks = list(getattr(group, "ranks", None) or []) if group is not None else None
    if ranks != layout.dp_ranks:
        over = "the whole world" if group is None else f"ranks {ranks}"
        raise _refuse(
            f"paddle.DataParallel over {over} with mp_degree={layout.model.mp_degree}",
            f"its reducer averages each gradient over that group, while rank {layout.rank}'s "
            f"slice is held by ranks {layout.dp_ranks}: pass group=session.dp_group, or "
            "attach the plain model (session.step sums over that group)",
        )


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

    def __init__(self, sharding_optimizer: Any, sources: list[int] | int) -> None:
        """``sources``: the global ranks of one sharding group (an int: ranks 0..n-1)."""
        self.optimizer = sharding_optimizer
        self.sources = list(range(sources)) if isinstance(sources, int) else list(sources)
        self.degree = len(self.sources)

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
        """One sharding group's shards of the optimizer state on every rank: one
        ``send_tensors`` per source rank, each over the whole world. A collective: every rank
        calls it at the same step."""
        import paddle

        started = time.monotonic()
        chunk = (settings or TransferSettings.from_env()).chunk_bytes
        own = optimizer.state_dict()
        mine = _arrays(model, own)
        merged: dict[str, Any] = {}
        nbytes = 0
        for source in self.sources:
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
