"""ElasticSession's checkpoint cadence: the state serialised with its metadata, rank 0's
durable writes in the background (periodic, coordinated, or a restored state made durable
after the pause), and their reports to the launcher.

Its own room because it changes with the durable store and the handover, not with the loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from tide.base.errors import FailedPrecondition
from tide.trainer import paddle_state, rawstate
from tide.trainer.checkpoint import WrittenCheckpoint
from tide.trainer.messages import CheckpointWritten
from tide.trainer.persist import Snapshot
from tide.trainer.session_state import SessionState

logger = logging.getLogger(__name__)


class SessionCheckpoints(SessionState):
    def _meta(self, step: int, periodic: bool) -> dict[str, Any]:
        pos = self.sampler.position(step)
        return {
            "step": step,
            "epoch": pos.epoch,
            "cursor": pos.cursor,
            "generation": self.env.generation,
            "world_size": self.world_size,
            "seed": self.config.seed,
            "global_batch": self.config.global_batch,
            "periodic": periodic,
        }

    def _state_files(self, raw: bool = False) -> dict[str, bytes]:
        """This process's training state, serialised now (the model with virtual rank 0's
        buffers, every virtual rank's in their own file); ``raw``: the handover's form."""
        stepper = self.stepper
        live = stepper.use_virtual_rank_0()
        try:
            files = paddle_state.state_files(
                self._model, self._state_optimizer(), self._lr, self._scaler, raw=raw
            )
        finally:
            stepper.put_back(live)
        files.update(stepper.state_files())
        return files

    def _state_optimizer(self) -> Any:
        """What a checkpoint saves of the optimizer: itself, or for a sharded one the whole
        state gathered at this step (:meth:`_gather_shards`); never one rank's shard."""
        if self._sharded is None:
            return self._optimizer
        if self._gathered is None or self._gathered.step != self.step_done:
            raise FailedPrecondition(
                f"rank {self.rank}: a checkpoint of step {self.step_done} of a sharded "
                "optimizer without its gathered state (it would hold one shard)"
            )
        return self._gathered

    def _gather_shards(self, step: int) -> None:
        """A sharded job, every rank at once: the whole optimizer state for the checkpoint of
        ``step`` (tide/trainer/sharding.py); once per step."""
        if self._sharded is None or (self._gathered is not None and self._gathered.step == step):
            return
        self._gathered = None
        self._gathered = self._sharded.gather(self._model, self._optimizer, step, self.rank)
        self._log.timing(
            "shards_gathered",
            self.env.generation,
            self.rank,
            step=step,
            gather_s=self._gathered.seconds,
            nbytes=self._gathered.nbytes,
        )

    def _write_checkpoint(
        self,
        step: int,
        periodic: bool,
        wait: bool = False,
    ) -> None:
        """Rank 0: a durable checkpoint of ``step``, written in the background (``wait``:
        before this returns); reported to the launcher once written."""
        if self._written_step == step:
            if wait:
                self.persist.wait()
                self._report_written()
            return
        self._written_step = step
        self._periodic.mark(step, time.monotonic())
        self.persist.submit(
            Snapshot(step, self._state_files(), self._meta(step, periodic), periodic)
        )
        if wait:
            self.persist.wait()
            self._report_written()

    def _report_written(self) -> WrittenCheckpoint | None:
        last = None
        for done in self.persist.poll():
            if done.checkpoint is None:
                logger.error(
                    "durable checkpoint of step %d failed: %s", done.snapshot.step, done.error
                )
                continue
            last = done.checkpoint
            self._last_written = last
            self.channel.send(
                CheckpointWritten(
                    step=last.step,
                    digest=last.digest,
                    write_s=last.write_s,
                    periodic=done.snapshot.periodic,
                    lag_s=done.lag_s,
                )
            )
        return last

    @property
    def _hands_over(self) -> bool:
        """This worker puts its state in a handover at a hold: the pod's first worker, or of
        a model-parallel job every worker, each its slice in a handover of its own
        (session_startup.py); a plain job's later workers only take from the pod's."""
        return self.handover is not None and (
            self.env.local_rank == 0 or self._model_parallel.group_size > 1
        )

    def _reserve_handover(self) -> None:
        """Once, after this worker's first step (its optimizer's accumulators exist): the
        handover readies memory of the state's size for the put at a hold, off the pause
        (tide/trainer/handover.py)."""
        if self._handover_reserved or not self._hands_over:
            return
        assert self.handover is not None
        self._handover_reserved = True
        arrays = paddle_state.live_arrays(self._model, self._optimizer)
        nbytes = rawstate.layout(rawstate.specs(arrays))[2]
        # Every worker that hands over fills its spare at once: room for all of them.
        pod_bytes = nbytes * self.env.local_size if self._model_parallel.group_size > 1 else nbytes
        self.handover.reserve(nbytes, room_bytes=pod_bytes)

    def _persist_pending_restore(self) -> None:
        if self._restored_unpersisted is not None:
            step, files, _ = self._restored_unpersisted
            self._restored_unpersisted = None
            self._persist_restored(step, files)

    def _persist_restored(self, step: int, files: Mapping[str, bytes]) -> None:
        """A state that came from memory or a peer is made durable too, in the background,
        if the durable store lacks it (the old generation's writer may have been stopped
        before it finished, or the store is this pod's own)."""
        if step in self.store.list_steps():
            return
        self._written_step = step
        # As it is: a raw state goes to disk raw (load_state reads both forms).
        self.persist.submit(Snapshot(step, files, self._meta(step, False), False))
