"""One global step's arithmetic: micro-batches, the loss contract, the gradient sum, AMP.

**The loss contract** (tide/trainer/contract.py: ``weighted_loss``). ``session.step(loss)`` takes
what a stock Paddle loop computes, the *mean* loss over the micro-batch it just ran
(``F.cross_entropy(model(x), y)``), or the per-sample losses (``reduction="none"``). The
stepper weights a mean by the micro-batch's size over the global batch's, and divides the
sum of per-sample losses by the global batch's size, so that the gradients of all
micro-batches of all ranks *sum* to the gradient of the mean loss over the global batch,
whatever the world size; any other reduction is refused:

- with the session's own sum (a plain model), one ``all_reduce(SUM)`` of every gradient,
  the step's loss and the virtual ranks' state, as one flat tensor;
- with ``paddle.DataParallel``, whose reducer *averages* over the ``W`` ranks, the weight
  is multiplied by ``W`` first; every micro-batch but a rank's last of the step runs with
  the reducer off (``grad_need_sync``, what ``no_sync()`` sets), so every rank launches the
  reducer's all-reduces exactly once per step, however many micro-batches it runs;
- with fleet's sharded optimizer (tide/trainer/sharding.py), whose ``step()`` reduces each
  gradient to its owner as an *average* (scaled by 1/W, then summed), the weight is
  multiplied by ``W`` too, and the session's sum carries the loss alone;
- in a model-parallel job (tide/trainer/layout.py: each replica a whole tensor/pipeline
  group), the sums run over this rank's data-parallel group (the ranks holding its slice,
  one per replica), ``W`` being the number of replicas: with a plain model (tensor
  parallelism by hand) the session's sum, with fleet's ``TensorParallel`` and
  ``HybridParallelOptimizer`` (whose ``step()`` averages over that group) the weight times
  the replicas.

**Virtual ranks** (a fixed logical data-parallel degree ``V``, EasyScale's approach): the
global batch is cut into ``V`` micro-batches whatever the world size, and each keeps its
own model buffers (BatchNorm's running mean and variance) and its own RNG stream (seeded
from seed, step, virtual rank and chunk, so dropout draws the same masks in any world).
Every physical rank holds all ``V`` buffer sets: the ranks' own rows travel in the step's
all-reduce, zeros elsewhere, which adds them exactly. A checkpoint or a handover from any
rank therefore has them all, and the model's own buffers in a checkpoint are virtual
rank 0's.

**AMP**: with a ``paddle.amp.GradScaler`` the weighted loss is scaled before backward, the
summed gradients are unscaled, and the overflow flag is all-reduced (MAX) before the
scaler decides, so every rank skips or applies the same steps. (After the sum the ranks'
gradients are equal, so they would agree anyway; the all-reduce makes it a rule instead of
a consequence.) The scaler's state is checkpointed.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import numpy as np

from tide.trainer.contract import weighted_loss
from tide.trainer.sampler import MicroBatch, derive_seed
from tide.trainer.sharding import optimizer_chain

VIRTUAL = "virtual.npy"


def micro_seed(seed: int, step: int, virtual_rank: int, index: int) -> int:
    """The RNG seed of one virtual micro-batch: a function of where it sits, not of who
    runs it."""
    return derive_seed(seed, step, virtual_rank, index)


def _sharded(optimizer: Any) -> bool:
    """``optimizer`` is (or wraps) fleet's ``DygraphShardingOptimizer``."""
    return any(type(o).__name__ == "DygraphShardingOptimizer" for o in optimizer_chain(optimizer))


def _hybrid(model: Any, optimizer: Any) -> bool:
    """A fleet tensor-parallel job: the model is fleet's ``TensorParallel`` and the optimizer
    fleet's ``HybridParallelOptimizer``, whose ``step()`` averages the gradients over the
    data-parallel group."""
    return type(model).__name__ == "TensorParallel" and any(
        type(o).__name__ == "HybridParallelOptimizer" for o in optimizer_chain(optimizer)
    )


class Stepper:
    def __init__(
        self,
        model: Any,
        optimizer: Any,
        lr_scheduler: Any,
        scaler: Any,
        world_size: int,
        virtual_ranks: int,
        seed: int,
        dp_degree: int = 0,
        dp_group: Any = None,
        layout_files: Mapping[str, bytes] | None = None,
    ) -> None:
        import paddle

        self.model = model
        self.optimizer = optimizer
        self.lr = lr_scheduler
        self.scaler = scaler
        self.world_size = world_size
        # Who the gradients are summed over: the replicas (a model-parallel job's
        # data-parallel group, ``dp_group``; None: the world), dp_degree of them.
        self.dp_degree = dp_degree or world_size
        self.dp_group = dp_group
        # A model-parallel job's layout file (tide/trainer/slices.py), in every state.
        self.layout_files = dict(layout_files or {})
        self.virtual_ranks = virtual_ranks
        self.seed = seed
        self.data_parallel = isinstance(model, paddle.DataParallel)
        # Who sums the gradients: the session (a plain model), or the framework, as an
        # average over the ranks (DataParallel's reducer, the sharded optimizer's step).
        self.framework_averages = (
            self.data_parallel or _sharded(optimizer) or _hybrid(model, optimizer)
        )
        # The model's state that is not trained: buffers, and the parameters that take no
        # gradient (Paddle's BatchNorm keeps its running mean and variance as those).
        self._buffers = [
            *(p for p in model.parameters() if p.stop_gradient),
            *(b for b in model.buffers() if b is not None),
        ]
        self._sizes = [int(np.prod(b.shape)) if b.shape else 1 for b in self._buffers]
        width = sum(self._sizes)
        self.virtual: np.ndarray | None = None
        if virtual_ranks:
            live = self._read_buffers()
            self.virtual = np.tile(live, (virtual_ranks, 1)) if width else None
        self._loss_sum = 0.0
        self._ran: set[int] = set()
        self._snapshot: np.ndarray | None = None
        self.last_reduce_s = 0.0
        # The last optimizer step (with the scaler and LR scheduler), seconds.
        self.last_optimizer_s = 0.0

    # -- buffers --------------------------------------------------------------------------

    def _read_buffers(self) -> np.ndarray:
        if not self._buffers:
            return np.zeros(0, dtype=np.float32)
        return np.concatenate([b.numpy().astype(np.float32).reshape(-1) for b in self._buffers])

    def _write_buffers(self, flat: np.ndarray) -> None:
        import paddle

        offset = 0
        for b, n in zip(self._buffers, self._sizes, strict=True):
            value = flat[offset : offset + n].reshape(b.shape).astype(b.numpy().dtype)
            b.set_value(paddle.to_tensor(value))
            offset += n

    def use_virtual_rank_0(self) -> np.ndarray | None:
        """Put virtual rank 0's buffers into the model (for a checkpoint or the final
        model); returns the live ones, to put back with :meth:`put_back`."""
        if self.virtual is None:
            return None
        live = self._read_buffers()
        self._write_buffers(self.virtual[0])
        return live

    def put_back(self, live: np.ndarray | None) -> None:
        if live is not None:
            self._write_buffers(live)

    # -- a micro-batch ----------------------------------------------------------------------

    def prepare(self, mb: MicroBatch) -> None:
        """Before the script's forward of ``mb``: reducer on for a rank's last micro-batch
        only, the virtual rank's buffers and RNG in place, a padding batch's buffers kept."""
        import paddle

        if self.data_parallel:
            self.model.grad_need_sync = mb.last
        if mb.padding:
            self._snapshot = self._read_buffers()
        elif self.virtual is not None and mb.virtual_rank >= 0:
            self._write_buffers(self.virtual[mb.virtual_rank])
        if self.virtual_ranks and not mb.padding:
            paddle.seed(micro_seed(self.seed, mb.step, mb.virtual_rank, mb.chunk))

    def weighted(self, mb: MicroBatch, loss: Any) -> Any:
        """``mb``'s term of the global batch's mean loss (see the module docstring); raises
        (tide/trainer/contract.py) for a loss whose reduction it cannot weight, before any
        backward."""
        import paddle

        if loss is None:
            if self.data_parallel:
                raise ValueError("with paddle.DataParallel every micro-batch needs a loss")
            # No forward ran: zero gradients still join the sum.
            return paddle.add_n([p.sum() * 0.0 for p in self.model.parameters()])
        return weighted_loss(loss, mb)

    def backward(self, mb: MicroBatch, term: Any, sent: tuple[Any, Any] | None = None) -> None:
        """Backward of ``mb``'s weighted term (:meth:`weighted`); on a pipeline's stage before
        the last (``term`` None), from ``sent``: the output this stage sent and its gradient,
        which the next stage sent back weighted already (tide/trainer/pipeline.py). Either
        way a padding batch's buffers are put back after it."""
        if term is None:
            import paddle

            assert sent is not None, "a backward needs a term or a sent output's gradient"
            outputs, grad = sent
            paddle.autograd.backward([outputs], [grad])
        else:
            if not mb.padding:
                self._loss_sum += float(term)
            # DataParallel's reducer averages over the replicas: the term times their number
            # makes it a sum.
            weighted = term * self.dp_degree if self.framework_averages else term
            if self.scaler is not None:
                weighted = self.scaler.scale(weighted)
            weighted.backward()
        if mb.padding:
            if self._snapshot is not None:
                self._write_buffers(self._snapshot)
            self._snapshot = None
        elif self.virtual is not None and mb.virtual_rank >= 0:
            self.virtual[mb.virtual_rank] = self._read_buffers()
            self._ran.add(mb.virtual_rank)

    def apply(self) -> float:
        """The step's sum over ranks and the optimizer step; returns the global loss."""
        import time

        import paddle

        extras = [np.array([self._loss_sum], dtype=np.float32)]
        if self.virtual is not None:
            mine = np.zeros_like(self.virtual)
            ran_here = np.zeros(len(self.virtual), dtype=np.float32)
            for v in self._ran:
                mine[v] = self.virtual[v]
                ran_here[v] = 1.0
            extras += [ran_here, mine.reshape(-1)]
        extra = paddle.to_tensor(np.concatenate(extras))
        params = [] if self.framework_averages else self._grads()
        flat = paddle.concat([*(p.grad.reshape([-1]) for p in params), extra])
        started = time.monotonic()
        if self.dp_degree > 1:
            import paddle.distributed as dist

            dist.all_reduce(flat, group=self.dp_group)
        self.last_reduce_s = time.monotonic() - started
        offset = 0
        for p in params:
            n = int(np.prod(p.shape))
            p.grad.set_value(flat[offset : offset + n].reshape(p.grad.shape))
            offset += n
        tail = flat[offset:].numpy()
        loss = float(tail[0])
        if self.virtual is not None:
            # Rows of virtual ranks that ran nowhere this step (a tail smaller than V)
            # summed to zero: keep their old state.
            v = len(self.virtual)
            ran = tail[1 : 1 + v] > 0
            summed = tail[1 + v :].reshape(self.virtual.shape)
            self.virtual[ran] = summed[ran]
        stepped = time.monotonic()
        self._step_optimizer()
        self.last_optimizer_s = time.monotonic() - stepped
        self._loss_sum = 0.0
        self._ran = set()
        return loss

    def _grads(self) -> list[Any]:
        return [p for p in self.model.parameters() if p.grad is not None]

    def _step_optimizer(self) -> None:
        if self.scaler is None:
            self.optimizer.step()
        else:
            if self.scaler.is_enable():
                self.scaler.unscale_(self.optimizer)
                self._agree_overflow()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.optimizer.clear_grad()
        if self.lr is not None:
            self.lr.step()

    def _agree_overflow(self) -> None:
        """Every rank takes the overflow decision of any: MAX of the found-inf flags."""
        if self.world_size == 1:
            return
        import paddle
        import paddle.distributed as dist

        found = paddle.cast(self.scaler._found_inf, "int32").reshape([1])
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        self.scaler._found_inf = paddle.cast(found[0], "bool")

    # -- checkpoint files -------------------------------------------------------------------

    def state_files(self) -> dict[str, bytes]:
        if self.virtual is None:
            return dict(self.layout_files)
        buf = io.BytesIO()
        np.save(buf, self.virtual, allow_pickle=False)
        return {VIRTUAL: buf.getvalue(), **self.layout_files}

    def load(self, files: Mapping[str, bytes]) -> None:
        if self.virtual is not None and VIRTUAL in files:
            saved = np.load(io.BytesIO(files[VIRTUAL]), allow_pickle=False)
            if saved.shape == self.virtual.shape:
                self.virtual[...] = saved
            else:
                raise ValueError(
                    f"checkpoint has virtual state {saved.shape}, this run {self.virtual.shape}"
                )
