"""Where a new generation's worker gets its state: its pod's memory, a peer, or the durable
store, in that order of preference (trainer/transfer.py has the rule; docs/trainer.md).

Every rank reports the newest step it holds without reading it (the handover's and the
durable store's listings); the ranks agree on a plan; then either every rank loads its own
handover, or one rank loads (from memory, or from disk when nobody has the step in memory)
and broadcasts. A checkpoint that turns out damaged when the source reads it makes the
source fall back to an older one, and since everyone takes the source's bytes, the ranks
still agree. The time spent reading memory, reading disk and transferring is measured apart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from trainer.checkpoint import CheckpointCorrupt, CheckpointNotFound, LoadedCheckpoint
from trainer.handover import StateHandover
from trainer.persist import DurableStore
from trainer.transfer import Holding, Where, all_holdings, broadcast_files, plan_restore

logger = logging.getLogger(__name__)

# The step travels with the files of a broadcast under this (checkpoint-safe) name.
STEP_FILE = "tide.step"


@dataclass
class Located:
    step: int = 0
    files: Mapping[str, bytes] = field(default_factory=dict)
    # Where this rank's copy came from: "memory", "disk", "peer" or "" (from scratch).
    source: str = ""
    handover_s: float = 0.0
    disk_read_s: float = 0.0
    transfer_s: float = 0.0


def _holding(handover: StateHandover | None, store: DurableStore) -> Holding:
    in_memory = handover.latest_step() if handover is not None else None
    on_disk = store.list_steps()
    newest_disk = on_disk[-1] if on_disk else 0
    if in_memory is not None and in_memory >= newest_disk:
        return Holding(in_memory, Where.MEMORY)
    if newest_disk:
        return Holding(newest_disk, Where.DISK)
    return Holding(0, Where.NOWHERE)


def _read(
    where: Where,
    step: int,
    handover: StateHandover | None,
    store: DurableStore,
    out: Located,
) -> LoadedCheckpoint | None:
    started = time.monotonic()
    loaded: LoadedCheckpoint | None = None
    if where is Where.MEMORY and handover is not None:
        loaded = handover.take()
        out.handover_s += time.monotonic() - started
        if loaded is not None and loaded.step == step:
            out.source = "memory"
            return loaded
        logger.warning("handover of step %d missing or damaged; reading the durable store", step)
        started = time.monotonic()
    try:
        loaded = store.load_latest(at_most=step)
        out.source = "disk"
    except (CheckpointNotFound, CheckpointCorrupt):
        loaded = None
    out.disk_read_s += time.monotonic() - started
    return loaded


def locate(
    handover: StateHandover | None, store: DurableStore, rank: int, world_size: int
) -> Located:
    out = Located()
    mine = _holding(handover, store)
    plan = plan_restore(all_holdings(mine, world_size))
    if plan.step == 0:
        return out
    if world_size == 1:
        # Alone: whatever this rank holds that verifies (an older one if the newest is
        # damaged).
        loaded = _read(mine.where, plan.step, handover, store, out)
        if loaded is not None:
            out.step, out.files = loaded.step, loaded.files
        return out
    if not plan.broadcast:
        loaded = _read(mine.where, plan.step, handover, store, out)
        if loaded is None or loaded.step != plan.step:
            # Every rank said it holds the step in memory: one that cannot must not go on
            # alone with another step.
            raise CheckpointNotFound(f"rank {rank} lost its handover of step {plan.step}")
        out.step, out.files = loaded.step, loaded.files
        return out
    files: dict[str, bytes] | None = None
    if rank == plan.source:
        loaded = _read(mine.where, plan.step, handover, store, out)
        if loaded is not None:
            files = {**loaded.files, STEP_FILE: str(loaded.step).encode()}
        else:
            files = {STEP_FILE: b"0"}
    started = time.monotonic()
    received = broadcast_files(files, plan.source, rank)
    if rank != plan.source:
        out.transfer_s = time.monotonic() - started
        out.source = "peer"
    out.step = int(received.pop(STEP_FILE, b"0"))
    out.files = received
    if out.step != plan.step:
        logger.warning("rank %d broadcast step %d instead of %d", plan.source, out.step, plan.step)
    return out
