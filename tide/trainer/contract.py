"""What a training script must do, checked: the calls' order, the loss's reduction, and that
the batch the model saw is the batch the session planned (docs/trainer.md, "The contract").

Each check fails at the first step it can, before the step's backward, with an error that
says what to do: a guarantee that cannot hold stops the job instead of bending silently.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tide.base.errors import FailedPrecondition, InvalidArgument
from tide.trainer.sampler import MicroBatch

FORGOTTEN_SAMPLER = "the DataLoader does not use session.batch_sampler()"


class ContractError(FailedPrecondition):
    """The script broke the session's contract; the message says how to fix it."""


class UsageError(ContractError):
    """A session method was called in the wrong order or once too often."""


class BatchMismatch(ContractError):
    """The batch the loader delivered is not the one the session planned."""


class LossContractError(ContractError, InvalidArgument):
    """``session.step`` got a loss whose reduction it cannot weight correctly."""


class Phase(enum.IntEnum):
    SETUP = 0
    TRAINING = 1
    FINISHED = 2


CANONICAL_ORDER = (
    "session = ElasticSession.from_env(config); build the model and optimizer; "
    "session.init_process_group(warmup=...); session.attach(model, optimizer, lr, scaler); "
    "session.restore(); for batch in DataLoader(dataset, batch_sampler=session.batch_sampler()): "
    "session.step(loss); session.finish()"
)


class Lifecycle:
    """The order of a session's calls (docs/trainer.md shows it): each call checks that the
    ones it needs came first, and once only."""

    def __init__(self) -> None:
        self.phase = Phase.SETUP
        self.attached = False
        self.grouped = False

    def _fail(self, what: str) -> UsageError:
        return UsageError(f"{what}. The order is: {CANONICAL_ORDER}")

    def attach(self) -> None:
        if self.attached:
            raise self._fail(
                "session.attach() was called twice: attach the model, optimizer, LR scheduler "
                "and scaler once (wrap the model in paddle.DataParallel before that call)"
            )
        if self.phase is not Phase.SETUP:
            raise self._fail("session.attach() after session.restore(): attach before restoring")
        self.attached = True

    def init_process_group(self) -> None:
        if self.grouped:
            raise self._fail("session.init_process_group() was called twice")
        if self.phase is not Phase.SETUP:
            raise self._fail(
                "session.init_process_group() after session.restore(): join the group first"
            )
        self.grouped = True

    def restore(self) -> None:
        if self.phase is not Phase.SETUP:
            raise self._fail("session.restore() was called twice")
        if not self.grouped:
            raise self._fail("session.restore() before session.init_process_group()")
        if not self.attached:
            raise self._fail(
                "session.restore() before session.attach(model, optimizer, ...): "
                "the restore loads into what was attached"
            )
        self.phase = Phase.TRAINING

    def training(self, call: str) -> None:
        """``call`` needs a restored session that has not finished."""
        if self.phase is Phase.SETUP:
            raise self._fail(f"{call} before session.restore(): restore first")
        if self.phase is Phase.FINISHED:
            raise self._fail(f"{call} after session.finish()")

    def finish(self) -> None:
        self.training("session.finish()")
        self.phase = Phase.FINISHED


# -- the loss ---------------------------------------------------------------------------------

# The autograd nodes of a mean over the micro-batch (``paddle.mean``, a loss's default
# ``reduction="mean"``); those a mean passes through unchanged; those that add means (a
# loss plus a weighted auxiliary loss is still a mean over the batch); and those that scale
# by a constant (over a sum: the API's older form, a sum divided by the global batch).
_MEAN_NODES = frozenset({"MeanAllGradNode", "MeanGradNode"})
_TRANSPARENT_NODES = frozenset({"CastGradNode"})
_SUM_OF_MEANS = frozenset({"AddGradNode", "SubtractGradNode"})
_SCALED = frozenset({"ScaleGradNode", "DivScaleGradNode"})

_HOW = (
    "pass the micro-batch's mean (a loss's default reduction='mean') or its per-sample "
    "losses (reduction='none', one value per sample of the batch); the session weights "
    "them by the batch's share of the global batch itself"
)


def where(mb: MicroBatch) -> str:
    return f"step {mb.step} (micro-batch {mb.index + 1} of {mb.count})"


def _is_mean(node: Any, in_sum: bool = False, depth: int = 0) -> bool:
    """Whether autograd ``node`` made a mean over the batch: a mean, or a sum of means
    where each term may carry a constant weight (a scaled mean at the top is refused:
    ``mean / accumulation_steps`` is a mistake the session cannot tell from a choice)."""
    if node is None or depth > 16:
        return False
    name = node.name()
    inputs = [n for n in node.next_functions if n is not None]
    if name in _MEAN_NODES:
        return True
    if name in _TRANSPARENT_NODES or (in_sum and name in _SCALED):
        return len(inputs) == 1 and _is_mean(inputs[0], in_sum, depth + 1)
    if name in _SUM_OF_MEANS:
        return bool(inputs) and all(_is_mean(n, True, depth + 1) for n in inputs)
    return False


def _last_op(loss: Any) -> str:
    node = getattr(loss, "grad_fn", None)
    while node is not None and node.name() in _TRANSPARENT_NODES:
        nxt = node.next_functions
        node = nxt[0] if len(nxt) == 1 else None
    return "" if node is None else str(node.name())


def _feeds_a_sum(loss: Any) -> bool:
    node = getattr(loss, "grad_fn", None)
    return node is not None and any(
        n is not None and n.name() == "SumGradNode" for n in node.next_functions
    )


def weighted_loss(loss: Any, mb: MicroBatch) -> Any:
    """The micro-batch's term of the global batch's mean loss (a 0-d tensor to backward).

    Per-sample losses (``numel`` = the batch's samples): their sum over the global batch's
    size, so no reduction of the script's can be wrong. A scalar must be a mean over the
    batch, which its autograd graph shows (``paddle.mean`` or a loss's
    ``reduction="mean"``, or a sum of such means each with a constant weight); anything
    else (a sum, a sum over the global batch as an older form of this API took, a scaled
    or class-weighted mean) is refused before the backward."""
    n = len(mb.local_indices)
    shape = [int(d) for d in loss.shape]
    numel = 1
    for d in shape:
        numel *= d
    if shape and numel == n and max(shape) == numel:
        # [n] or [n, 1]: one loss per sample.
        share = 0.0 if mb.padding else 1.0 / mb.global_batch_size
        return loss.sum() * share
    if numel != 1:
        raise LossContractError(
            f"{where(mb)}: session.step() got a loss of shape {shape} for a batch of {n} "
            f"samples: {_HOW}"
        )
    if _is_mean(getattr(loss, "grad_fn", None)):
        return loss * mb.weight
    op = _last_op(loss)
    if op in _SCALED and _feeds_a_sum(loss):
        raise LossContractError(
            f"{where(mb)}: session.step() got a summed loss divided by a constant (its "
            "last operation divides a sum). That was this API's older form (sum over the "
            "batch / global batch); session.step() now takes the mean over the micro-batch "
            f"instead, and refuses other reductions: {_HOW}"
        )
    what = f"whose last operation is {op}" if op else "that autograd cannot trace"
    raise LossContractError(
        f"{where(mb)}: session.step() got a scalar loss {what}, not a mean over the "
        f"batch, so its weight in the global batch cannot be checked: {_HOW} (a sum of "
        "means, each with a constant weight, is a mean too; regularisers go into the "
        "optimizer's weight_decay; F.nll_loss computes its mean inside one kernel: pass "
        "its reduction='none')"
    )


# -- the batch delivered ------------------------------------------------------------------------


@dataclass(frozen=True)
class Drawn:
    """A batch the session's batch sampler handed to a loader, in order."""

    step: int
    index: int
    ids: tuple[int, ...]


class Deliveries:
    """Which batches reached the training loop, checked against the plan at every step.

    The session's batch sampler records each batch it hands to a loader (a DataLoader
    delivers them in that order); ``session.plans()`` records the micro-batch it yields;
    a script may also pass the indices its batch carries. ``check`` pairs the step's
    micro-batch with what was delivered for it, or raises before its backward."""

    def __init__(self) -> None:
        self._drawn: deque[Drawn] = deque()
        self._planned: tuple[int, int] | None = None
        # The sampler's current pass, the batches stepped since it began, and whether the
        # session is done: the gate a loader thread's fetch waits at (tide/trainer/dataloader.py).
        self._turn = threading.Condition()
        self.run = 0
        self._stepped = 0
        self._closed = False

    def start(self) -> int:
        """A loader began a new pass over the sampler: batches drawn before are dropped
        with the iterator that drew them."""
        with self._turn:
            self._drawn.clear()
            self.run += 1
            self._stepped = 0
            self._turn.notify_all()
            return self.run

    def stepped(self) -> None:
        """The training loop is done with a batch, the next one prepared: the next fetch
        may run."""
        with self._turn:
            self._stepped += 1
            self._turn.notify_all()

    def close(self) -> None:
        with self._turn:
            self._closed = True
            self._turn.notify_all()

    def wait_turn(self, run: int, seq: int, stopped: Callable[[], bool]) -> None:
        """Block a loader thread's fetch of batch ``seq`` of pass ``run`` until the loop
        stepped ``seq`` batches of it, so the fetch never draws from Paddle's global RNG
        while the loop does; a stale pass, a closed session or a stopped loader passes."""
        with self._turn:
            while self._stepped < seq and run == self.run and not self._closed and not stopped():
                self._turn.wait(0.05)

    def drawn(self, step: int, index: int, ids: Sequence[int]) -> None:
        self._drawn.append(Drawn(step, index, tuple(ids)))

    def planned(self, mb: MicroBatch) -> None:
        self._planned = (mb.step, mb.index)

    def check(self, mb: MicroBatch, indices: Any = None) -> list[int]:
        """The sample ids of ``mb`` as delivered; raises if they are not the planned ones.
        :meth:`consumed` marks the batch used once its step went through."""
        plan = [int(i) for i in mb.local_indices]
        at = where(mb)
        if indices is not None:
            got = [int(i) for i in _flat(indices)]
            if got != plan:
                raise BatchMismatch(
                    f"{at}: the batch holds samples {_head(got)}, the session planned "
                    f"{_head(plan)}: {FORGOTTEN_SAMPLER}, or the dataset maps indices to "
                    "other samples. Build the loader as DataLoader(dataset, "
                    "batch_sampler=session.batch_sampler(), ...)"
                )
        if self._planned == (mb.step, mb.index):
            return plan
        if self._drawn:
            head = self._drawn[0]
            if (head.step, head.index) != (mb.step, mb.index):
                raise BatchMismatch(
                    f"{at}: the loader delivered the batch of step {head.step} "
                    f"(micro-batch {head.index + 1}): call session.step() once for every "
                    "batch the loader gives, in order, and do not share the batch sampler "
                    "between loaders"
                )
            return list(head.ids)
        if indices is not None:
            return plan
        raise BatchMismatch(
            f"{at}: no batch of this step came from session.batch_sampler(): "
            f"{FORGOTTEN_SAMPLER}. Build the loader as DataLoader(dataset, "
            "batch_sampler=session.batch_sampler(), ...), or loop over session.plans()"
        )

    def consumed(self, mb: MicroBatch) -> None:
        if self._planned == (mb.step, mb.index):
            self._planned = None
        elif self._drawn and (self._drawn[0].step, self._drawn[0].index) == (mb.step, mb.index):
            self._drawn.popleft()


def _flat(indices: Any) -> list[Any]:
    if hasattr(indices, "numpy"):
        indices = indices.numpy()
    if hasattr(indices, "reshape"):
        return list(indices.reshape(-1))
    return list(indices)


def _head(ids: list[int], n: int = 6) -> str:
    return str(ids) if len(ids) <= n else f"[{', '.join(map(str, ids[:n]))}, ...] ({len(ids)})"
