"""The state a stayer hands to its own next worker, in the pod's memory.

At a planned resize every rank holds at one step; the pod's first worker (local rank 0)
writes the training state into the pod's shared memory (``/dev/shm``, which every process
of the pod's container shares and which lives in RAM), and the next generation's workers of
the same pod read it from there: a planned resize reads nothing from disk. A newcomer pod
has nothing there and receives the state from a peer over the new process group
(trainer/transfer.py).

:class:`StateHandover` is the seam; :class:`ShmHandover` the one real implementation, a
:class:`~trainer.checkpoint.CheckpointStore` on a directory in shared memory, so a handover
has the same atomic commit and sha256 verification as a checkpoint (keep 1). The launcher
names the directory (``TIDE_HANDOVER_DIR``) and removes it when it exits.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from trainer.checkpoint import (
    CheckpointNotFound,
    CheckpointStore,
    LoadedCheckpoint,
    WrittenCheckpoint,
)

logger = logging.getLogger(__name__)

HANDOVER_DIR_ENV = "TIDE_HANDOVER_DIR"
SHM = Path("/dev/shm")


class StateHandover(Protocol):
    def put(
        self, step: int, files: Mapping[str, bytes], meta: Mapping[str, Any]
    ) -> WrittenCheckpoint:
        """Hand over the state of ``step`` (replacing any older one)."""
        ...

    def latest_step(self) -> int | None:
        """The step handed over, without reading it; None if none."""
        ...

    def take(self) -> LoadedCheckpoint | None:
        """The state handed over (verified), or None."""
        ...


class ShmHandover:
    def __init__(self, root: Path | str) -> None:
        self.store = CheckpointStore(root, keep=1)

    def put(
        self, step: int, files: Mapping[str, bytes], meta: Mapping[str, Any]
    ) -> WrittenCheckpoint:
        return self.store.write(step, files, meta)

    def latest_step(self) -> int | None:
        steps = self.store.list_steps()
        return steps[-1] if steps else None

    def take(self) -> LoadedCheckpoint | None:
        try:
            return self.store.load_latest()
        except CheckpointNotFound:
            return None


def pod_handover_dir(job_id: str, pod_name: str, launcher_id: str) -> Path:
    """Where a launcher's workers hand state over: shared memory when the pod has it."""
    base = SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else Path(tempfile.gettempdir())
    safe_job = job_id.replace("/", "_")
    return base / f"tide-handover-{safe_job}-{pod_name}-{launcher_id[:8]}"
