"""The elastic session a training script calls: rank, restore, sampler, step hook, checkpoints.

A script looks like this (see tide/trainer/examples/train_bn.py, and docs/trainer.md for a stock
Paddle loop before and after; tide/trainer/contract.py checks the order)::

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
ranks (tide/trainer/stepper.py). Before that it checks that the batch is the one planned. At
the end of each global step it runs the step-boundary hook: sample-id and loss logs,
progress to the launcher, periodic checkpoints, and the stop-step agreement that makes
CHECKPOINT/HOLD/RESUME safe.

Stop-step agreement: every step ends with an all_reduce(max) of [stop_step, checkpoint, exit]
as each rank knows them, so one rank that heard CHECKPOINT(S) in time makes every rank stop
after the same step S, and all hold at one boundary.

The session's parts live beside this module, mixed into ElasticSession: its shared fields
(session_state.py), start-up (session_startup.py), the step loop (session_loop.py),
checkpoint cadence (session_checkpoints.py) and control messages (session_control.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tide.base.errors import ConfigError
from tide.trainer import fused_sync, paddle_state, sharding, slices
from tide.trainer.channel import NullChannel, SocketChannel, WorkerChannel
from tide.trainer.checkpoint import CheckpointNotFound, CheckpointSettings
from tide.trainer.contract import UsageError
from tide.trainer.distenv import (
    GENERATION_ENV,
    PREWARM_ENV,
    RESTART_STARTED_AT_ENV,
    RESTORE_STEP_ENV,
    DistEnv,
)
from tide.trainer.layout import ModelParallel
from tide.trainer.messages import Done, Go, Hello, Ready, Start
from tide.trainer.restore import locate
from tide.trainer.sampler import SamplerConfig
from tide.trainer.session_control import SessionExit
from tide.trainer.session_loop import SessionLoop
from tide.trainer.session_startup import SessionStartup

logger = logging.getLogger(__name__)


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


# How long after a restore from memory or a peer a durable writer (rank 0, or each slice's of
# a model-parallel job) looks whether its store has that step, seconds. The old generation's
# writer is usually still writing it (its write yields to the new worker) and is stopped after
# EXIT_PERSIST_WAIT_S (session_control.py) and the launcher's exit grace (1 s by default): a
# check at the first step found it missing nearly every time in overlap mode, and wrote it a
# second time beside the new generation's first steps.
RESTORED_PERSIST_AFTER_S = 2.0


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
    # A fleet job's cap on its sharding degree (0: none, the optimizer sharded over the whole
    # world): each generation shards over the largest divisor of its world size not above it
    # and replicates data-parallel over the rest (tide/trainer/sharding.py degrees; docs/sharded.md).
    sharding_degree_max: int = 0
    # A model-parallel job's degrees (tide/trainer/layout.py): each replica a whole tensor
    # group of mp_degree ranks (times pp_degree pipeline stages), the job elastic along the
    # replicas only (docs/sharded.md "Layouts"). State them here for tensor or pipeline
    # parallelism by hand (fleet refuses mp on a CPU; fleet's pipeline is refused); a fleet
    # script may state mp_degree in its strategy instead (session.fleet_strategy()).
    model_parallel: ModelParallel = field(default_factory=ModelParallel)

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
        if self.sharding_degree_max < 0:
            raise ConfigError(
                f"sharding_degree_max must be >= 0 (0: no cap), got {self.sharding_degree_max}"
            )
        mp = self.model_parallel
        if mp.sep_degree > 1:
            raise ConfigError(
                f"model_parallel.sep_degree={mp.sep_degree} is not supported under Tide: its "
                "session path is not built nor checked (tensor and pipeline parallelism by "
                "hand, mp_degree and pp_degree, are; docs/sharded.md)"
            )
        # Here too, so that a config states nothing the session cannot run; a strategy's
        # mp_degree is checked where the session takes it (session_startup.py).
        sharding.check_beside_model_parallel(
            mp, self.virtual_ranks, self.sharding_degree_max, self.checkpoint.every_s
        )
        SamplerConfig(self.dataset_size, self.global_batch, self.seed)


class ElasticSession(SessionStartup, SessionLoop):
    def __init__(self, config: SessionConfig, env: DistEnv, channel: WorkerChannel) -> None:
        super().__init__(config, env, channel)
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

    def attach(
        self, model: Any, optimizer: Any, lr_scheduler: Any = None, scaler: Any = None
    ) -> None:
        """The training state: a model (plain or ``paddle.DataParallel``), its optimizer, an
        LR scheduler stepped once per global step, an AMP ``GradScaler``. Once, before
        restore; before or after :meth:`init_process_group` (after it to wrap the model in
        ``paddle.DataParallel``): a prepared worker warms the optimizer in whichever comes
        second."""
        self.lifecycle.attach()
        fleet_job = sharding.check_attached(
            model,
            optimizer,
            self.world_size,
            self.config.sharding_degree_max,
            self._model_parallel,
        )
        sharding.check_pipeline_attached(self._model_parallel, model, scaler, fleet_job)
        sharding.check_data_parallel_group(model, self.layout)
        if fleet_job is not None and self._model_parallel.group_size > 1:
            # fleet formed the groups of this layout: the session sums over its own.
            from paddle.distributed import fleet

            hcg = fleet.get_hybrid_communicate_group()
            self._dp_group = hcg.get_data_parallel_group() if fleet_job.dp_degree > 1 else None
            self._tensor_group = hcg.get_model_parallel_group()
        self._sharded = fleet_job.sharded if fleet_job is not None else None
        if self._sharded is not None:
            # fleet's per-tensor gradient reduce and parameter broadcast, bundled.
            fused_sync.install(self._sharded.optimizer)
        if self._sharded is not None and self.config.checkpoint.every_s > 0:
            raise sharding.UnsupportedLayout(
                f"checkpoint every_s={self.config.checkpoint.every_s} with a sharded optimizer "
                "is not supported under Tide: every rank gathers the optimizer's shards at a "
                "checkpoint step, and a timed cadence is due at different steps on different "
                "ranks; use every_steps"
            )
        if fleet_job is not None:
            # What this generation really runs, for the operator and the e2e tests that check
            # each generation's layout (tide/services/testing/parity.py parses it).
            logger.info(
                "rank %d of generation %d: optimizer state sharded over %d ranks (stage 1), "
                "%d data-parallel replicas",
                self.rank,
                self.env.generation,
                fleet_job.sharding_degree,
                fleet_job.dp_degree,
            )
        self._model = model
        self._optimizer = optimizer
        self._lr = lr_scheduler
        self._scaler = scaler
        if self._warm_grads_left:
            optimizer.clear_grad()
            self._warm_grads_left = False
        if self.lifecycle.grouped and self.env.prepared:
            self._warm_optimizer()

    def fleet_strategy(self, strategy: Any = None) -> Any:
        """The ``fleet.DistributedStrategy`` for ``fleet.init(is_collective=True,
        strategy=...)`` in this generation: ``strategy`` (or a new one) with its data-parallel
        and sharding degrees by ``config.sharding_degree_max`` (tide/trainer/sharding.py degrees;
        docs/sharded.md). After
        :meth:`init_process_group`: the world size is known then. Raises
        ``UnsupportedLayout`` for fleet's pipeline parallelism, a pipeline by hand
        (``SessionConfig.model_parallel.pp_degree``: its stages run without fleet), sharding
        stage 2 and the like."""
        if not self.lifecycle.grouped:
            raise UsageError(
                "session.fleet_strategy() before session.init_process_group(): the sharding "
                "degree is the generation's world size, known once the group forms"
            )
        model_parallel = sharding.resolve_model_parallel(strategy, self.config.model_parallel)
        sharding.check_replicas(self.world_size, model_parallel)
        if model_parallel != self._model_parallel:
            # A tensor-parallel degree of the script's strategy: the job's layout from now on.
            self._use_model_parallel(model_parallel, form_groups=False)
        return sharding.fleet_strategy(
            self.world_size, strategy, self.config.sharding_degree_max, model_parallel
        )

    def batch_sampler(self) -> Any:
        """A ``paddle.io.BatchSampler`` of this rank's micro-batches from the restored step
        on, for ``paddle.io.DataLoader(dataset, batch_sampler=...)``: workers, prefetching
        and collate functions keep working. Call :meth:`step` once per batch. Its batches
        seed the loader's random streams per sample (tide/trainer/dataloader.py)."""
        from tide.trainer.dataloader import TideBatchSampler

        return TideBatchSampler(self)

    def data_loader(self, dataset: Any, **kwargs: Any) -> Any:
        """``paddle.io.DataLoader(dataset, batch_sampler=self.batch_sampler(), **kwargs)``
        with Tide's ``worker_init_fn`` (the script's own runs after it)."""
        from tide.trainer.dataloader import data_loader

        return data_loader(self, dataset, **kwargs)

    def restore(self) -> int:
        """Load the newest state any rank holds; returns its step (0: from scratch).

        The newest one, not only the step the rendezvous names: after an unplanned loss the
        coordinator names its last coordinated checkpoint, while a newer periodic one loses
        fewer steps; every checkpoint of the job lies on the same trajectory. Where it comes
        from (the pod's memory, a peer over the new group, the durable store) is
        tide/trainer/restore.py's rule: a planned resize reads nothing from disk."""
        self.lifecycle.restore()
        if self.env.prepared:
            # A stayer's state is in its pod's memory once its pod's worker held; a newcomer
            # takes it from a peer as soon as those stayers join the broadcast.
            self._take_env(self._wait_for(Start, "start").env)
        started = time.monotonic()
        writer = self.writes_durable
        self._check_store_layout()
        if writer:
            # The durable writers (rank 0; of a model-parallel job the first replica's ranks,
            # each its slice's store), and a new generation starts here: what a crashed
            # writer left is garbage now (a writer still running keeps its directory).
            self.store.cleanup_tmp()
        if self._model_parallel.group_size > 1:
            # Each rank its own slice, from its memory, a stayer at its coordinates or its
            # slice's store (tide/trainer/slices.py).
            located = slices.locate_slice(
                self.layout,
                self.handover,
                self.store,
                into=None if writer else self._live_arrays,
                slice_stores=self._slice_store,
            )
        else:
            located = locate(
                self.handover,
                self.store,
                self.rank,
                self.world_size,
                # Not the durable writer's (rank 0): it makes what it received durable
                # seconds later, while its tensors train on; in fresh arrays, that state
                # stays the step's.
                into=None if writer else self._live_arrays,
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
        if writer and located.step and located.source != "disk":
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

    def finish(self) -> None:
        """The budget is done: write a final checkpoint and tell the launcher. The model
        then holds virtual rank 0's buffers (with virtual ranks), ready to export."""
        self.lifecycle.finish()
        self.deliveries.close()
        if self._stepper is not None:
            self._stepper.use_virtual_rank_0()
        if self.step_done > 0:
            self._gather_shards(self.step_done)
        if self.writes_durable and self.step_done > 0:
            self._write_checkpoint(self.step_done, periodic=True, wait=True)
        self.persist.wait()
        self._report_written()
        self._log.close()
        self.channel.send(Done(step=self.step_done))
