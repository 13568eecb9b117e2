"""Fleet's stage-1 gradient reduce and parameter broadcast, the small tensors bundled.

At each step, fleet's ``DygraphShardingOptimizer`` reduces every gradient to the rank that
owns its parameter (``reduce_gradients``) and, after the owners' update, broadcasts every
parameter from its owner (``_sharding_sync_parameters``), one collective a tensor. Each costs a round
trip over the group whatever its size, and a model holds many small tensors (biases, norms):
part of why a sharded step costs more than a data-parallel one (docs/sharded.md has the
figures). Fleet's own remedy, ``tensor_fusion``, keeps the slots in fused
buffers that Tide cannot reshard, and Tide refuses it.

:func:`install` replaces both methods on one optimizer with the same collectives bundled by
the transfer path's rule (tide/trainer/transfer.py ``bundles``: a tensor of
``BUNDLE_BELOW_BYTES`` or more alone, runs of smaller ones of one dtype together up to a
chunk), one collective a bundle. A broadcast copies bytes, so every rank ends each step with
the same parameters as the owners computed. A reduce sums the same numbers, scaled the same
way; only the order in which gloo adds a bundle's elements may differ from a lone tensor's,
which is the rounding every world size's sum already has (the parity tests' tolerance).
The rare paths of fleet's reduce (its NaN check, XPU's cluster sync, auto-parallel's align
mode) keep fleet's own method.
"""

from __future__ import annotations

import os
import types
from collections.abc import Sequence
from typing import Any

from tide.trainer.transfer import TransferSettings, bundles

# Set on an optimizer whose method this module replaced (installing twice is a no-op).
INSTALLED = "_tide_fused_sync"


def runs_by_dtype(params: Sequence[Any]) -> list[list[Any]]:
    """``params`` cut into runs of one dtype, in order (a bundle holds one dtype)."""
    out: list[list[Any]] = []
    for p in params:
        if out and out[-1][0].dtype == p.dtype:
            out[-1].append(p)
        else:
            out.append([p])
    return out


def _nbytes(p: Any) -> int:
    return int(p.numel()) * int(p.element_size())


def sync_parameters(optimizer: Any, chunk_bytes: int) -> None:
    """Every rank's parameters from their owners, as fleet's ``_sharding_sync_parameters``
    (the same parameters: those with a gradient on this rank), bundled."""
    import paddle
    import paddle.distributed as dist

    group = optimizer._hcg.get_sharding_parallel_group()
    me = optimizer._sharding_rank
    with paddle.no_grad():
        for rank, params in optimizer._rank2params.items():
            src = group.ranks[rank]
            todo = [p for p in params if optimizer._get_param_grad(p) is not None]
            for run in runs_by_dtype(todo):
                for bundle in bundles([_nbytes(p) for p in run], chunk_bytes):
                    ps = [run[i] for i in bundle]
                    if len(ps) == 1:
                        dist.broadcast(ps[0], src=src, group=group, sync_op=True)
                        continue
                    sizes = [int(p.numel()) for p in ps]
                    if rank == me:
                        buf = paddle.concat([p.flatten() for p in ps])
                    else:
                        buf = paddle.empty([sum(sizes)], dtype=ps[0].dtype)
                    dist.broadcast(buf, src=src, group=group, sync_op=True)
                    if rank == me:
                        continue
                    for p, piece in zip(ps, paddle.split(buf, sizes), strict=True):
                        paddle.assign(piece.reshape(p.shape), output=p)


def _fleet_reduce_only() -> bool:
    """Whether fleet's own per-tensor reduce must run (paths this module does not redo)."""
    import paddle

    dist: Any = paddle.distributed  # untyped: in_auto_parallel_align_mode
    flag = os.getenv("FLAGS_pp_check_naninf", "0")  # noqa: SIM112 (Paddle's own name)
    return bool(
        flag.lower() not in ("0", "", "false", "no", "off")
        or (paddle.device.is_compiled_with_xpu() and os.getenv("XPU_CDNN_CLUSTER_PARALLEL"))
        or dist.in_auto_parallel_align_mode()
    )


def reduce_gradients(optimizer: Any, parameter_list: Sequence[Any], chunk_bytes: int) -> None:
    """Every gradient summed onto its parameter's owner, as fleet's ``reduce_gradients``
    (a missing gradient made zeros first; scaled by 1/n and summed, or averaged where fleet
    averages), bundled."""
    import paddle
    import paddle.distributed as dist

    group = optimizer._hcg.get_sharding_parallel_group()
    me = optimizer._sharding_rank
    avg = bool(optimizer.use_reduce_avg)
    op = dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM
    by_owner: dict[int, list[Any]] = {}
    with paddle.no_grad():
        for param in parameter_list:
            g = optimizer._get_param_grad(param)
            if g is None:
                if hasattr(param, "main_grad"):
                    g = param.main_grad = paddle.zeros_like(param, dtype=paddle.float32)
                else:
                    g = param.grad = paddle.zeros_like(param, dtype=param.dtype)
            if not avg:
                g.scale_(1.0 / group.nranks)
            by_owner.setdefault(optimizer._param2rank[param.name], []).append(g)
        for rank, grads in sorted(by_owner.items()):
            dst = group.ranks[rank]
            for run in runs_by_dtype(grads):
                for bundle in bundles([_nbytes(g) for g in run], chunk_bytes):
                    gs = [run[i] for i in bundle]
                    if len(gs) == 1:
                        dist.reduce(gs[0], dst=dst, op=op, group=group, sync_op=True)
                        continue
                    sizes = [int(g.numel()) for g in gs]
                    buf = paddle.concat([g.flatten() for g in gs])
                    dist.reduce(buf, dst=dst, op=op, group=group, sync_op=True)
                    if rank != me:
                        continue
                    for g, piece in zip(gs, paddle.split(buf, sizes), strict=True):
                        paddle.assign(piece.reshape(g.shape), output=g)


def install(optimizer: Any, settings: TransferSettings | None = None) -> None:
    """Make ``optimizer`` (fleet's ``DygraphShardingOptimizer``, without ``tensor_fusion``
    or broadcast overlap, which Tide refuses) broadcast its parameters bundled."""
    if getattr(optimizer, INSTALLED, False):
        return
    if getattr(optimizer, "tensor_fusion", False) or getattr(
        optimizer, "_broadcast_overlap", False
    ):
        raise ValueError("fused_sync.install: tensor_fusion and broadcast overlap are refused")
    chunk_bytes = (settings or TransferSettings.from_env()).chunk_bytes

    fleet_reduce = optimizer.reduce_gradients

    def _sync(self: Any) -> None:
        sync_parameters(self, chunk_bytes)

    def _reduce(self: Any, parameter_list: Any, hcg: Any) -> None:
        if _fleet_reduce_only():
            fleet_reduce(parameter_list, hcg)
        else:
            reduce_gradients(self, list(parameter_list), chunk_bytes)

    optimizer._sharding_sync_parameters = types.MethodType(_sync, optimizer)
    optimizer.reduce_gradients = types.MethodType(_reduce, optimizer)
    setattr(optimizer, INSTALLED, True)
