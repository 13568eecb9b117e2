"""Fleet's stage-1 parameter broadcast, the small tensors bundled.

After each step, fleet's ``DygraphShardingOptimizer`` broadcasts every parameter from the
rank that owns it, one collective a tensor (``_sharding_sync_parameters``). Each costs a round
trip over the group whatever its size, and a model holds many small tensors (biases, norms):
part of why a sharded step costs more than a data-parallel one (docs/sharded.md has the
figures). Fleet's own remedy, ``tensor_fusion``, keeps the slots in fused
buffers that Tide cannot reshard, and Tide refuses it.

:func:`install` replaces the method on one optimizer with the same broadcasts bundled by the
transfer path's rule (tide/trainer/transfer.py ``bundles``: a tensor of ``BUNDLE_BELOW_BYTES``
or more alone, runs of smaller ones of one dtype together up to a chunk), one collective a
bundle. A broadcast copies bytes, so every rank ends each step with the same parameters as
fleet's path would give them, bit for bit; only the number of round trips changes.
"""

from __future__ import annotations

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

    def _sync(self: Any) -> None:
        sync_parameters(self, chunk_bytes)

    optimizer._sharding_sync_parameters = types.MethodType(_sync, optimizer)
    setattr(optimizer, INSTALLED, True)
