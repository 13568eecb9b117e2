"""Tide's trainer side. The public API a training script uses (docs/trainer.md)::

    from tide.trainer import ElasticSession, SessionConfig, CheckpointSettings

The names load lazily: the launcher and the zygote import ``tide.trainer.*`` modules too, and
must not pay for (or fork after) Paddle's import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tide.trainer.checkpoint import CheckpointSettings
    from tide.trainer.contract import (
        BatchMismatch,
        ContractError,
        LossContractError,
        UsageError,
    )
    from tide.trainer.dataloader import PlannedBatch, SeedWorker, TideBatchSampler
    from tide.trainer.sampler import MicroBatch, ResumableSampler, SamplerConfig
    from tide.trainer.session import ElasticSession, SessionConfig, SessionExit

_WHERE = {
    "ElasticSession": "tide.trainer.session",
    "SessionConfig": "tide.trainer.session",
    "SessionExit": "tide.trainer.session",
    "CheckpointSettings": "tide.trainer.checkpoint",
    "TideBatchSampler": "tide.trainer.dataloader",
    "PlannedBatch": "tide.trainer.dataloader",
    "SeedWorker": "tide.trainer.dataloader",
    "MicroBatch": "tide.trainer.sampler",
    "ResumableSampler": "tide.trainer.sampler",
    "SamplerConfig": "tide.trainer.sampler",
    "ContractError": "tide.trainer.contract",
    "UsageError": "tide.trainer.contract",
    "BatchMismatch": "tide.trainer.contract",
    "LossContractError": "tide.trainer.contract",
}

__all__ = [
    "BatchMismatch",
    "CheckpointSettings",
    "ContractError",
    "ElasticSession",
    "LossContractError",
    "MicroBatch",
    "PlannedBatch",
    "ResumableSampler",
    "SamplerConfig",
    "SeedWorker",
    "SessionConfig",
    "SessionExit",
    "TideBatchSampler",
    "UsageError",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'tide.trainer' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
