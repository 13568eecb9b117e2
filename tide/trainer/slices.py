"""Where a new generation's worker of a model-parallel job gets its state: its own slice of
the model (tide/trainer/layout.py), from its pod's memory, a stayer at the same model-parallel
coordinates, or its slice's durable store (docs/sharded.md "Layouts").

The rule is tide/trainer/restore.py's, slice by slice. Every rank that holds a state in its
pod's memory reads it (its own memory: a stayer's step), and the state's layout file says
which rank of which world held it. The ranks gather (step, old rank, old world, their slice
store's newest step) and plan (:func:`~tide.trainer.layout.plan_slices`): when the newest step
in memory has a holder for every slice the new world needs, a rank whose old slice is its new
one keeps it, and each newcomer (or a stayer now at another slice) is sent its slice by a
holder of that slice, with tide/trainer/transfer.py's chunked ``send_state`` over the world
group, one source after another in the same order on every rank (a rank not receiving from
that source drops the bytes).

When memory holds the newest step but cannot bring it to every rank (a slice none of its
holders stayed with, a damaged transfer), the fallback is restore.py's: for each slice whose
store lacks that step, the lowest rank holding it in memory writes it there, and every rank
without it intact reads its own slice's store at that step. A slice neither memory nor its
store holds at that step fails the restore loudly, on every rank: never a restart from
scratch or from an older step.

After a crash (memory holds nothing newer), every rank reads its slice's store at the newest
step present in every slice's store (the stores' step lists are gathered: a slice's writer
may have written steps the others lack). Stores with steps but none in common, a step that
turns out damaged, and a state of another layout fail the restore loudly. An error on one rank
before a collective (a layout file it cannot read, a store it cannot list) travels in the
gathered row or the agreement after it, and every rank raises.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tide.base.errors import ConfigError
from tide.trainer.checkpoint import CheckpointCorrupt, CheckpointNotFound, LoadedCheckpoint
from tide.trainer.handover import StateHandover
from tide.trainer.layout import RankLayout, SliceHolding, coordinates, plan_slices, slice_name
from tide.trainer.persist import DurableStore
from tide.trainer.rawstate import TENSORS, StateFiles, decode
from tide.trainer.restore import Located
from tide.trainer.transfer import TransferSettings, agree, gather_ints, send_state

logger = logging.getLogger(__name__)

# The small file of a model-parallel job's state that says whose slice it is.
LAYOUT_FILE = "tide.layout.json"

Slice = tuple[int, int, int]
# The durable store of a slice (the session's: ``<checkpoint_dir>/slice-...``).
SliceStores = Callable[[Slice], DurableStore]

# A gathered row: step held in memory, its old rank and world, the slice store's newest step
# and how many it lists, and what went wrong on that rank before the gather (_FAILED_*).
_STEP, _OLD_RANK, _OLD_WORLD, _NEWEST, _LISTED, _FAILED = range(6)
_FAILED_NONE, _FAILED_LAYOUT, _FAILED_OTHER = 0, 1, 2


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


def _is_slice(files: Mapping[str, bytes], layout: RankLayout) -> bool:
    """``files`` hold ``layout``'s slice (False for an unreadable layout file too: bytes that
    arrived or were read intact from a peer or store that read them as its own)."""
    try:
        held = read_layout(files, layout)
    except (ConfigError, ValueError, KeyError, TypeError):
        logger.warning("rank %d: a state's layout file is unreadable", layout.rank, exc_info=True)
        return False
    return held is not None and held.coord.slice == layout.coord.slice


def locate_slice(
    layout: RankLayout,
    handover: StateHandover | None,
    store: DurableStore,
    settings: TransferSettings | None = None,
    into: Callable[[], Mapping[str, Any]] | None = None,
    slice_stores: SliceStores | None = None,
) -> Located:
    """This rank's slice of the newest state (see the module docstring). ``store``: this
    rank's slice's durable store. ``into``: this process's live arrays, where a receiver
    takes the bytes. ``slice_stores``: any slice's store, where a rank holding another
    slice in memory writes it when that slice's store lacks the step (the fallback)."""
    out = Located()
    rank, world = layout.rank, layout.world_size
    started = time.monotonic()
    taken: LoadedCheckpoint | None = None
    mine = SliceHolding(0)
    error: Exception | None = None
    on_disk: list[int] = []
    try:
        if handover is not None and handover.latest_step() is not None:
            taken = handover.take()
            held = read_layout(taken.files, layout) if taken is not None else None
            if taken is not None and held is not None:
                mine = SliceHolding(taken.step, held.rank, held.world_size)
        out.handover_s = time.monotonic() - started
        on_disk = store.list_steps()
    except Exception as exc:  # raised below, once every rank knows (no rank left waiting)
        error = exc
    failed = (
        _FAILED_NONE
        if error is None
        else _FAILED_LAYOUT
        if isinstance(error, ConfigError)
        else _FAILED_OTHER
    )
    newest_disk = on_disk[-1] if on_disk else 0
    row = [mine.step, mine.old_rank, mine.old_world, newest_disk, len(on_disk), failed]
    rows = gather_ints(row, world)
    _raise_failed(rows, error, rank)
    holdings = [SliceHolding(r[_STEP], r[_OLD_RANK], r[_OLD_WORLD]) for r in rows]
    in_memory = max(h.step for h in holdings)
    listed: list[list[int]] | None = None
    if not in_memory or in_memory < min(r[_NEWEST] for r in rows):
        # Memory may be older than what every store has: their steps decide.
        listed = _listed(on_disk, rows, world)
        common = _common(listed)
        if not in_memory or in_memory < common:
            return _from_store(layout, store, common, listed, out)
    plan = plan_slices(holdings, layout.model)
    if plan.step:
        if rank in plan.keeps:
            assert taken is not None
            out.step, out.files, out.source = taken.step, taken.files, "memory"
        if _transfer(plan.sends, layout, taken, rank not in plan.keeps, settings, out, into):
            return out
        logger.warning(
            "rank %d: a slice transfer of step %d was damaged; the ranks without it read their "
            "slice's store",
            rank,
            in_memory,
        )
    else:
        logger.warning(
            "rank %d: the states in memory of step %d do not hold every model-parallel slice; "
            "the ranks without theirs read their slice's store",
            rank,
            in_memory,
        )
    if listed is None:
        listed = _listed(on_disk, rows, world)
    _fall_back(in_memory, layout, taken, holdings, listed, store, slice_stores, out)
    return out


def _raise_failed(rows: Sequence[Sequence[int]], error: Exception | None, rank: int) -> None:
    """Every rank raises when some rank could not read its pod's state or list its store:
    that rank its own error, the others one naming it."""
    bad = [r for r, row in enumerate(rows) if row[_FAILED] != _FAILED_NONE]
    if not bad:
        return
    if error is not None:
        raise error
    what = (
        f"rank {rank}: rank(s) {bad} could not read the state in their pod's memory or list "
        "their slice's durable store (see their logs)"
    )
    if any(rows[r][_FAILED] == _FAILED_LAYOUT for r in bad):
        raise ConfigError(f"{what}: a state of another layout (SessionConfig.model_parallel)")
    raise CheckpointNotFound(what)


def _settle(error: Exception | None, rank: int, what: str) -> None:
    """One agreement: when any rank hit ``error``, every rank raises (that one its own)."""
    if agree(int(error is not None), op="max"):
        if error is not None:
            raise error
        raise CheckpointNotFound(f"rank {rank}: another rank failed to {what} (see its log)")


def _listed(on_disk: list[int], rows: Sequence[Sequence[int]], world: int) -> list[list[int]]:
    """Every rank's slice store's steps, by rank (one more gather, padded with zeros)."""
    width = max(r[_LISTED] for r in rows)
    if width == 0:
        return [[] for _ in rows]
    padded = gather_ints([*on_disk, *[0] * (width - len(on_disk))], world)
    return [[s for s in steps if s] for steps in padded]


def _common(listed: Sequence[Sequence[int]]) -> int:
    """The newest step every rank's slice store lists (0: none)."""
    common = set(listed[0]).intersection(*listed[1:]) if listed else set()
    return max(common, default=0)


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
            out.step, out.files, out.source = step, got, "peer"
            out.transfer_s += moved.seconds
            out.received_bytes += moved.nbytes
            # The layout file is read only from intact bytes.
            out.transfer_intact = moved.intact and _is_slice(got, layout)
    return not agree(int(not out.transfer_intact or out.step == 0), op="max")


def _old_slice(holding: SliceHolding, layout: RankLayout) -> Slice:
    return RankLayout(layout.model, holding.old_world, holding.old_rank).coord.slice


def _fall_back(
    step: int,
    layout: RankLayout,
    taken: LoadedCheckpoint | None,
    holdings: Sequence[SliceHolding],
    listed: Sequence[Sequence[int]],
    store: DurableStore,
    slice_stores: SliceStores | None,
    out: Located,
) -> None:
    """Memory holds ``step`` but not every rank has its slice of it: each slice's store that
    lacks it gets it from the lowest rank holding that slice in memory, then every rank
    without its own slice of it in memory reads its store. Raises (every rank) when some
    slice is in neither."""
    rank = layout.rank
    in_store: dict[Slice, bool] = {}
    for r, c in enumerate(coordinates(layout.world_size, layout.model)):
        in_store[c.slice] = in_store.get(c.slice, False) or step in listed[r]
    writers: dict[Slice, int] = {}
    for r, h in enumerate(holdings):
        if h.step == step and h.old_world:
            s = _old_slice(h, layout)
            if not in_store.get(s, True):
                writers.setdefault(s, r)
    lost = [slice_name(s) for s, ok in sorted(in_store.items()) if not ok and s not in writers]
    if lost:
        raise CheckpointNotFound(
            f"rank {rank}: step {step} was in memory but neither memory nor the durable store "
            f"holds it for {', '.join(lost)}: the job cannot resume it"
        )
    error: Exception | None = None
    for s, writer in sorted(writers.items()):
        if writer != rank:
            continue
        assert taken is not None
        try:
            if s == layout.coord.slice:
                target = store
            elif slice_stores is not None:
                target = slice_stores(s)
            else:
                raise CheckpointNotFound(f"no store of {slice_name(s)} to write step {step} to")
            target.write(step, taken.files, {"step": step, "from": "slice fallback"})
        except Exception as exc:
            error = exc
    # Also the barrier between the writes and the reads.
    _settle(error, rank, f"write step {step} to a slice's store")
    keeps = (
        taken is not None
        and taken.step == step
        and holdings[rank].old_world > 0
        and _old_slice(holdings[rank], layout) == layout.coord.slice
    )
    if keeps:
        assert taken is not None
        out.step, out.files, out.source = step, taken.files, "memory"
        out.transfer_intact = True
    else:
        out.step, out.files, out.source = _read(layout, store, step, out)
    if agree(int(out.step != step), op="max"):
        raise CheckpointNotFound(
            f"rank {rank}: step {step} did not reach every rank from memory, and some "
            f"slice's durable store cannot give it (this rank has {out.step or 'none'})"
        )


def _read(
    layout: RankLayout, store: DurableStore, step: int, out: Located
) -> tuple[int, Mapping[str, bytes], str]:
    """This rank's slice of ``step`` from its store: (step, files, "disk"), or (0, {}, "")
    when it is missing, damaged, unreadable or another slice's."""
    started = time.monotonic()
    try:
        loaded = store.load_latest(at_most=step)
    except (CheckpointNotFound, CheckpointCorrupt):
        return 0, {}, ""
    except Exception:
        logger.warning("rank %d: its slice's store failed", layout.rank, exc_info=True)
        return 0, {}, ""
    finally:
        out.disk_read_s += time.monotonic() - started
    if loaded.step != step or not _is_slice(loaded.files, layout):
        return 0, {}, ""
    return step, _as_arrays(loaded.files), "disk"


def _from_store(
    layout: RankLayout,
    store: DurableStore,
    common: int,
    listed: Sequence[Sequence[int]],
    out: Located,
) -> Located:
    """Every rank its slice's durable checkpoint at ``common``, the newest step every
    slice's store has."""
    if common == 0:
        if any(listed):
            raise CheckpointNotFound(
                f"rank {layout.rank}: the model-parallel slices' durable stores have no step in "
                f"common (steps by rank {[list(s) for s in listed]}): the job's store is "
                "incomplete"
            )
        return out
    step, files, source = _read(layout, store, common, out)
    if agree(int(step != common), op="max"):
        raise CheckpointNotFound(
            f"rank {layout.rank}: the durable checkpoint of step {common} is missing or damaged "
            f"in some model-parallel slice's store (this rank read {step or 'none'})"
        )
    out.step, out.files, out.source = step, files, source
    return out


def _as_arrays(files: Mapping[str, bytes]) -> Mapping[str, bytes]:
    """A raw durable state's tensors as named arrays (restore.py does the same)."""
    if TENSORS not in files or getattr(files, "arrays", None):
        return files
    small = {name: data for name, data in files.items() if name != TENSORS}
    return StateFiles(small, decode(files[TENSORS]))
