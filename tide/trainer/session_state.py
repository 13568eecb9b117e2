"""The state every part of the elastic session shares, and the properties they all read.

ElasticSession (tide/trainer/session.py) is one object to the training script, but its work falls
into rooms that change for different reasons: start-up (session_startup.py), the step loop
(session_loop.py), checkpoint cadence (session_checkpoints.py) and the launcher's control
messages (session_control.py). They are mixins over this one base because they read and write
the same fields at every step boundary (the step, the stop agreement, the durable writer):
the fields are set here, once, so each room and strict mypy see one declaration of them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tide.trainer import slices
from tide.trainer.channel import WorkerChannel
from tide.trainer.checkpoint import PeriodicSchedule, WrittenCheckpoint
from tide.trainer.contract import Deliveries, Lifecycle
from tide.trainer.distenv import DistEnv
from tide.trainer.handover import ShmHandover, StateHandover
from tide.trainer.layout import ModelParallel, RankLayout
from tide.trainer.objstore import make_store
from tide.trainer.persist import DurableStore, DurableWriter
from tide.trainer.pipeline import Pipeline
from tide.trainer.sampler import MicroBatch, ResumableSampler, SamplerConfig
from tide.trainer.sharding import Gathered, Sharded
from tide.trainer.steplog import StepLog
from tide.trainer.stepper import Stepper

if TYPE_CHECKING:
    # Only a type here: the config is the session's public class (tide/trainer/session.py).
    from tide.trainer.session import SessionConfig


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


class SessionState:
    """The session's fields (set before anything talks to the launcher), rank and world
    size, and the stepper built on first use."""

    def __init__(self, config: SessionConfig, env: DistEnv, channel: WorkerChannel) -> None:
        self.config = config
        self.env = env
        self.channel = channel
        self.sampler = ResumableSampler(
            SamplerConfig(config.dataset_size, config.global_batch, config.seed)
        )
        # A directory (or PVC), or object storage through fsspec (tide/trainer/objstore.py).
        self.store: DurableStore = make_store(config.checkpoint_dir, keep=config.checkpoint.keep)
        self.timings = Timings()
        # The order of the script's calls, and the batches that reached its loop
        # (tide/trainer/contract.py).
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
        # A durable writer (rank 0, or each slice's): a state restored from memory or a
        # peer, made durable at the first step boundary after RESTORED_PERSIST_AFTER_S
        # (session.py; monotonic time, the third item).
        self._restored_unpersisted: tuple[int, Mapping[str, bytes], float] | None = None
        # The handover's memory readied for this worker's put (once, after its first step).
        self._handover_reserved = False
        self._log = StepLog(config.log_dir)
        # Fleet's sharded optimizer (tide/trainer/sharding.py): set at attach; and the whole
        # optimizer state gathered for the checkpoint of one step (its ``step``).
        self._sharded: Sharded | None = None
        self._gathered: Gathered | None = None
        # A model-parallel job (tide/trainer/layout.py): its degrees, set once the session
        # knows them (from SessionConfig.model_parallel at the group, or from the script's
        # fleet strategy), and its data-parallel (gradient) and tensor groups of this
        # generation (None: a group of one rank, or fleet's own).
        self._model_parallel = ModelParallel()
        self._dp_group: Any = None
        self._tensor_group: Any = None
        # The subgroups a model-parallel job by hand formed, by their ranks; and its
        # pipeline stage (tide/trainer/pipeline.py; None: pp_degree 1), made at first use.
        self._groups: dict[tuple[int, ...], Any] = {}
        self._pipeline: Pipeline | None = None

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def layout(self) -> RankLayout:
        """This rank's place in the generation: for a plain job every rank is a replica of
        its own (its data-parallel rank is its rank)."""
        return RankLayout(self._model_parallel, self.world_size, self.rank)

    @property
    def dp_group(self) -> Any:
        """A model-parallel job's data-parallel group of this rank: the ranks holding its
        slice, one per replica (None: one replica, or a plain job's world)."""
        return self._dp_group

    @property
    def tensor_group(self) -> Any:
        """A model-parallel job's tensor group of this rank: its replica's ranks of its
        pipeline stage, by tensor rank (a script's tensor parallelism by hand reduces its
        partial sums over it)."""
        return self._tensor_group

    @property
    def dp_rank(self) -> int:
        """This rank's replica: the sampler's rank (every rank of a replica gets the same
        samples)."""
        return self.rank // self._model_parallel.group_size

    @property
    def dp_degree(self) -> int:
        """Replicas in this generation: the sampler's world size."""
        return self.world_size // self._model_parallel.group_size

    @property
    def writes_durable(self) -> bool:
        """This rank writes durable checkpoints: rank 0, or in a model-parallel job the
        first replica's ranks, each its own slice's store."""
        return self.dp_rank == 0 if self._model_parallel.group_size > 1 else self.rank == 0

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
                dp_degree=self.dp_degree,
                dp_group=self._dp_group,
                layout_files=(
                    slices.layout_file(self.layout) if self._model_parallel.group_size > 1 else {}
                ),
            )
        return self._stepper
