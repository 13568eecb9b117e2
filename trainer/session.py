"""The elastic session a training script calls: rank, restore, sampler, step hook, checkpoints.

A script looks like this (see trainer/examples/train_bn.py, and docs/trainer.md for a stock
Paddle loop before and after; trainer/contract.py checks the order)::

    session = ElasticSession.from_env(SessionConfig(dataset_size=N, global_batch=B, seed=0,
                                                    max_steps=100, checkpoint_dir="ckpt"))
    model, optimizer = build()
    session.init_process_group(warmup=warmup)
    session.attach(model, optimizer, lr_scheduler)
    session.restore()
    for x, y in session.data_loader(dataset, num_workers=2):   # or session.plans()
        session.step(F.cross_entropy(model(x), y))
    session.finish()

``step(loss)`` takes the micro-batch's *mean* loss or its per-sample losses, refuses other
reductions, and makes the step's gradient the global batch's, with the session's own
gradient sum or under ``paddle.DataParallel``, with AMP, gradient accumulation and virtual
ranks (trainer/stepper.py). Before that it checks that the batch is the one planned. At
the end of each global step it runs the step-boundary hook: sample-id and loss logs,
progress to the launcher, periodic checkpoints, and the stop-step agreement that makes
CHECKPOINT/HOLD/RESUME safe.

Stop-step agreement: every step ends with an all_reduce(max) of [stop_step, checkpoint, exit]
as each rank knows them, so one rank that heard CHECKPOINT(S) in time makes every rank stop
after the same step S, and all hold at one boundary.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from tidebase.errors import ConfigError
from trainer import paddle_state
from trainer.channel import NullChannel, SocketChannel, WorkerChannel
from trainer.checkpoint import (
    CheckpointNotFound,
    CheckpointSettings,
    PeriodicSchedule,
    WrittenCheckpoint,
)
from trainer.contract import Deliveries, Lifecycle, UsageError
from trainer.distenv import (
    GENERATION_ENV,
    PREWARM_ENV,
    RESTART_STARTED_AT_ENV,
    RESTORE_STEP_ENV,
    DistEnv,
    wait_for_port,
)
from trainer.handover import ShmHandover, StateHandover
from trainer.messages import (
    CheckpointAt,
    CheckpointInfo,
    CheckpointWritten,
    Done,
    Exit,
    Go,
    Held,
    Hello,
    Hold,
    Prepared,
    Progress,
    Ready,
    Rendezvous,
    Resume,
    Resumed,
    Start,
    ToWorker,
)
from trainer.objstore import make_store
from trainer.persist import DurableStore, DurableWriter, Snapshot
from trainer.restore import locate
from trainer.sampler import MicroBatch, ResumableSampler, SamplerConfig, micro_batches
from trainer.steplog import StepLog
from trainer.stepper import Stepper

logger = logging.getLogger(__name__)

_Waited = TypeVar("_Waited", Start, Go, Rendezvous)

# Re-exported: scripts and older callers import them from here.
__all__ = [
    "GENERATION_ENV",
    "PREWARM_ENV",
    "RESTART_STARTED_AT_ENV",
    "RESTORE_STEP_ENV",
    "DistEnv",
    "ElasticSession",
    "SessionConfig",
    "SessionExit",
]


# How long a worker asked to exit waits for a durable write under way, seconds.
EXIT_PERSIST_WAIT_S = 0.3
# How long after a restore from memory or a peer rank 0 looks whether the durable store has
# that step, seconds. The old generation's rank 0 is usually still writing it (its write
# yields to the new worker) and is stopped after EXIT_PERSIST_WAIT_S and the launcher's exit
# grace (1 s by default): a check at the first step found it missing nearly every time in
# overlap mode, and wrote it a second time beside the new generation's first steps.
RESTORED_PERSIST_AFTER_S = 2.0


class SessionExit(SystemExit):
    """Raised out of the training loop when the launcher asks the worker to exit."""


@dataclass(frozen=True)
class SessionConfig:
    dataset_size: int
    global_batch: int
    seed: int
    max_steps: int
    checkpoint_dir: str
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    # Where the sample-id log (per rank) and the loss log (rank 0) go; "" for none.
    log_dir: str = ""
    # Give up waiting for rank 0's TCP store after this long, seconds.
    master_wait_s: float = 60.0
    # A fixed logical data-parallel degree (0: off): the global batch is cut into this many
    # micro-batches in any world, each with its own BatchNorm buffers and RNG (stepper.py).
    virtual_ranks: int = 0
    # Micro-batches per rank (or per virtual rank) and step, their gradients accumulated.
    accumulation_steps: int = 1

    def __post_init__(self) -> None:
        if self.max_steps < 0:
            raise ConfigError(f"max_steps must be >= 0, got {self.max_steps}")
        if not self.checkpoint_dir:
            raise ConfigError("checkpoint_dir must be set, got ''")
        if self.master_wait_s <= 0:
            raise ConfigError(f"master_wait_s must be > 0, got {self.master_wait_s}")
        if self.virtual_ranks < 0:
            raise ConfigError(f"virtual_ranks must be >= 0, got {self.virtual_ranks}")
        if self.accumulation_steps < 1:
            raise ConfigError(f"accumulation_steps must be >= 1, got {self.accumulation_steps}")
        SamplerConfig(self.dataset_size, self.global_batch, self.seed)


@dataclass
class Timings:
    worker_restart_s: float = 0.0
    group_init_s: float = 0.0
    restore_s: float = 0.0
    # Parts of restore_s: the pod's memory, the durable store, a peer over the group.
    handover_s: float = 0.0
    disk_read_s: float = 0.0
    transfer_s: float = 0.0
    first_step_at: float = 0.0
    # Overlap mode: the group init done ahead, while the previous worker trained (not in
    # the pause; group_init_s is then 0), and how long the restored worker waited for the
    # barrier's end.
    prepare_s: float = 0.0
    go_wait_s: float = 0.0


class ElasticSession:
    def __init__(self, config: SessionConfig, env: DistEnv, channel: WorkerChannel) -> None:
        self.config = config
        self.env = env
        self.channel = channel
        self.sampler = ResumableSampler(
            SamplerConfig(config.dataset_size, config.global_batch, config.seed)
        )
        # A directory (or PVC), or object storage through fsspec (trainer/objstore.py).
        self.store: DurableStore = make_store(config.checkpoint_dir, keep=config.checkpoint.keep)
        self.timings = Timings()
        # The order of the script's calls, and the batches that reached its loop
        # (trainer/contract.py).
        self.lifecycle = Lifecycle()
        self.deliveries = Deliveries()
        # The sample ids the current step's delivered batches held (the sample log's).
        self._delivered: list[int] = []
        self.step_done = 0
        self.restored_step = 0
        self._model: Any = None
        self._optimizer: Any = None
        self._lr: Any = None
        self._scaler: Any = None
        self._stepper: Stepper | None = None
        # The current step's micro-batches of this rank, the next one's index, and the last
        # one prepared (its buffers and RNG in place before the script's forward).
        self._micro: list[MicroBatch] | None = None
        self._mi = 0
        self._prepared: tuple[int, int] | None = None
        self._global_loss = 0.0
        self._stop_at = 0
        self._want_checkpoint = False
        self._want_exit = False
        self._resume_pending = False
        self._directive_ids: list[str] = []
        self._periodic = PeriodicSchedule(config.checkpoint, time.monotonic())
        self._last_written: WrittenCheckpoint | None = None
        # The step last handed to the durable writer (written or being written).
        self._written_step = -1
        self.persist = DurableWriter(self.store)
        self.handover: StateHandover | None = (
            ShmHandover(env.handover_dir) if env.handover_dir else None
        )
        self._rate_t0 = time.monotonic()
        self._rate_samples = 0
        self._samples_per_s = 0.0
        self._first_step_started = 0.0
        # Where the first step's time went (forward, backward, sum and optimizer), seconds.
        self._first_parts: dict[str, float] = {}
        self._last_reduce_s = 0.0
        # A prepared worker's optimizer took a step ahead (its accumulators exist).
        self._optimizer_warmed = False
        # A warm-up ran before attach: its gradients are still on the parameters.
        self._warm_grads_left = False
        # The pod leaves after the coordinated checkpoint it was told of (no handover then).
        self._leaving = False
        # Rank 0: a state restored from memory or a peer, made durable at the first step
        # boundary after RESTORED_PERSIST_AFTER_S (monotonic time, the third item).
        self._restored_unpersisted: tuple[int, Mapping[str, bytes], float] | None = None
        self._log = StepLog(config.log_dir)
        if env.device:
            import paddle

            # Before the script builds its model: a pinned worker's one GPU, or the CPU.
            paddle.device.set_device(env.paddle_device)
        if not env.prewarm:
            self._joined()
        self.channel.send(Hello(pid=os.getpid(), generation=env.generation))

    @classmethod
    def from_env(
        cls, config: SessionConfig, env: Mapping[str, str] | None = None
    ) -> ElasticSession:
        dist_env = DistEnv.from_env(env)
        channel: WorkerChannel = (
            SocketChannel(dist_env.control_socket) if dist_env.control_socket else NullChannel()
        )
        return cls(config, dist_env, channel)

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    # -- start-up -------------------------------------------------------------------------

    def _joined(self) -> None:
        """This worker knows its generation and rank: open its logs, note its restart time."""
        self._log.open(self.env.rank, self.env.generation)
        if self.env.restart_started_at:
            self.timings.worker_restart_s = max(0.0, time.time() - self.env.restart_started_at)

    def _warm_up(self, warmup: Callable[[], None]) -> None:
        import paddle

        started = time.monotonic()
        rng = paddle.get_rng_state()
        warmup()
        paddle.set_rng_state(rng)
        if self._optimizer is not None:
            self._optimizer.clear_grad()
        else:
            # Attached after the group (the canonical order): attach clears them.
            self._warm_grads_left = True
        logger.info(
            "prewarmed worker pid %d warmed up in %.3fs", os.getpid(), time.monotonic() - started
        )

    def _wait_for(self, kind: type[_Waited], what: str) -> _Waited:
        """A prepared worker: the next ``kind`` message, exiting when asked to."""
        logger.info(
            "prepared worker pid %d (rank %d of generation %d) waiting for its %s",
            os.getpid(),
            self.rank,
            self.env.generation,
            what,
        )
        return self._next(kind, "prepared worker", what)

    def _next(self, kind: type[_Waited], who: str, what: str) -> _Waited:
        """The next ``kind`` message from the launcher; exits on Exit or a closed channel."""
        while True:
            msg = self.channel.wait(0.1)
            if msg is None:
                if self.channel.closed:
                    self._exit()
                continue
            if isinstance(msg, Exit):
                self._exit()
            if isinstance(msg, kind):
                return msg
            logger.warning("%s: ignoring %s before its %s", who, msg.TYPE, what)

    def _take_env(self, env: Mapping[str, str]) -> None:
        os.environ.update(env)
        self.env = DistEnv.from_env({**os.environ, PREWARM_ENV: "0"})

    def _wait_for_rendezvous(self) -> None:
        """A prewarmed worker: imports done and model built, it waits for its generation."""
        logger.info("prewarmed worker pid %d waiting for a rendezvous", os.getpid())
        self._take_env(self._next(Rendezvous, "prewarmed worker", "rendezvous").env)
        self._joined()

    def init_process_group(self, warmup: Callable[[], None] | None = None) -> None:
        """Join the generation's process group (a prewarmed worker first waits to be told
        which). Rank and world size are known once this returns.

        ``warmup`` (a forward and backward on a dummy batch) runs in a prewarmed worker before
        it waits: a process's first backward is several times slower than the next ones, and
        this moves that cost out of the pause. Gradients are cleared and the RNG put back."""
        self.lifecycle.init_process_group()
        if self.env.prewarm:
            if warmup is not None:
                self._warm_up(warmup)
            self._wait_for_rendezvous()
        started = time.monotonic()
        if self.world_size > 1:
            import paddle.distributed as dist

            if self.rank != 0:
                wait_for_port(self.env.master, self.config.master_wait_s)
            dist.init_parallel_env()
        self.timings.group_init_s = time.monotonic() - started
        logger.info(
            "rank %d/%d of generation %d: group ready in %.3fs",
            self.rank,
            self.world_size,
            self.env.generation,
            self.timings.group_init_s,
        )
        if self.env.prepared:
            # Formed ahead, outside the pause: the pause's own group init is none.
            self.timings.prepare_s, self.timings.group_init_s = self.timings.group_init_s, 0.0
            self.channel.send(
                Prepared(generation=self.env.generation, group_init_s=self.timings.prepare_s)
            )
            self._warm_optimizer()

    def _warm_optimizer(self) -> None:
        """A prepared worker: one optimizer step ahead, on zero gradients, its parameters
        put back after it. A process's first optimizer step creates every accumulator and
        runs its kernels for the first time: 0.13-0.2 s of a 0.25-0.39 s shrink gap on this
        machine under load. The accumulators it leaves are overwritten by the restore,
        which in overlap mode always loads a state (the barrier's step is >= 1); a
        prepared worker that finds no state at all refuses to start from scratch."""
        if self._optimizer is None or self._model is None:
            return
        started = time.monotonic()
        params = list(self._model.parameters())
        saved = [p.numpy().copy() for p in params]
        try:
            # The warm-up's backward left gradients: zeroed, they still take the step (a
            # parameter without one is skipped, and warms at the first real step).
            self._optimizer.clear_grad(set_to_zero=True)
            # From here its accumulators may exist, even if the step fails half-way.
            self._optimizer_warmed = True
            self._optimizer.step()
        except Exception:
            # An optimizer (or a wrapper) that cannot: its first real step pays instead.
            logger.warning(
                "prepared worker pid %d: no optimizer warm-up", os.getpid(), exc_info=True
            )
        finally:
            for p, value in zip(params, saved, strict=True):
                p.set_value(value)
            self._optimizer.clear_grad()
        logger.info(
            "prepared worker pid %d warmed its optimizer in %.3fs",
            os.getpid(),
            time.monotonic() - started,
        )

    def attach(
        self, model: Any, optimizer: Any, lr_scheduler: Any = None, scaler: Any = None
    ) -> None:
        """The training state: a model (plain or ``paddle.DataParallel``), its optimizer, an
        LR scheduler stepped once per global step, an AMP ``GradScaler``. Once, before
        restore; before or after :meth:`init_process_group` (after it to wrap the model in
        ``paddle.DataParallel``): a prepared worker warms the optimizer in whichever comes
        second."""
        self.lifecycle.attach()
        self._model = model
        self._optimizer = optimizer
        self._lr = lr_scheduler
        self._scaler = scaler
        if self._warm_grads_left:
            optimizer.clear_grad()
            self._warm_grads_left = False
        if self.lifecycle.grouped and self.env.prepared:
            self._warm_optimizer()

    @property
    def stepper(self) -> Stepper:
        if self._stepper is None:
            # After the group: the world size is known only then in a prewarmed worker.
            self._stepper = Stepper(
                self._model,
                self._optimizer,
                self._lr,
                self._scaler,
                self.world_size,
                self.config.virtual_ranks,
                self.config.seed,
            )
        return self._stepper

    def batch_sampler(self) -> Any:
        """A ``paddle.io.BatchSampler`` of this rank's micro-batches from the restored step
        on, for ``paddle.io.DataLoader(dataset, batch_sampler=...)``: workers, prefetching
        and collate functions keep working. Call :meth:`step` once per batch. Its batches
        seed the loader's random streams per sample (trainer/dataloader.py)."""
        from trainer.dataloader import TideBatchSampler

        return TideBatchSampler(self)

    def data_loader(self, dataset: Any, **kwargs: Any) -> Any:
        """``paddle.io.DataLoader(dataset, batch_sampler=self.batch_sampler(), **kwargs)``
        with Tide's ``worker_init_fn`` (the script's own runs after it)."""
        from trainer.dataloader import data_loader

        return data_loader(self, dataset, **kwargs)

    def micro_batches(self, step: int) -> list[MicroBatch]:
        """This rank's micro-batches of global step ``step``."""
        return micro_batches(
            self.sampler.plan(step, self.rank, self.world_size),
            self.rank,
            self.world_size,
            self.config.virtual_ranks,
            self.config.accumulation_steps,
        )

    def restore(self) -> int:
        """Load the newest state any rank holds; returns its step (0: from scratch).

        The newest one, not only the step the rendezvous names: after an unplanned loss the
        coordinator names its last coordinated checkpoint, while a newer periodic one loses
        fewer steps; every checkpoint of the job lies on the same trajectory. Where it comes
        from (the pod's memory, a peer over the new group, the durable store) is
        trainer/restore.py's rule: a planned resize reads nothing from disk."""
        self.lifecycle.restore()
        if self.env.prepared:
            # A stayer's state is in its pod's memory once its pod's worker held; a newcomer
            # takes it from a peer as soon as those stayers join the broadcast.
            self._take_env(self._wait_for(Start, "start").env)
        started = time.monotonic()
        if self.rank == 0:
            # Rank 0 is the only durable writer, and a new generation starts here: what a
            # crashed writer left is garbage now (a writer still running keeps its directory).
            self.store.cleanup_tmp()
        located = locate(
            self.handover,
            self.store,
            self.rank,
            self.world_size,
            # Not rank 0's: it makes what it received durable seconds later, while its
            # tensors train on; received into fresh arrays, that state stays the step's.
            into=None if self.rank == 0 else self._live_arrays,
        )
        named = self.env.restore_step
        if named is not None and located.step < named:
            logger.warning(
                "checkpoint %d named by generation %d is missing or damaged; restoring %s",
                named,
                self.env.generation,
                located.step or "from scratch",
            )
        if not located.step and self._optimizer_warmed:
            # Its accumulators hold the warm-up step's values, not a new optimizer's: the
            # recovery's fresh workers start from scratch instead.
            raise CheckpointNotFound(
                f"prepared worker of generation {self.env.generation} found no state to restore"
            )
        load_started = time.monotonic()
        stepper = self.stepper
        if located.step:
            paddle_state.load_state(
                located.files, self._model, self._optimizer, self._lr, self._scaler
            )
            stepper.load(located.files)
            self.step_done = located.step
        t = self.timings
        t.handover_s, t.disk_read_s, t.transfer_s = (
            located.handover_s,
            located.disk_read_s,
            located.transfer_s,
        )
        t.restore_s = t.handover_s + t.disk_read_s + t.transfer_s + time.monotonic() - load_started
        self.restored_step = self.step_done
        if self.rank == 0 and located.step and located.source != "disk":
            # Not now, nor at the first step: the old generation's writer is usually still
            # finishing this very step, and a second write beside the first steps (and
            # waiting on the writers' lock) slowed them down by 0.2 s at a loaded machine.
            self._restored_unpersisted = (
                located.step,
                located.files,
                time.monotonic() + RESTORED_PERSIST_AFTER_S,
            )
        logger.info(
            "rank %d of generation %d restored step %d from %s in %.3fs (located in %.3fs)",
            self.rank,
            self.env.generation,
            self.step_done,
            located.source or "scratch",
            t.restore_s,
            time.monotonic() - started,
        )
        self.channel.send(
            Ready(
                restored_step=self.step_done,
                generation=self.env.generation,
                worker_restart_s=t.worker_restart_s,
                group_init_s=t.group_init_s,
                restore_s=t.restore_s,
            )
        )
        if self.env.prepared:
            # Restored while the barrier still completed at the coordinator: train only once
            # it has (the old generation may still resume if the resize is aborted).
            waited = time.monotonic()
            self._take_env(self._wait_for(Go, "go").env)
            t.go_wait_s = time.monotonic() - waited
            if self.env.restart_started_at:
                t.worker_restart_s = max(0.0, time.time() - self.env.restart_started_at)
        self._report_progress()
        self._first_step_started = time.monotonic()
        self._current()
        return self.step_done

    def _live_arrays(self) -> dict[str, Any]:
        return paddle_state.live_arrays(self._model, self._optimizer)

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

    # -- the loop ---------------------------------------------------------------------------

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

    def plans(self) -> Iterator[MicroBatch]:
        """This rank's micro-batches, one by one, until the budget is done."""
        self.lifecycle.training("session.plans()")
        while (mb := self._current()) is not None:
            self.deliveries.planned(mb)
            yield mb
            if self._current() is mb:
                raise UsageError(f"step {mb.step}: call session.step(loss) inside the loop")

    def step(self, loss: Any, indices: Any = None) -> float | None:
        """Backward of the current micro-batch's loss: its *mean*, or its per-sample losses
        (None: this rank ran no forward, plain models only); after a rank's last
        micro-batch of the step, the sum over ranks, the optimizer (and scaler, LR
        scheduler) step and the step-boundary hook. Returns the global batch's mean loss
        after the step's last micro-batch, else None.

        Before the backward it checks that the batch came from :meth:`batch_sampler` (or
        :meth:`plans`) for this very micro-batch, and ``indices``, the sample ids the batch
        carries, if given; and that the loss is a mean or per-sample (trainer/contract.py)."""
        self.lifecycle.training("session.step()")
        mb = self._current()
        if mb is None:
            raise UsageError(
                f"session.step() after the last step ({self.config.max_steps}): end the loop "
                "when the batch sampler (or session.plans()) ends, then call session.finish()"
            )
        ids = self.deliveries.check(mb, indices)
        stepper = self.stepper
        if self.timings.first_step_at == 0.0 and not self._first_parts:
            self._first_parts["forward_s"] = time.monotonic() - self._first_step_started
        term = stepper.weighted(mb, loss)
        self.deliveries.consumed(mb)
        if not mb.padding:
            self._delivered.extend(ids)
        stepper.backward(mb, term)
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
            ids,
            self._global_loss,
        )
        self._report_progress()
        if self._restored_unpersisted is not None and now >= self._restored_unpersisted[2]:
            self._persist_pending_restore()
        if self.rank == 0 and self._periodic.due(plan.step, now):
            self._write_checkpoint(plan.step, periodic=True)
        self._report_written()
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
                self._model, self._optimizer, self._lr, self._scaler, raw=raw
            )
        finally:
            stepper.put_back(live)
        files.update(stepper.state_files())
        return files

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
                )
            )
        return last

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
            msg = self.channel.wait(0.05)
            if msg is None:
                if self.channel.closed:
                    self._exit()
                continue
            if isinstance(msg, Exit):
                self._exit()
            elif isinstance(msg, Resume):
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

    def _send_held(
        self, step: int, held_at: float, checkpoint: bool, ids: list[str], leaving: bool = False
    ) -> None:
        info: CheckpointInfo | None = None
        if checkpoint and self.handover is not None:
            # Each pod's first worker hands the state to the pod's next worker, in memory,
            # as the tensors' bytes (not pickled: the pause's critical path). The next
            # generation's rank 0 makes it durable after the pause (restore()), so nothing
            # of the durable write competes with the barrier (trainer/persist.py).
            handed: WrittenCheckpoint | None = None
            # A leaving pod has no next worker to read it; rank 0 still reports the state.
            if self.env.local_rank == 0 and (self.rank == 0 or not leaving):
                files = self._state_files(raw=True)
                handed = self.handover.put(step, files, self._meta(step, False))
            if self.rank == 0:
                assert handed is not None
                info = CheckpointInfo(step=step, digest=handed.digest, write_s=handed.write_s)
        elif checkpoint and self.rank == 0:
            self._write_checkpoint(step, periodic=False, wait=True)
            written = self._last_written
            assert written is not None and written.step == step, "the checkpoint was not written"
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

    def _exit(self) -> None:
        logger.info(
            "rank %d of generation %d exits at step %d",
            self.rank,
            self.env.generation,
            self.step_done,
        )
        # A durable write under way gets a moment; the next generation's rank 0 writes the
        # state it restored if this one is cut short (and so does this one, if it restored
        # from memory and has not checked yet).
        self.deliveries.close()
        self._persist_pending_restore()
        self.persist.wait(EXIT_PERSIST_WAIT_S)
        self._report_written()
        self._log.close()
        raise SessionExit(0)

    def finish(self) -> None:
        """The budget is done: write a final checkpoint and tell the launcher. The model
        then holds virtual rank 0's buffers (with virtual ranks), ready to export."""
        self.lifecycle.finish()
        self.deliveries.close()
        if self._stepper is not None:
            self._stepper.use_virtual_rank_0()
        if self.rank == 0 and self.step_done > 0:
            self._write_checkpoint(self.step_done, periodic=True, wait=True)
        self.persist.wait()
        self._report_written()
        self._log.close()
        self.channel.send(Done(step=self.step_done))
