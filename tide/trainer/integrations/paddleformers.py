"""PaddleFormers' ``Trainer`` under an ``ElasticSession`` (the ``paddleformers`` extra).

A stock script changes one import line::

    -from paddleformers.trainer import Trainer, TrainingArguments
    +from tide.trainer.integrations.paddleformers import Trainer, TrainingArguments

``Trainer.train()`` then runs the session's loop instead of PaddleFormers' own: Tide's
checked batch sampler (one fixed global batch, resharded exactly when the world changes)
feeds a DataLoader with the Trainer's collator; the Trainer builds its optimizer and LR
scheduler as it always does (``create_optimizer_and_scheduler``), and the session carries
them, the model and the accumulation across resizes (``session.step``). What the Trainer
would do inexactly under a changing world is refused at start, one line naming it
(``unsupported``): docs/migrate.md lists what is and is not carried over.

The global batch is ``per_device_train_batch_size × gradient_accumulation_steps`` (× the
``TIDE_DATA_PARALLEL`` environment variable, default 1: the data-parallel degree the
hyper-parameters were tuned at), whatever the world size: the per-device batch of a stock
run becomes ``global / world`` under Tide. ``gradient_accumulation_steps`` becomes the
session's ``accumulation_steps`` (micro-batches per rank and step).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import paddle
import paddle.distributed.parallel as paddle_parallel
import paddle.nn.functional as F
from paddleformers.trainer import Trainer as _Trainer
from paddleformers.trainer import TrainingArguments as _TrainingArguments
from paddleformers.trainer.trainer_utils import TrainOutput

from tide.trainer.checkpoint import CheckpointSettings
from tide.trainer.contract import UsageError
from tide.trainer.session import ElasticSession, SessionConfig

__all__ = ["Trainer", "TrainingArguments", "unsupported"]

# The generation's world, which PaddleFormers' TrainingArguments would initialise itself
# (``init_parallel_env`` when PADDLE_TRAINERS_NUM > 1): the session does it, per generation.
_WORLD_ENV = (
    "PADDLE_TRAINERS_NUM",
    "PADDLE_TRAINER_ID",
    "PADDLE_RANK_IN_NODE",
    "PADDLE_TRAINER_ENDPOINTS",
    "PADDLE_CURRENT_ENDPOINT",
    "PADDLE_LOCAL_SIZE",
)
IGNORE_INDEX = -100


class TrainingArguments(_TrainingArguments):  # type: ignore[misc]
    """PaddleFormers' ``TrainingArguments``, leaving the process group to the session."""

    def __post_init__(self) -> None:
        # An explicit logging_dir also gets the session's sample-id and loss logs; the
        # default one (output_dir/runs/TIME) does not.
        self.tide_log_dir = self.logging_dir or ""
        hidden = {k: os.environ.pop(k) for k in _WORLD_ENV if k in os.environ}
        # Paddle caches the world it read from the environment (at PaddleFormers' import):
        # dropped, so that these arguments see one process, and again after, so that the
        # session's init_parallel_env reads the generation's world.
        paddle_parallel._global_parallel_env = None
        try:
            super().__post_init__()
        finally:
            os.environ.update(hidden)
            paddle_parallel._global_parallel_env = None


def unsupported(trainer: _Trainer) -> list[str]:
    """What this Trainer would do that Tide cannot keep exact across resizes, one line each."""
    args, ds, cls = trainer.args, trainer.train_dataset, type(trainer)
    out = []
    if ds is None:
        out.append("train_dataset: none given")
    elif isinstance(ds, paddle.io.IterableDataset) or not hasattr(ds, "__len__"):
        out.append(
            f"train_dataset: {type(ds).__name__} has no length (an iterable or streaming"
            " dataset): Tide's sampler reshards indices, so it needs a map-style dataset"
        )
    for name in ("_get_train_sampler", "get_train_dataloader", "training_step", "compute_loss"):
        if getattr(cls, name) is not getattr(Trainer, name):
            out.append(
                f"{cls.__name__}.{name}: overridden; Tide's checked sampler and loop replace it"
            )
    flags = {
        "streaming": "a streaming dataset has no indices to reshard",
        "use_hybrid_parallel": "tensor/pipeline/sharding parallelism: data parallelism only",
        "fp16": "AMP (fp16/bf16): not carried by this adapter yet",
        "bf16": "AMP (fp16/bf16): not carried by this adapter yet",
    }
    for flag, why in flags.items():
        if getattr(args, flag, False):
            out.append(f"TrainingArguments.{flag}: {why}")
    if getattr(args, "max_grad_norm", 0.0):
        # The Trainer clips each rank's own gradient before its all-reduce: not the global norm.
        out.append("TrainingArguments.max_grad_norm: set it to 0 (clip in the optimizer)")
    return out


class Trainer(_Trainer):  # type: ignore[misc]
    """PaddleFormers' ``Trainer`` whose ``train()`` runs an elastic ``ElasticSession`` loop."""

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> TrainOutput:
        problems = unsupported(self)
        if resume_from_checkpoint not in (None, False, True):
            # True (the newest checkpoint in output_dir) is what the session does anyway.
            problems.append(
                f"resume_from_checkpoint={resume_from_checkpoint!r}: Tide restores the newest"
                " state of output_dir/tide by itself; a PaddleFormers checkpoint is not read"
            )
        if problems:
            raise UsageError("; ".join(problems))
        session = ElasticSession.from_env(self.session_config())
        session.init_process_group()
        if session.world_size > 1:
            # The generation's rank, for should_save/should_log (the arguments saw one
            # process): only rank 0 of a generation writes the Trainer's own files.
            self.args.local_rank = int(os.environ.get("PADDLE_RANK_IN_NODE", "0"))
        max_steps = session.config.max_steps
        self.create_optimizer_and_scheduler(num_training_steps=max_steps)
        session.attach(self.model, self.optimizer, self.lr_scheduler)
        self.state.global_step = session.restore()
        loader = session.data_loader(
            self.train_dataset,
            collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers,
        )
        self.model.train()
        total, steps = 0.0, 0
        for batch in loader:
            step_loss = session.step(self.per_sample_loss(self.model, batch))
            if step_loss is not None:
                total, steps = total + step_loss, steps + 1
                self.state.global_step += 1
        session.finish()
        if session.config.log_dir and session.rank == 0:
            # The parity check's input (bench/frameworks.py), as tide/trainer/examples/ write it.
            params = {k: v.numpy() for k, v in self.model.state_dict().items()}
            np.savez(os.path.join(session.config.log_dir, "final_params.npz"), **params)
        return TrainOutput(self.state.global_step, total / max(steps, 1), {})

    def session_config(self) -> SessionConfig:
        args = self.args
        data_parallel = int(os.environ.get("TIDE_DATA_PARALLEL", "1"))
        global_batch = (
            args.per_device_train_batch_size * args.gradient_accumulation_steps * data_parallel
        )
        size = len(self.train_dataset)
        max_steps = args.max_steps
        if max_steps <= 0:
            max_steps = math.ceil(args.num_train_epochs * size / global_batch)
        strategy = getattr(args.save_strategy, "value", args.save_strategy)
        every = args.save_steps if strategy == "steps" else 0
        return SessionConfig(
            dataset_size=size,
            global_batch=global_batch,
            seed=args.seed,
            max_steps=max_steps,
            checkpoint_dir=os.path.join(args.output_dir, "tide"),
            checkpoint=CheckpointSettings(every_steps=every),
            # The sample-id and loss logs (the exactly-once and parity checks), if asked for.
            log_dir=getattr(args, "tide_log_dir", ""),
            accumulation_steps=args.gradient_accumulation_steps,
        )

    @staticmethod
    def per_sample_loss(model: Any, batch: Mapping[str, Any]) -> Any:
        """Each sample's mean token loss (labels already aligned with the logits, as
        PaddleFormers' datasets give them; ``-100`` ignored): the session's per-sample form,
        which it averages over the global batch whatever the world."""
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        out = model(**inputs)
        logits = out[0] if isinstance(out, tuple) else out.logits
        labels = batch["labels"]
        tokens = F.cross_entropy(
            logits.astype("float32"),
            labels.unsqueeze(-1),
            reduction="none",
            ignore_index=IGNORE_INDEX,
        ).squeeze(-1)
        valid = (labels != IGNORE_INDEX).astype("float32")
        return (tokens * valid).sum(axis=-1) / valid.sum(axis=-1).clip(min=1.0)
