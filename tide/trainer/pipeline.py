"""Pipeline parallelism by hand (``SessionConfig.model_parallel = ModelParallel(pp_degree=P)``):
one rank's stage of its replica's pipeline, and the activations and gradients it exchanges
with the adjacent stages (docs/sharded.md "Pipeline-parallel jobs").

Each replica is a whole pipeline of ``P`` stages (tide/trainer/layout.py: ``coord.pp``), every
stage of a replica on the same micro-batches (the sampler splits by replica). A script runs
each micro-batch forward through the stages in order and backward in reverse, with no overlap
between micro-batches (the simplest schedule; a stage waits while the others compute)::

    for mb in session.plans():                       # every stage: the sampler's batches
        x = session.pipeline.recv() if not session.pipeline.first else inputs(mb)
        out = stage(x)
        if session.pipeline.last:
            session.step(loss_fn(out, labels(mb)))    # the loss exists here only
        else:
            session.pipeline.send(out)
            session.step()                            # backward with the next stage's gradient

:meth:`Pipeline.recv` returns the previous stage's activation of the current micro-batch as a
leaf that takes a gradient; :meth:`Pipeline.send` hands this stage's output to the next stage.
``session.step`` on the last stage weighs the loss by the contract (tide/trainer/contract.py)
and runs its backward; on an earlier stage it receives the gradient of the output it sent and
runs the backward from it, so each stage's gradients are its share of the global batch's mean
loss. Every stage but the first then sends its input's gradient back. Each message is a
header (step, micro-batch, dtype, shape) and the tensor, each one broadcast over a group of
the two adjacent stages (gloo runs broadcast on the CPU); a header for another micro-batch is
refused, naming both, so stages out of step fail loudly instead of training on the wrong
activations. The gradient sum runs over each slice's data-parallel group (stepper.py); the
step's global mean loss is broadcast from the last stage over the replica's pipeline, so
``session.step`` returns it on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from tide.trainer.contract import UsageError
from tide.trainer.layout import RankLayout
from tide.trainer.sampler import MicroBatch

if TYPE_CHECKING:
    from tide.trainer.stepper import Stepper

# A message's dtype travels as its index here.
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32")
_MAX_DIMS = 8
# step, micro-batch index, dtype, number of dimensions, the dimensions.
_HEADER = 4 + _MAX_DIMS
# The dtype code of a header whose sender failed the micro-batch: no tensor follows, and the
# receiver raises naming the cause instead of stepping on (or timing out one collective on).
_FAILED = len(_DTYPES)


def _dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("paddle.")


def header(mb: MicroBatch, tensor: Any) -> np.ndarray:
    """The header of one message: whose micro-batch it is and the tensor's dtype and shape."""
    shape = [int(d) for d in tensor.shape]
    name = _dtype_name(tensor)
    if name not in _DTYPES:
        raise UsageError(f"a pipeline message of dtype {name}: only {', '.join(_DTYPES)} travel")
    if len(shape) > _MAX_DIMS:
        raise UsageError(f"a pipeline message of {len(shape)} dimensions: at most {_MAX_DIMS}")
    out = np.zeros(_HEADER, dtype=np.int64)
    out[:4] = (mb.step, mb.index, _DTYPES.index(name), len(shape))
    out[4 : 4 + len(shape)] = shape
    return out


def read_header(values: np.ndarray) -> tuple[int, int, str, list[int]]:
    """``(step, micro-batch index, dtype, shape)`` of a header made by :func:`header`."""
    step, index, dtype, ndim = (int(v) for v in values[:4])
    return step, index, _DTYPES[dtype], [int(d) for d in values[4 : 4 + ndim]]


class Pipeline:
    """One rank's stage: its neighbours' groups, the current micro-batch's input and output."""

    def __init__(
        self,
        layout: RankLayout,
        groups: Mapping[tuple[int, ...], Any],
        current: Callable[[], MicroBatch | None],
    ) -> None:
        """``groups``: the subgroups this rank formed, by their ranks (it forms every
        pipeline group and pair of adjacent stages, tide/trainer/layout.py ``all_groups``);
        ``current``: the micro-batch the next ``session.step`` is for."""
        self.stage = layout.coord.pp
        self.stages = layout.model.pp_degree
        self.ranks = layout.pipeline_ranks
        self.rank = layout.rank
        s = self.stage
        self._whole = groups.get(tuple(self.ranks))
        self._prev = groups.get(tuple(self.ranks[s - 1 : s + 1])) if s > 0 else None
        self._next = groups.get(tuple(self.ranks[s : s + 2])) if s < self.stages - 1 else None
        # A missing group would make each broadcast the world's: a hang beyond two ranks.
        for name, group, wanted in (
            ("pipeline", self._whole, True),
            ("previous stage's", self._prev, s > 0),
            ("next stage's", self._next, s < self.stages - 1),
        ):
            if wanted and group is None:
                raise RuntimeError(f"rank {self.rank}: its {name} group was not formed")
        self._current = current
        # The current micro-batch's (step, index) and its received input / sent output.
        self._input: tuple[tuple[int, int], Any] | None = None
        self._output: tuple[tuple[int, int], Any] | None = None

    @property
    def first(self) -> bool:
        """This rank runs the first stage: it reads its inputs from the sampler's batch."""
        return self.stage == 0

    @property
    def last(self) -> bool:
        """This rank runs the last stage: it computes the loss."""
        return self.stage == self.stages - 1

    def _mb(self, what: str) -> MicroBatch:
        mb = self._current()
        if mb is None:
            raise UsageError(f"session.pipeline.{what} after the last step")
        return mb

    def recv(self) -> Any:
        """The previous stage's output of the current micro-batch: a leaf whose gradient
        ``session.step`` sends back."""
        mb = self._mb("recv()")
        if self.first:
            raise UsageError(
                "session.pipeline.recv() on the first stage: it has no previous stage; run "
                "it on the sampler's batch (mb.local_indices)"
            )
        if self._input is not None and self._input[0] == (mb.step, mb.index):
            raise UsageError(
                f"session.pipeline.recv() twice for micro-batch {mb.index} of step {mb.step}"
            )
        tensor = self._receive(mb, self.ranks[self.stage - 1], self._prev, "activation")
        tensor.stop_gradient = False
        self._input = ((mb.step, mb.index), tensor)
        return tensor

    def send(self, outputs: Any) -> None:
        """This stage's output of the current micro-batch, to the next stage; the backward
        ``session.step()`` runs starts from it."""
        mb = self._mb("send()")
        if self.last:
            raise UsageError(
                "session.pipeline.send() on the last stage: it has no next stage; pass the "
                "micro-batch's loss to session.step(loss)"
            )
        if self._output is not None and self._output[0] == (mb.step, mb.index):
            raise UsageError(
                f"session.pipeline.send() twice for micro-batch {mb.index} of step {mb.step}"
            )
        self._transmit(mb, outputs, self.rank, self._next)
        self._output = ((mb.step, mb.index), outputs)

    def check_step(self, mb: MicroBatch, loss: Any) -> None:
        """Before any backward: ``session.step`` got what this stage's backward needs."""
        at = (mb.step, mb.index)
        where = f"stage {self.stage} of {self.stages} (micro-batch {mb.index} of step {mb.step})"
        if self.last and loss is None:
            raise UsageError(
                f"session.step() without a loss on {where}: the last stage computes the "
                "micro-batch's loss and passes it, session.step(loss)"
            )
        if not self.last and loss is not None:
            raise UsageError(
                f"session.step(loss) on {where}: the loss exists on the last stage only; "
                "send this stage's output with session.pipeline.send(outputs) and call "
                "session.step() without a loss, its backward runs from the gradient the next "
                "stage sends back"
            )
        if not self.last and (self._output is None or self._output[0] != at):
            raise UsageError(
                f"session.step() on {where} before session.pipeline.send(outputs): the next "
                "stage needs this stage's output, and the backward starts from it"
            )
        if not self.first and (self._input is None or self._input[0] != at):
            raise UsageError(
                f"session.step() on {where} without session.pipeline.recv(): this stage's "
                "input is the previous stage's output, and its gradient goes back there"
            )

    def sent_gradient(self, mb: MicroBatch) -> tuple[Any, Any]:
        """A stage before the last: the output it sent and that output's gradient, from the
        next stage (the stepper runs the backward from them)."""
        assert self._output is not None
        outputs = self._output[1]
        grad = self._receive(mb, self.ranks[self.stage + 1], self._next, "gradient")
        if [int(d) for d in grad.shape] != [int(d) for d in outputs.shape]:
            raise UsageError(
                f"stage {self.stage}: the gradient of its output has shape {list(grad.shape)}, "
                f"the output {list(outputs.shape)}"
            )
        self._output = None
        return outputs, grad

    def send_input_grad(self, mb: MicroBatch) -> None:
        """A stage after the first, after its backward: its input's gradient, back."""

        if self.first:
            return
        assert self._input is not None
        tensor = self._input[1]
        if tensor.grad is None:
            # The loss did not depend on the input received (detached, through numpy, under
            # no_grad): the earlier stages would never train. The previous stage is told, so
            # that it fails naming this cause before its own step.
            why = (
                f"stage {self.stage}'s input from session.pipeline.recv() got no gradient in "
                f"micro-batch {mb.index} of step {mb.step}: the stage's output must be "
                "computed from that tensor itself (not detached, not through numpy, not "
                "under paddle.no_grad)"
            )
            failed = header(mb, tensor)
            failed[2] = _FAILED
            self._broadcast(failed, self.rank, self._prev)
            raise UsageError(why)
        self._transmit(mb, tensor.grad, self.rank, self._prev)
        self._input = None

    def share_loss(self, loss: float) -> float:
        """The step's global mean loss, which the last stage's sum found, on every stage."""
        import paddle
        import paddle.distributed as dist

        value = paddle.to_tensor([loss], dtype="float64")
        dist.broadcast(value, src=self.ranks[-1], group=self._whole)
        return float(value.numpy()[0])

    def _transmit(self, mb: MicroBatch, tensor: Any, source: int, group: Any) -> None:
        import paddle.distributed as dist

        self._broadcast(header(mb, tensor), source, group)
        dist.broadcast(tensor.detach(), src=source, group=group)

    def _broadcast(self, values: np.ndarray, source: int, group: Any) -> None:
        import paddle
        import paddle.distributed as dist

        dist.broadcast(paddle.to_tensor(values), src=source, group=group)

    def _receive(self, mb: MicroBatch, source: int, group: Any, what: str) -> Any:
        import paddle
        import paddle.distributed as dist

        received = paddle.zeros([_HEADER], dtype="int64")
        dist.broadcast(received, src=source, group=group)
        values = received.numpy()
        if int(values[2]) == _FAILED:
            raise UsageError(
                f"stage {self.stage}: rank {source} failed micro-batch {int(values[1])} of step "
                f"{int(values[0])} instead of sending the {what}: its input got no gradient "
                "(its own error says more)"
            )
        step, index, dtype, shape = read_header(values)
        if (step, index) != (mb.step, mb.index):
            raise UsageError(
                f"stage {self.stage} at micro-batch {mb.index} of step {mb.step} received "
                f"the {what} of micro-batch {index} of step {step} from rank {source}: every "
                "stage must run the session's micro-batches in order, each with one "
                "session.step"
            )
        tensor = paddle.empty(shape, dtype=cast(Any, dtype))
        dist.broadcast(tensor, src=source, group=group)
        return tensor


def backward(stepper: Stepper, pipe: Pipeline | None, mb: MicroBatch, term: Any) -> None:
    """``mb``'s backward on this rank, as ``session.step`` runs it: the stepper's (which puts
    a padding batch's buffers back), from ``term`` or, on a pipeline's stage before the last
    (``term`` None), from the gradient of the output it sent; then, on a stage after the
    first, its input's gradient back."""
    sent = pipe.sent_gradient(mb) if term is None and pipe is not None else None
    stepper.backward(mb, term, sent)
    if pipe is not None:
        pipe.send_input_grad(mb)
