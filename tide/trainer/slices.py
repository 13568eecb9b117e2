"""Where a new generation's worker of a model-parallel job gets its state: its own slice of
the model (tide/trainer/layout.py), from its pod's memory, a stayer at the same model-parallel
coordinates, or its slice's durable store (docs/sharded.md "Layouts").

The rule is tide/trainer/restore.py's, slice by slice. Every rank that holds a state in its
pod's memory reads it (its own memory: a stayer's step), and the state's layout file says
which rank of which world held it. The ranks gather (step, old rank, old world) and plan
(:func:`~tide.trainer.layout.plan_slices`): when the newest step in memory has a holder for
every slice the new world needs, a rank whose old slice is its new one keeps it, and each
newcomer (or a stayer now at another slice) is sent its slice by a holder of that slice, with
tide/trainer/transfer.py's chunked ``send_state`` over the world group, one source after
another in the same order on every rank (a rank not receiving from that source drops the
bytes). Otherwise (a crash, or a resize that left no holder of some slice) every rank reads
its own slice's durable store at the newest step every slice has; slices whose stores disagree
with no step in common fail the restore loudly, and so does a state of another layout.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from tide.base.errors import ConfigError
from tide.trainer.checkpoint import CheckpointCorrupt, CheckpointNotFound, LoadedCheckpoint
from tide.trainer.handover import StateHandover
from tide.trainer.layout import RankLayout, SliceHolding, plan_slices
from tide.trainer.persist import DurableStore
from tide.trainer.rawstate import TENSORS, StateFiles, decode
from tide.trainer.restore import Located
from tide.trainer.transfer import TransferSettings, agree, gather_ints, send_state

logger = logging.getLogger(__name__)

# The small file of a model-parallel job's state that says whose slice it is.
LAYOUT_FILE = "tide.layout.json"


def layout_file(layout: RankLayout) -> dict[str, bytes]:
    """The layout file of ``layout``'s state (tide/trainer/stepper.py adds it to every state
    the session hands over or writes)."""
    m = layout.model
    body = {
        "rank": layout.rank,
        "world": layout.world_size,
        "mp_degree": m.mp_degree,
        "pp_degree": m.pp_degree,
        "sep_degree": m.sep_degree,
    }
    return {LAYOUT_FILE: json.dumps(body).encode()}


def read_layout(files: Mapping[str, bytes], layout: RankLayout) -> RankLayout | None:
    """The layout a state was held as (None: it has no layout file); a ConfigError naming
    the degrees when they are not this job's."""
    raw = files.get(LAYOUT_FILE)
    if raw is None:
        return None
    body = json.loads(bytes(raw))
    m = layout.model
    theirs = (body["mp_degree"], body["pp_degree"], body["sep_degree"])
    if theirs != (m.mp_degree, m.pp_degree, m.sep_degree):
        raise ConfigError(
            f"a state of mp_degree x pp_degree x sep_degree = {theirs[0]} x {theirs[1]} x "
            f"{theirs[2]}, this job's is {m.mp_degree} x {m.pp_degree} x {m.sep_degree}: "
            "a checkpoint of another layout cannot be resumed (SessionConfig.model_parallel)"
        )
    return RankLayout(m, int(body["world"]), int(body["rank"]))


def locate_slice(
    layout: RankLayout,
    handover: StateHandover | None,
    store: DurableStore,
    settings: TransferSettings | None = None,
    into: Callable[[], Mapping[str, Any]] | None = None,
) -> Located:
    """This rank's slice of the newest state (see the module docstring). ``store``: this
    rank's slice's durable store. ``into``: this process's live arrays, where a receiver
    takes the bytes."""
    out = Located()
    rank, world = layout.rank, layout.world_size
    started = time.monotonic()
    taken: LoadedCheckpoint | None = None
    mine = SliceHolding(0)
    if handover is not None and handover.latest_step() is not None:
        taken = handover.take()
        held = read_layout(taken.files, layout) if taken is not None else None
        if taken is not None and held is not None:
            mine = SliceHolding(taken.step, held.rank, held.world_size)
    out.handover_s = time.monotonic() - started
    on_disk = store.list_steps()
    newest_disk = on_disk[-1] if on_disk else 0
    rows = gather_ints([mine.step, mine.old_rank, mine.old_world, newest_disk], world)
    plan = plan_slices([SliceHolding(s, r, w) for s, r, w, _ in rows], layout.model)
    common_disk = min(row[3] for row in rows)
    if plan.step and plan.step >= common_disk:
        receiving = rank not in plan.keeps
        if not receiving:
            assert taken is not None
            out.step, out.files, out.source = taken.step, taken.files, "memory"
        if _transfer(plan.sends, layout, taken, receiving, settings, out, into):
            return out
        logger.warning("rank %d: a slice transfer was damaged; every rank reads its store", rank)
    elif plan.step == 0 and max(row[0] for row in rows):
        logger.warning(
            "rank %d: the states in memory do not hold every model-parallel slice; every "
            "rank reads its slice's durable store",
            rank,
        )
    return _from_store(layout, store, rows, out)


def _transfer(
    sends: Mapping[int, tuple[int, ...]],
    layout: RankLayout,
    taken: LoadedCheckpoint | None,
    receiving: bool,
    settings: TransferSettings | None,
    out: Located,
    into: Callable[[], Mapping[str, Any]] | None,
) -> bool:
    """Each source's slice to its receivers, one source after another; True when every
    rank has its slice of the planned step intact (one all_reduce says so)."""
    settings = settings or TransferSettings.from_env()
    rank = layout.rank
    live = into() if receiving and into is not None else None
    for source, receivers in sorted(sends.items()):
        files = None
        if rank == source:
            assert taken is not None
            files = StateFiles(taken.files, getattr(taken.files, "arrays", None))
        keep = rank in receivers
        step, got, moved = send_state(
            files, taken.step if taken else 0, source, rank, settings.chunk_bytes, keep, live
        )
        if keep:
            held = read_layout(got, layout)
            right = held is not None and held.coord.slice == layout.coord.slice
            out.step, out.files, out.source = step, got, "peer"
            out.transfer_s += moved.seconds
            out.received_bytes += moved.nbytes
            out.transfer_intact = moved.intact and right
    if world_failed := agree(int(not out.transfer_intact or (out.step == 0)), op="max"):
        out.step, out.files, out.source = 0, {}, ""
    return not world_failed


def _from_store(
    layout: RankLayout, store: DurableStore, rows: list[list[int]], out: Located
) -> Located:
    """Every rank its slice's durable checkpoint at the newest step all slices have."""
    newest = [row[3] for row in rows]
    common = min(newest)
    if common == 0:
        if max(newest):
            raise CheckpointNotFound(
                f"rank {layout.rank}: some model-parallel slices have durable checkpoints and "
                f"some none (newest steps by rank {newest}): the job's store is incomplete"
            )
        return out
    started = time.monotonic()
    loaded: LoadedCheckpoint | None = None
    try:
        loaded = store.load_latest(at_most=common)
    except (CheckpointNotFound, CheckpointCorrupt):
        loaded = None
    out.disk_read_s += time.monotonic() - started
    step = loaded.step if loaded is not None else 0
    held = read_layout(loaded.files, layout) if loaded is not None else None
    right = held is not None and held.coord.slice == layout.coord.slice
    if agree(step if right else 0, op="min") != common or agree(step, op="max") != common:
        raise CheckpointNotFound(
            f"rank {layout.rank}: the durable checkpoint of step {common} is missing or damaged "
            f"in some model-parallel slice's store (this rank read {step or 'none'})"
        )
    assert loaded is not None
    out.step, out.files, out.source = step, _as_arrays(loaded.files), "disk"
    return out


def _as_arrays(files: Mapping[str, bytes]) -> Mapping[str, bytes]:
    """A raw durable state's tensors as named arrays (restore.py does the same)."""
    if TENSORS not in files or getattr(files, "arrays", None):
        return files
    small = {name: data for name, data in files.items() if name != TENSORS}
    return StateFiles(small, decode(files[TENSORS]))
