"""ElasticSession's control: the launcher's messages (CHECKPOINT, HOLD, RESUME, EXIT), the
stop-step agreement between ranks, the hold at a shared step boundary, and the exit.

Its own room because it is the resize protocol's worker side (docs/resize-protocol.md) and
changes with it; the step loop calls it once per step boundary.
"""

from __future__ import annotations

import errno
import logging
import time
from dataclasses import asdict

from tide.trainer.checkpoint import WrittenCheckpoint
from tide.trainer.messages import (
    CheckpointAt,
    CheckpointInfo,
    Exit,
    Held,
    Hold,
    Resume,
    Resumed,
    ToWorker,
)
from tide.trainer.session_checkpoints import SessionCheckpoints

logger = logging.getLogger(__name__)

# How long a worker asked to exit waits for a durable write under way, seconds.
EXIT_PERSIST_WAIT_S = 0.3
# A handover's put failing with one of these found the pod's memory full; any other error
# (Paddle raises a device's failures as OSError too) is the worker's end.
_MEMORY_FULL = frozenset({errno.ENOSPC, errno.ENOMEM, errno.EDQUOT, errno.EFBIG})


class SessionExit(SystemExit):
    """Raised out of the training loop when the launcher asks the worker to exit."""


class SessionControl(SessionCheckpoints):
    def _handle(self, msg: ToWorker) -> None:
        if isinstance(msg, CheckpointAt):
            self._stop_at = msg.step if not self._stop_at else min(self._stop_at, msg.step)
            self._want_checkpoint = True
            self._leaving = self._leaving or msg.leaving
            self._directive_ids.append(msg.directive_id)
        elif isinstance(msg, Hold):
            # The current step: every rank is at the same boundary when they agree.
            self._stop_at = self._stop_at or max(self.step_done, 1)
            self._directive_ids.append(msg.directive_id)
        elif isinstance(msg, Resume):
            # Only meaningful for a stop that is pending (a barrier aborted before its step):
            # the ranks still stop together at that step, then carry on at once.
            if self._stop_at:
                self._resume_pending = True
        elif isinstance(msg, Exit):
            self._want_exit = True
        else:
            logger.warning("rank %d: unexpected control message %s", self.rank, msg.TYPE)

    def _drain_channel(self) -> None:
        while (msg := self.channel.poll()) is not None:
            self._handle(msg)
        if self.channel.closed:
            self._want_exit = True

    def _agree(self) -> tuple[int, bool, bool]:
        mine = [self._stop_at, int(self._want_checkpoint), int(self._want_exit)]
        if self.world_size == 1:
            return mine[0], bool(mine[1]), bool(mine[2])
        import paddle
        import paddle.distributed as dist

        t = paddle.to_tensor(mine, dtype="int64")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        agreed = [int(v) for v in t.numpy()]
        return agreed[0], bool(agreed[1]), bool(agreed[2])

    def _hold(self, step: int, checkpoint: bool) -> None:
        held_at = time.time()
        logger.info("rank %d holding after step %d (checkpoint=%s)", self.rank, step, checkpoint)
        self._send_held(step, held_at, checkpoint, self._directive_ids, self._leaving)
        self._stop_at, self._want_checkpoint, self._directive_ids = 0, False, []
        self._leaving = False
        while not self._resume_pending:
            msg = self._next_message(0.05)
            if isinstance(msg, Resume):
                break
            elif isinstance(msg, CheckpointAt) and msg.step > step:
                # Train on to the later step: every rank gets the same directive.
                self._handle(msg)
                break
            elif isinstance(msg, CheckpointAt | Hold):
                # Already holding at a boundary every rank shares: answer from here.
                ckpt = isinstance(msg, CheckpointAt)
                leaving = isinstance(msg, CheckpointAt) and msg.leaving
                self._send_held(step, held_at, ckpt, [msg.directive_id], leaving)
            else:
                logger.warning("rank %d: unexpected control message %s", self.rank, msg.TYPE)
        self._resume_pending = False
        self._rate_t0, self._rate_samples = time.monotonic(), 0
        self.channel.send(Resumed(step=step))

    def _next_message(self, timeout_s: float) -> ToWorker:
        """The launcher's next message, waited for in slices of ``timeout_s``; exits on Exit
        or a closed channel (a held worker and a waiting one alike)."""
        while True:
            msg = self.channel.wait(timeout_s)
            if msg is None:
                if self.channel.closed:
                    self._exit()
                continue
            if isinstance(msg, Exit):
                self._exit()
            return msg

    def _send_held(
        self, step: int, held_at: float, checkpoint: bool, ids: list[str], leaving: bool = False
    ) -> None:
        info: CheckpointInfo | None = None
        if checkpoint:
            # Every rank, before only some of them serialise (a collective, tide/trainer/sharding.py).
            self._gather_shards(step)
        if checkpoint and self.handover is not None:
            # Each pod's first worker hands the state to the pod's next worker, in memory,
            # as the tensors' bytes (not pickled: the pause's critical path). The next
            # generation's durable writers (rank 0, or each slice's) make it durable after
            # the pause (restore()), so nothing of the durable write competes with the
            # barrier (tide/trainer/persist.py).
            handed: WrittenCheckpoint | None = None
            if self._model_parallel.group_size > 1 and leaving and self.writes_durable:
                # A leaving slice writer (rank 0 too): once this process exits, its slice of
                # this step might be nowhere (when no stayer holds it), and the next
                # generation could not resume the step (slices.py's fallback reads it here).
                handed = self._write_held(step)
            elif self._hands_over and (self.rank == 0 or not leaving):
                # A leaving pod has no next worker to read it; rank 0 still reports the state.
                files = self._state_files(raw=True)
                try:
                    handed = self.handover.put(step, files, self._meta(step, False))
                except OSError as exc:
                    if exc.errno not in _MEMORY_FULL:
                        raise
                    # Shared memory full (other workers' handovers, a DataLoader's): the
                    # state goes to the store instead, slower; a rank that writes none has
                    # its successor take it from a peer or from the stores.
                    logger.warning(
                        "rank %d: handover of step %d failed (%s); %s",
                        self.rank,
                        step,
                        exc,
                        "writing it durably" if self.writes_durable else "not handed over",
                    )
                    if self.writes_durable:
                        handed = self._write_held(step)
            if self.rank == 0:
                assert handed is not None
                info = CheckpointInfo(step=step, digest=handed.digest, write_s=handed.write_s)
        elif checkpoint and self.writes_durable:
            # Rank 0, or of a model-parallel job each slice's writer (the first replica's
            # ranks): a slice left at an older step would make a restore from the stores
            # go back to the newest step every slice has.
            written = self._write_held(step)
            if self.rank == 0:
                info = CheckpointInfo(step=step, digest=written.digest, write_s=written.write_s)
        self._log.timing(
            "held",
            self.env.generation,
            self.rank,
            step=step,
            held_at=held_at,
            checkpoint=asdict(info) if info is not None else None,
        )
        self.channel.send(
            Held(step=step, held_at=held_at, directive_ids=tuple(ids), checkpoint=info)
        )

    def _write_held(self, step: int) -> WrittenCheckpoint:
        """The state of ``step`` written to the durable store, in the pause."""
        self._write_checkpoint(step, periodic=False, wait=True)
        written = self._last_written
        assert written is not None and written.step == step, "the checkpoint was not written"
        return written

    def _exit(self) -> None:
        logger.info(
            "rank %d of generation %d exits at step %d",
            self.rank,
            self.env.generation,
            self.step_done,
        )
        # A durable write under way gets a moment; the next generation's durable writers
        # write the state they restored if this one is cut short (and so does this one, if
        # it restored from memory and has not checked yet).
        self.deliveries.close()
        self._persist_pending_restore()
        self.persist.wait(EXIT_PERSIST_WAIT_S)
        self._report_written()
        self._log.close()
        raise SessionExit(0)
