"""Fleet's stage-1 gradient reduce and parameter broadcast, the small tensors bundled.

At each step, fleet's ``DygraphShardingOptimizer`` reduces every gradient to the rank that
owns its parameter (``reduce_gradients``) and, after the owners' update, broadcasts every
parameter from its owner (``_sharding_sync_parameters``), one collective a tensor. Each
costs a round trip over the group whatever its size, and a model holds many small tensors
(biases, norms): most of why a sharded step cost more than a data-parallel one
(docs/sharded.md has the figures). Fleet's own remedy, ``tensor_fusion``, keeps the slots in
fused buffers that Tide cannot reshard, and Tide refuses it.

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


def _bundled(
    tensors: Sequence[Any], chunk_bytes: int, collective: Any, fill: bool, take: bool
) -> None:
    """``collective(tensor)`` once per bundle of ``tensors`` (runs of one dtype, cut by
    :func:`bundles`): a lone tensor as it is; several through one flat buffer, filled from
    them where ``fill`` (else left empty, for a collective that writes it) and copied back
    into them where ``take``. Every rank of the group cuts the same bundles."""
    import paddle

    for run in runs_by_dtype(tensors):
        for bundle in bundles([_nbytes(t) for t in run], chunk_bytes):
            ts = [run[i] for i in bundle]
            if len(ts) == 1:
                collective(ts[0])
                continue
            sizes = [int(t.numel()) for t in ts]
            if fill:
                buf = paddle.concat([t.flatten() for t in ts])
            else:
                buf = paddle.empty([sum(sizes)], dtype=ts[0].dtype)
            collective(buf)
            if take:
                for t, piece in zip(ts, paddle.split(buf, sizes), strict=True):
                    paddle.assign(piece.reshape(t.shape), output=t)


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
            _bundled(
                [p for p in params if optimizer._get_param_grad(p) is not None],
                chunk_bytes,
                lambda t, src=src: dist.broadcast(t, src=src, group=group, sync_op=True),
                fill=rank == me,
                take=rank != me,
            )


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
            _bundled(
                grads,
                chunk_bytes,
                lambda t, dst=dst: dist.reduce(t, dst=dst, op=op, group=group, sync_op=True),
                fill=True,
                take=rank == me,
            )


def install(optimizer: Any, settings: TransferSettings | None = None) -> None:
    """Make ``optimizer`` (fleet's ``DygraphShardingOptimizer``, without ``tensor_fusion``
    or broadcast overlap, which Tide refuses) reduce its gradients and broadcast its
    parameters bundled."""
    if getattr(optimizer, INSTALLED, False):
        return
    if getattr(optimizer, "tensor_fusion", False) or getattr(
        optimizer, "_broadcast_overlap", False
    ):
        raise ValueError("fused_sync.install: tensor_fusion and broadcast overlap are refused")
    chunk_bytes = (settings or TransferSettings.from_env()).chunk_bytes

    def _sync(self: Any) -> None:
        sync_parameters(self, chunk_bytes)

    def _reduce(self: Any, parameter_list: Any, hcg: Any) -> None:
        reduce_gradients(self, list(parameter_list), chunk_bytes)

    optimizer._sharding_sync_parameters = types.MethodType(_sync, optimizer)
    # Process-wide modes, set before training starts: read once here, not at every step.
    if not _fleet_reduce_only():
        optimizer.reduce_gradients = types.MethodType(_reduce, optimizer)
    setattr(optimizer, INSTALLED, True)
