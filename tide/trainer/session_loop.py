"""ElasticSession's step loop: this rank's micro-batches, the current one, ``step(loss)``
and the step-boundary hook (logs, progress, periodic checkpoints, the stop-step agreement).

Its own room because it is the training's hot path and changes with the stepper and the
data contract; what the boundary does about checkpoints and control messages it asks of
session_checkpoints.py and session_control.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from tide.trainer.contract import UsageError
from tide.trainer.messages import Progress
from tide.trainer.pipeline import Pipeline, backward
from tide.trainer.sampler import MicroBatch, micro_batches
from tide.trainer.session_control import SessionControl


class _NoLoss:
    """session.step()'s loss when none was passed (None is a rank that ran no forward)."""

    def __repr__(self) -> str:
        return "<no loss>"


_NO_LOSS: Any = _NoLoss()


class SessionLoop(SessionControl):
    def micro_batches(self, step: int) -> list[MicroBatch]:
        """This rank's micro-batches of global step ``step``."""
        # By replica: every rank of a model-parallel replica trains on the same samples.
        return micro_batches(
            self.sampler.plan(step, self.dp_rank, self.dp_degree),
            self.dp_rank,
            self.dp_degree,
            self.config.virtual_ranks,
            self.config.accumulation_steps,
        )

    def _current(self) -> MicroBatch | None:
        """The micro-batch the script runs next, prepared; None when the budget is done."""
        if self.step_done >= self.config.max_steps:
            return None
        if self._micro is None or self._micro[0].step != self.step_done + 1:
            self._micro, self._mi = self.micro_batches(self.step_done + 1), 0
        mb = self._micro[self._mi]
        if self._prepared != (mb.step, mb.index):
            self.stepper.prepare(mb)
            self._prepared = (mb.step, mb.index)
        return mb

    @property
    def current(self) -> MicroBatch | None:
        """The micro-batch the next :meth:`step` call is for (a DataLoader loop can check
        its batch against it); None when the budget is done."""
        self.lifecycle.training("session.current")
        return self._current()

    @property
    def _counts_samples(self) -> bool:
        """Whether this rank logs and counts the samples it trains on: every rank of a
        model-parallel replica trains on the replica's, one of them counts them (the others
        log the step with no ids and a rate of 0)."""
        return self._model_parallel.group_size == 1 or self.layout.logs_samples

    @property
    def pipeline(self) -> Pipeline:
        """This rank's pipeline stage (``SessionConfig.model_parallel.pp_degree`` > 1): its
        ``recv()`` and ``send(outputs)`` for the activations of the current micro-batch
        (tide/trainer/pipeline.py)."""
        if self._model_parallel.pp_degree == 1:
            raise UsageError(
                "session.pipeline without pipeline parallelism: state the stages in "
                "SessionConfig.model_parallel = ModelParallel(pp_degree=...)"
            )
        self.lifecycle.training("session.pipeline")
        if self._pipeline is None:
            self._pipeline = Pipeline(self.layout, self._groups, self._current)
        return self._pipeline

    def plans(self) -> Iterator[MicroBatch]:
        """This rank's micro-batches, one by one, until the budget is done."""
        self.lifecycle.training("session.plans()")
        while (mb := self._current()) is not None:
            self.deliveries.planned(mb)
            yield mb
            if self._current() is mb:
                raise UsageError(f"step {mb.step}: call session.step(loss) inside the loop")

    def step(self, loss: Any = _NO_LOSS, indices: Any = None) -> float | None:
        """Backward of the current micro-batch's loss: its *mean*, or its per-sample losses
        (None: this rank ran no forward, plain models only); after a rank's last
        micro-batch of the step, the sum over ranks, the optimizer (and scaler, LR
        scheduler) step and the step-boundary hook. Returns the global batch's mean loss
        after the step's last micro-batch, else None. A pipeline's stage before the last
        passes no loss, ``session.step()``: its backward starts from the gradient of what it
        sent (tide/trainer/pipeline.py); anywhere else a step without a loss is refused.

        Before the backward it checks that the batch came from :meth:`batch_sampler` (or
        :meth:`plans`) for this very micro-batch, and ``indices``, the sample ids the batch
        carries, if given; and that the loss is a mean or per-sample (tide/trainer/contract.py)."""
        self.lifecycle.training("session.step()")
        mb = self._current()
        if mb is None:
            raise UsageError(
                f"session.step() after the last step ({self.config.max_steps}): end the loop "
                "when the batch sampler (or session.plans()) ends, then call session.finish()"
            )
        if loss is _NO_LOSS:
            if self._model_parallel.pp_degree == 1:
                # A forgotten argument would train on nothing while the samples were logged.
                raise UsageError(
                    "session.step() without a loss: pass the micro-batch's loss (its mean or "
                    "its per-sample losses), or None on a rank that ran no forward (plain "
                    "models). The loss became optional only for a pipeline's stages before "
                    "the last (SessionConfig.model_parallel pp_degree > 1)"
                )
            loss = None
        ids = self.deliveries.check(mb, indices)
        pipe = self.pipeline if self._model_parallel.pp_degree > 1 else None
        if pipe is not None:
            pipe.check_step(mb, loss)
        stepper = self.stepper
        if self.timings.first_step_at == 0.0 and not self._first_parts:
            self._first_parts["forward_s"] = time.monotonic() - self._first_step_started
        term = stepper.weighted(mb, loss) if pipe is None or pipe.last else None
        self.deliveries.consumed(mb)
        if not mb.padding:
            self._delivered.extend(ids)
        backward(stepper, pipe, mb, term)
        if self.timings.first_step_at == 0.0 and "backward_s" not in self._first_parts:
            self._first_parts["backward_s"] = (
                time.monotonic() - self._first_step_started - self._first_parts["forward_s"]
            )
        self._mi += 1
        if not mb.last:
            self._current()
            self.deliveries.stepped()
            return None
        assert self._micro is not None
        step_micro = self._micro
        applied = time.monotonic()
        self._global_loss = stepper.apply()
        if pipe is not None:
            self._global_loss = pipe.share_loss(self._global_loss)
        self._last_reduce_s = stepper.last_reduce_s
        if self.timings.first_step_at == 0.0:
            self._first_parts["apply_s"] = time.monotonic() - applied
            self._first_parts["reduce_s"] = stepper.last_reduce_s
            self._first_parts["optimizer_s"] = stepper.last_optimizer_s
        self._micro = None
        self._end_of_step(step_micro)
        self._current()
        self.deliveries.stepped()
        return self._global_loss

    def _end_of_step(self, micro: list[MicroBatch]) -> None:
        plan = micro[0]
        # What the loader delivered (checked equal to the plan), not the plan itself.
        ids, self._delivered = self._delivered, []
        self.step_done = plan.step
        now = time.monotonic()
        if self.timings.first_step_at == 0.0:
            self.timings.first_step_at = time.time()
            self._log.timing(
                "first_step",
                self.env.generation,
                self.rank,
                step=plan.step,
                pid=os.getpid(),
                first_step_s=time.monotonic() - self._first_step_started,
                first_reduce_s=self._last_reduce_s,
                first_parts=dict(self._first_parts),
                restart_started_at=self.env.restart_started_at,
                pod_rank=self.env.pod_rank,
                local_rank=self.env.local_rank,
                device=self.env.device,
                **asdict(self.timings),
            )
        # This worker's share: the coordinator sums its members' rates into the job's.
        if self._counts_samples:
            self._rate_samples += len(ids)
        if now - self._rate_t0 >= 1.0:
            self._samples_per_s = self._rate_samples / (now - self._rate_t0)
            self._rate_t0, self._rate_samples = now, 0
        self._log.step(
            plan.step,
            plan.epoch,
            self.env.generation,
            self.rank,
            self.world_size,
            ids if self._counts_samples else [],
            self._global_loss,
        )
        self._report_progress()
        if self._restored_unpersisted is not None and now >= self._restored_unpersisted[2]:
            self._persist_pending_restore()
        self._gathered = None
        due = self._periodic.due(plan.step, now)
        if due and self._sharded is not None:
            # Every rank: a step-based cadence (attach refuses a timed one) is due on all.
            self._gather_shards(plan.step)
        if self.writes_durable and due:
            self._write_checkpoint(plan.step, periodic=True)
        self._report_written()
        self._reserve_handover()
        self._drain_channel()
        stop_at, want_ckpt, want_exit = self._agree()
        if want_exit:
            self._exit()
        if stop_at and stop_at <= plan.step:
            self._hold(plan.step, want_ckpt)

    def _report_progress(self) -> None:
        pos = self.sampler.position(self.step_done)
        self.channel.send(
            Progress(
                step=self.step_done,
                epoch=pos.epoch,
                cursor=pos.cursor,
                samples_per_s=self._samples_per_s,
                first_step_at=self.timings.first_step_at,
            )
        )
