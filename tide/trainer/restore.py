"""Where a new generation's worker gets its state: its pod's memory, a peer, or the durable
store, in that order of preference (tide/trainer/transfer.py has the rule; docs/trainer.md).

Every rank reports the newest step it holds without reading it (the handover's and the
durable store's listings); the ranks agree on a plan; every rank that holds the step in memory
takes its own (a stayer), and the lowest of them sends it to the others (the newcomers) over
the new group; a large state goes to the newcomers alone, from one or more stayers over groups
of their own (tide/trainer/transfer.py, ``Fanout``). After a crash (nobody has it in memory) one rank reads the
durable store and sends it. A checkpoint that turns out damaged when the source reads it makes the
source fall back to an older one, and since every receiver takes the source's bytes, the ranks
still agree.

A transfer whose chunks arrive damaged falls back to the durable store: every rank learns it
(an all_reduce), the source makes sure the store has the step (it writes the state it holds
if not, synchronously: a fallback, not the planned path), and the receivers read it there;
the stayers keep the state they took. A receiver that still cannot get the step fails the
restore loudly. The time spent reading memory, reading disk and transferring is measured apart.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tide.trainer.checkpoint import CheckpointCorrupt, CheckpointNotFound, LoadedCheckpoint
from tide.trainer.handover import StateHandover
from tide.trainer.persist import DurableStore
from tide.trainer.rawstate import TENSORS, StateFiles, decode
from tide.trainer.transfer import (
    Fanout,
    Holding,
    RestorePlan,
    TransferSettings,
    Where,
    agree,
    all_holdings,
    plan_restore,
    send_state,
)

logger = logging.getLogger(__name__)


@dataclass
class Located:
    step: int = 0
    files: Mapping[str, bytes] = field(default_factory=dict)
    # Where this rank's copy came from: "memory", "disk", "peer" or "" (from scratch).
    source: str = ""
    handover_s: float = 0.0
    disk_read_s: float = 0.0
    transfer_s: float = 0.0
    # Received over the group (a receiver), bytes; False: a damaged transfer was replaced
    # by the durable store's copy.
    transfer_intact: bool = True
    received_bytes: int = 0
    # How many stayers sent it over groups of their own (0: the whole group's broadcast).
    transfer_senders: int = 0


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
        loaded = _as_arrays(store.load_latest(at_most=step))
        out.source = "disk"
    except (CheckpointNotFound, CheckpointCorrupt):
        loaded = None
    out.disk_read_s += time.monotonic() - started
    return loaded


def _as_arrays(loaded: LoadedCheckpoint) -> LoadedCheckpoint:
    """A raw durable checkpoint's ``state.tensors`` as named arrays (views of the bytes read,
    no copy), the form a transfer sends as tensors: left as one file, it would travel inside
    the small files' packed blob, the whole state joined into one new buffer."""
    files = loaded.files
    if TENSORS not in files or getattr(files, "arrays", None):
        return loaded
    small = {name: data for name, data in files.items() if name != TENSORS}
    return dataclasses.replace(loaded, files=StateFiles(small, decode(files[TENSORS])))


def locate(
    handover: StateHandover | None,
    store: DurableStore,
    rank: int,
    world_size: int,
    settings: TransferSettings | None = None,
    into: Callable[[], Mapping[str, Any]] | None = None,
) -> Located:
    """This rank's state (see the module docstring). ``into``: gives this process's live
    arrays (paddle_state.live_arrays), asked for only by a newcomer, which receives
    straight into them (no new memory for what its model has already; loading them is
    then a copy onto themselves)."""
    out = Located()
    mine = _holding(handover, store)
    plan = plan_restore(all_holdings(mine, world_size))
    if plan.step == 0:
        return out
    receiving = rank in plan.receivers
    loaded: LoadedCheckpoint | None = None
    if not receiving:
        loaded = _read(mine.where, plan.step, handover, store, out)
        if loaded is not None:
            out.step, out.files = loaded.step, loaded.files
    if world_size == 1:
        # Alone: whatever this rank holds that verifies (an older one if the newest is
        # damaged).
        return out
    if plan.transfer:
        _transfer(
            plan, rank, world_size, receiving, settings, out, into() if receiving and into else None
        )
    # One all_reduce: a rank without the planned step (a damaged transfer, a handover it
    # listed but could not take) must not go on alone with another step.
    if agree(int(out.step != plan.step or not out.transfer_intact)):
        _fall_back(plan.step, plan.source, rank, store, out)
    return out


def _transfer(
    plan: RestorePlan,
    rank: int,
    world_size: int,
    receiving: bool,
    settings: TransferSettings | None,
    out: Located,
    into: Mapping[str, Any] | None,
) -> None:
    settings = settings or TransferSettings.from_env()
    files = StateFiles(out.files, getattr(out.files, "arrays", None))
    keepers = tuple(r for r in range(world_size) if r not in plan.receivers)
    fanout = Fanout(keepers, plan.receivers, settings.group_min_bytes, settings.senders_max)
    # A stayer that did not get the planned step (its handover damaged, an older one read
    # from disk) sends nothing but the source's fallback path.
    mine = files if rank == plan.source or (not receiving and out.step == plan.step) else None
    step, got, moved = send_state(
        mine,
        out.step,
        plan.source,
        rank,
        settings.chunk_bytes,
        receiving,
        into,
        fanout,
    )
    if moved.senders:
        logger.info(
            "rank %d: state of step %d to ranks %s from %d sender(s) over their own groups "
            "(formed in %.3fs), %.3fs",
            rank,
            plan.step,
            list(plan.receivers),
            moved.senders,
            moved.group_s,
            moved.seconds,
        )
    if receiving:
        out.step, out.files, out.source = step, got, "peer"
        out.transfer_s = moved.seconds
        out.transfer_intact = moved.intact
        out.received_bytes = moved.nbytes
        out.transfer_senders = moved.senders
        if step != plan.step:
            logger.warning("rank %d sent step %d instead of %d", plan.source, step, plan.step)


def _fall_back(step: int, source: int, rank: int, store: DurableStore, out: Located) -> None:
    """Some rank lacks ``step`` (a damaged transfer): those ranks read it from the durable
    store, which the source fills first if it lacks it; the others keep what they took.
    Every rank then checks that every rank has the step."""
    missing = out.step != step or not out.transfer_intact
    logger.warning(
        "rank %d: step %d did not reach every rank intact (this one %s); "
        "the ranks without it read the durable store",
        rank,
        step,
        "lacks it" if missing else "has it",
    )
    if rank == source and out.step == step and step not in store.list_steps():
        store.write(step, out.files, {"step": step, "from": "transfer fallback"})
    agree(0)
    if missing:
        started = time.monotonic()
        try:
            loaded = _as_arrays(store.load_latest(at_most=step))
            out.step, out.files, out.source = loaded.step, loaded.files, "disk"
        except (CheckpointNotFound, CheckpointCorrupt):
            out.step = 0
        out.disk_read_s += time.monotonic() - started
    if agree(int(out.step == step), op="min") == 0:
        raise CheckpointNotFound(
            f"rank {rank}: the transfer of step {step} was damaged and the durable store "
            "cannot replace it on every rank"
        )
