"""ElasticSession's start-up: a prewarmed worker's warm-up and wait for its rendezvous, a
prepared worker's wait for the launcher's word, the process group, the optimizer warmed ahead.

Its own room because it changes with the launcher's worker modes (prewarm, overlap), not with
the step loop; it runs once per worker, before the first step.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from tide.base.errors import ConfigError
from tide.trainer import sharding
from tide.trainer.distenv import PREWARM_ENV, DistEnv, wait_for_port
from tide.trainer.gloo_groups import fast_default_store, share_world_context
from tide.trainer.handover import ShmHandover
from tide.trainer.layout import ModelParallel, RankLayout, all_groups, slice_name
from tide.trainer.messages import Go, Prepared, Rendezvous, Start
from tide.trainer.objstore import make_store
from tide.trainer.persist import DurableStore, DurableWriter
from tide.trainer.session_control import SessionControl

logger = logging.getLogger(__name__)

_Waited = TypeVar("_Waited", Start, Go, Rendezvous)


class SessionStartup(SessionControl):
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
            msg = self._next_message(0.1)
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
            fast_default_store(self.env.master)
            dist.init_parallel_env()
            # Touches gloo groups only (the CPU's); NCCL's form as Paddle forms them.
            share_world_context()
        if self.config.model_parallel.group_size > 1:
            self._use_model_parallel(self.config.model_parallel, form_groups=True)
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

    def _use_model_parallel(self, model_parallel: ModelParallel, form_groups: bool) -> None:
        """This generation runs ``model_parallel``'s layout (tide/trainer/layout.py): its world
        must be whole replicas (a ConfigError naming the degrees otherwise), what the session
        cannot run beside it is refused (SessionConfig's degrees and a strategy's alike pass
        here), its durable checkpoints go to its slice's own store, and with ``form_groups``
        (tensor or pipeline parallelism by hand; a fleet job's groups are fleet's) every rank
        forms the data-parallel, tensor and pipeline groups (and adjacent stages' pairs) in
        the same order (layout.all_groups), keeping them by their ranks."""
        cfg = self.config
        sharding.check_beside_model_parallel(
            model_parallel, cfg.virtual_ranks, cfg.sharding_degree_max, cfg.checkpoint.every_s
        )
        layout = RankLayout(model_parallel, self.world_size, self.rank)
        self._model_parallel = model_parallel
        self.store = self._slice_store(layout.coord.slice)
        # Nothing is written before the layout is known; a write under way would finish first.
        self.persist.wait()
        self.persist = DurableWriter(self.store)
        if self.env.handover_dir and self.env.local_rank > 0:
            # Each worker of a pod holds a slice of its own: each hands it to the worker at
            # its place in the pod's next generation (the first keeps the pod's directory).
            self.handover = ShmHandover(
                Path(self.env.handover_dir) / f"worker-{self.env.local_rank}"
            )
        if form_groups and self.world_size > 1:
            import paddle.distributed as dist

            for ranks in all_groups(self.world_size, model_parallel):
                self._groups[tuple(ranks)] = dist.new_group(ranks)
            self._dp_group = self._groups.get(tuple(layout.dp_ranks))
            self._tensor_group = self._groups.get(tuple(layout.tensor_ranks))
        c = layout.coord
        # The operator's line, and the e2e tests' (tide/services/testing/parity.py parses it).
        logger.info(
            "rank %d of generation %d: model-parallel slice (pp %d, sep %d, mp %d) of replica "
            "%d of %d data-parallel replicas",
            self.rank,
            self.env.generation,
            c.pp,
            c.sep,
            c.mp,
            c.dp,
            layout.dp_degree,
        )

    def _slice_store(self, part: tuple[int, int, int]) -> DurableStore:
        """The durable store of one model-parallel slice (tide/trainer/slices.py writes
        another slice's there when only this rank holds it)."""
        root = self.config.checkpoint_dir.rstrip("/")
        return make_store(f"{root}/{slice_name(part)}", keep=self.config.checkpoint.keep)

    def _check_store_layout(self) -> None:
        """A checkpoint_dir holds one kind of job's checkpoints: a plain job's in its root, a
        model-parallel job's in slice-* stores. The other kind's would be ignored, and the
        job would start from scratch without a word: refused, naming the settings."""
        cfg = self.config
        if self._model_parallel.group_size > 1:
            plain = make_store(cfg.checkpoint_dir, keep=cfg.checkpoint.keep).list_steps()
            if plain:
                raise ConfigError(
                    f"checkpoint_dir={cfg.checkpoint_dir!r} holds a job's checkpoints without "
                    f"model parallelism (steps {plain}), this job runs "
                    f"{sharding.describe(self._model_parallel)}: its slices' stores are slice-* "
                    "subdirectories; give it another checkpoint_dir"
                )
        elif self._slice_store((0, 0, 0)).list_steps():
            raise ConfigError(
                f"checkpoint_dir={cfg.checkpoint_dir!r} holds a model-parallel job's "
                f"checkpoints ({slice_name((0, 0, 0))}/ and its other slices), this job has "
                "none (SessionConfig.model_parallel, or the strategy's mp_degree): give it "
                "another checkpoint_dir"
            )

    def _warm_optimizer(self) -> None:
        """A prepared worker: one optimizer step ahead, on zero gradients, its parameters
        put back after it. A process's first optimizer step creates every accumulator and
        runs its kernels for the first time: 0.13-0.2 s of a 0.25-0.39 s shrink gap on this
        machine under load. The accumulators it leaves are overwritten by the restore,
        which in overlap mode always loads a state (the barrier's step is >= 1); a
        prepared worker that finds no state at all refuses to start from scratch."""
        if self._optimizer is None or self._model is None or self._sharded is not None:
            # A sharded optimizer's step is a collective over the group: its first real step
            # pays.
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
