"""Tide's trainer side. The public API a training script uses (docs/trainer.md)::

    from trainer import ElasticSession, SessionConfig, CheckpointSettings

The names load lazily: the launcher and the zygote import ``trainer.*`` modules too, and
must not pay for (or fork after) Paddle's import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.checkpoint import CheckpointSettings
    from trainer.contract import (
        BatchMismatch,
        ContractError,
        LossContractError,
        UsageError,
    )
    from trainer.dataloader import PlannedBatch, SeedWorker, TideBatchSampler
    from trainer.sampler import MicroBatch, ResumableSampler, SamplerConfig
    from trainer.session import ElasticSession, SessionConfig, SessionExit

_WHERE = {
    "ElasticSession": "trainer.session",
    "SessionConfig": "trainer.session",
    "SessionExit": "trainer.session",
    "CheckpointSettings": "trainer.checkpoint",
    "TideBatchSampler": "trainer.dataloader",
    "PlannedBatch": "trainer.dataloader",
    "SeedWorker": "trainer.dataloader",
    "MicroBatch": "trainer.sampler",
    "ResumableSampler": "trainer.sampler",
    "SamplerConfig": "trainer.sampler",
    "ContractError": "trainer.contract",
    "UsageError": "trainer.contract",
    "BatchMismatch": "trainer.contract",
    "LossContractError": "trainer.contract",
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
        raise AttributeError(f"module 'trainer' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
