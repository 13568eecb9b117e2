"""Training state from a peer over the new process group, instead of from storage.

When a generation forms, every rank says which step it holds and where
(:class:`Holding`: in memory, handed over by its pod's previous worker, or on disk in its
durable store). :func:`plan_restore` picks the newest step any rank holds, who loads its own
copy and who receives it: every rank that holds that step in memory loads its own (a stayer
keeps what it holds), and the lowest of them sends it to every other rank (the newcomers); when
nobody has it in memory, the lowest rank that has it on disk reads it and sends it to all. So
a newcomer never reads storage, a stayer never reads disk nor receives anything on a planned
resize, and after a crash one rank reads the durable store and the others get it from it.
This is how TorchFT and Horovod's elastic mode bring a new worker up to date.

:func:`send_tensors` moves named tensors (their names, dtypes and shapes first) from one
holder to receivers over a process group, as tensors: each array is broadcast in chunks of at
most ``chunk_bytes``, straight from the holder's memory into the receiver's array (DLPack
views on both sides, no packed buffer, no copy), each chunk checked with xxh3-64. Arrays under
``BUNDLE_BELOW_BYTES`` travel several to a broadcast, through one copy on each side. It is the
path any state takes between ranks (optimizer shards of a sharded job too). The small files of
a state travel as one more tensor beside the arrays.

A state of at least ``group_min_mb`` goes to the newcomers alone (:class:`Fanout`): every
rank forms one gloo group per sender, the sender and the newcomers (tide/trainer/gloo_groups.py
forms such a subgroup over a TCP store of its own), and each sender broadcasts its share of
the chunks over its group; a newcomer receives from every sender at once, one thread per
group. The senders are the lowest stayers (up to ``senders_max``) whose arrays match the
source's names, dtypes and shapes at the planned step: data-parallel replicas hold the same
bytes, so a newcomer's arrays are the same whichever stayer sent each chunk; the small files
(RNG state, the sampler's position) come from the source alone. The other stayers make no
collective call at all and receive nothing. A smaller state goes over the whole new group, a
stayer that is not the source taking part with one chunk-sized buffer and dropping the bytes:
forming a subgroup (Paddle's gloo connects each pair through the store) costs more than the
bytes it spares below a few hundred MB (docs/trainer.md).

What the checksum guards against: bytes that differ between the holder and a receiver (a
transport or buffer fault, a chunk written into the wrong place, a receiver's layout that does
not match the sender's). It is not a defence against an adversary (xxh3 is not
cryptographic); the durable checkpoints keep sha256.
"""

from __future__ import annotations

import enum
import json
import os
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from tide.base.errors import ConfigError
from tide.trainer.rawstate import StateFiles, TensorSpec, allocate, byte_view, specs

# Env var: the largest piece one collective moves, MB (TransferSettings).
CHUNK_MB_ENV = "TIDE_TRANSFER_CHUNK_MB"
# Env vars: the least state, MB, that goes to the newcomers alone over groups of their own,
# and the most stayers that send a share of it (TransferSettings).
GROUP_MIN_MB_ENV = "TIDE_TRANSFER_GROUP_MIN_MB"
SENDERS_MAX_ENV = "TIDE_TRANSFER_SENDERS_MAX"
# Env var naming a fault a receiver injects (tests): "flip" changes one received byte.
FAULT_ENV = "TIDE_TRANSFER_FAULT"
# The small files of a state travel as this tensor beside its arrays.
FILES_TENSOR = "tide.files"
# Pieces under this size travel bundled, several per broadcast up to a chunk (a copy each into
# and out of the bundle): each broadcast costs a round trip over the group whatever its size,
# and an optimizer's state holds many small tensors (biases, norms, step counters).
BUNDLE_BELOW_BYTES = 1 << 20


class Where(enum.IntEnum):
    NOWHERE = 0
    DISK = 1
    MEMORY = 2


@dataclass(frozen=True)
class Holding:
    """What one rank holds: its newest step (0: none) and where."""

    step: int
    where: Where


@dataclass(frozen=True)
class RestorePlan:
    step: int
    # The rank that sends the state to ``receivers``; -1: nobody sends.
    source: int = -1
    receivers: tuple[int, ...] = ()

    @property
    def transfer(self) -> bool:
        return bool(self.receivers)


@dataclass(frozen=True)
class TransferSettings:
    # The largest piece one collective moves, MB: what a transfer holds in flight beyond the
    # state's own arrays (a holder whose arrays cannot be shared with the transport copies
    # one chunk at a time).
    chunk_mb: float = 64.0
    # A state at least this large (MB) goes to the newcomers alone, over one group per
    # sender formed for it (Fanout); a smaller one by broadcast over the whole new group,
    # the other stayers dropping the bytes. Forming a group has its cost (docs/trainer.md).
    group_min_mb: float = 256.0
    # The most stayers that send a share of a state each, over groups of their own (1: the
    # lowest stayer alone). Each sender's group is formed in turn, in the pause.
    senders_max: int = 1

    def __post_init__(self) -> None:
        if self.chunk_mb <= 0:
            raise ConfigError(f"chunk_mb must be > 0, got {self.chunk_mb}")
        if self.group_min_mb < 0:
            raise ConfigError(f"group_min_mb must be >= 0, got {self.group_min_mb}")
        if self.senders_max < 1:
            raise ConfigError(f"senders_max must be >= 1, got {self.senders_max}")

    @property
    def chunk_bytes(self) -> int:
        return max(1, int(self.chunk_mb * 2**20))

    @property
    def group_min_bytes(self) -> int:
        return int(self.group_min_mb * 2**20)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TransferSettings:
        e = os.environ if env is None else env
        values: dict[str, Any] = {}
        for key, name, kind in (
            (CHUNK_MB_ENV, "chunk_mb", float),
            (GROUP_MIN_MB_ENV, "group_min_mb", float),
            (SENDERS_MAX_ENV, "senders_max", int),
        ):
            raw = e.get(key, "")
            if raw:
                try:
                    values[name] = kind(raw)
                except ValueError as exc:
                    raise ConfigError(f"{key}={raw!r}: {exc}") from exc
        return cls(**values)


@dataclass(frozen=True)
class Fanout:
    """A transfer that may go to the newcomers alone: ``keepers`` hold the state (the source
    first), ``receivers`` lack it. Over groups of their own when the state has at least
    ``min_bytes`` and some stayer would otherwise receive it; from up to ``senders_max``
    keepers, each with a share of the chunks."""

    keepers: tuple[int, ...]
    receivers: tuple[int, ...]
    min_bytes: int
    senders_max: int = 1

    def applies(self, nbytes: int) -> bool:
        return bool(self.receivers) and len(self.keepers) > 1 and nbytes >= self.min_bytes


@dataclass
class Transferred:
    """What :func:`send_tensors` moved, and whether every chunk arrived intact."""

    arrays: dict[str, Any] = field(default_factory=dict)
    nbytes: int = 0
    chunks: int = 0
    intact: bool = True
    seconds: float = 0.0
    # How many ranks sent (0: the whole-group broadcast) and the seconds spent forming their
    # groups.
    senders: int = 0
    group_s: float = 0.0


def plan_restore(holdings: Sequence[Holding]) -> RestorePlan:
    newest = max(h.step for h in holdings)
    if newest == 0:
        return RestorePlan(0)
    have = [r for r, h in enumerate(holdings) if h.step == newest]
    in_memory = [r for r in have if holdings[r].where is Where.MEMORY]
    keep = set(in_memory) if in_memory else {have[0]}
    source = min(keep)
    receivers = tuple(r for r in range(len(holdings)) if r not in keep)
    return RestorePlan(newest, source if receivers else -1, receivers)


def all_holdings(mine: Holding, world_size: int) -> list[Holding]:
    """Every rank's holding, gathered over the current group."""
    rows = gather_ints([mine.step, int(mine.where)], world_size)
    return [Holding(step, Where(where)) for step, where in rows]


def gather_ints(values: Sequence[int], world_size: int) -> list[list[int]]:
    """Every rank's ``values`` (the same length on every rank), by rank, over the world
    group."""
    if world_size == 1:
        return [list(values)]
    import paddle
    import paddle.distributed as dist

    gathered: list[paddle.Tensor] = []
    dist.all_gather(gathered, paddle.to_tensor(list(values), dtype="int64"))
    return [[int(v) for v in g.numpy()] for g in gathered]


def agree(flag: int, op: str = "max") -> int:
    """The max (or min) of ``flag`` over the world group."""
    import paddle
    import paddle.distributed as dist

    t = paddle.to_tensor([flag], dtype="int64")
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN)
    return int(t.numpy()[0])


def _broadcast(array: Any, source: int, group: Any) -> None:
    import paddle
    import paddle.distributed as dist

    dist.broadcast(paddle.from_dlpack(array), src=source, group=group)


def _broadcast_header(header: bytes | None, source: int, group: Any) -> bytes:
    size = np.array([len(header) if header is not None else 0], dtype=np.int64)
    _broadcast(size, source, group)
    buf = np.frombuffer(header, np.uint8).copy() if header is not None else None
    if buf is None:
        buf = np.empty(int(size[0]), np.uint8)
    _broadcast(buf, source, group)
    return buf.tobytes()


def send_tensors(
    arrays: Mapping[str, Any] | None,
    source: int,
    rank: int,
    chunk_bytes: int,
    keep: bool = True,
    group: Any = None,
    into: Mapping[str, Any] | None = None,
    fanout: Fanout | None = None,
) -> Transferred:
    """``source``'s named arrays on every rank of ``group`` that ``keep``s them (``arrays``
    is read on ``source``, and on the other keepers of ``fanout``; the others receive their
    names, dtypes and shapes first). Chunks of at most ``chunk_bytes`` go straight from the
    senders' arrays into the receivers' (DLPack views: no copy); every chunk's xxh3-64 is
    sent after the data and compared. ``into``: arrays a receiver has already (its live
    tensors) that the bytes of the same name, dtype and shape go straight into; the others
    are allocated. A receiver whose chunks differ returns ``intact=False`` (the caller
    decides what then; ``into`` then holds damaged bytes).

    Without ``fanout`` (or below its size) the chunks are broadcast over ``group``: a rank
    that does not keep them (a stayer that holds the state already) takes part in each with
    one chunk-sized buffer and drops the bytes. With it, they go to ``fanout.receivers``
    alone, over groups formed for it (:func:`_send_over_groups`)."""
    started = time.monotonic()
    header = None
    if rank == source:
        assert arrays is not None
        header = json.dumps([[s.name, s.dtype, list(s.shape)] for s in specs(arrays)]).encode()
    names = _broadcast_header(header, source, group)
    tensor_specs = [TensorSpec(n, d, tuple(s)) for n, d, s in json.loads(names)]
    if fanout is not None and fanout.applies(sum(s.nbytes for s in tensor_specs)):
        assert group is None, "a fanout forms its groups within the world group"
        assert fanout.keepers[0] == source
        out = _send_over_groups(arrays, tensor_specs, rank, chunk_bytes, into, fanout)
    else:
        out = _send_over_group(arrays, tensor_specs, source, rank, chunk_bytes, keep, group, into)
    out.seconds = time.monotonic() - started
    return out


def _chunks(tensor_specs: Sequence[TensorSpec], chunk_bytes: int) -> list[tuple[str, int, int]]:
    """(name, first byte, size) of every chunk, in the order they are sent."""
    return [
        (spec.name, start, min(chunk_bytes, spec.nbytes - start))
        for spec in tensor_specs
        for start in range(0, spec.nbytes, chunk_bytes)
    ]


def bundles(sizes: Sequence[int], chunk_bytes: int) -> list[list[int]]:
    """Which pieces (by index, in order) each broadcast carries: a piece of
    BUNDLE_BELOW_BYTES or more alone, runs of smaller ones together up to ``chunk_bytes``.
    Every rank of the group computes the same from the pieces' sizes."""
    out: list[list[int]] = []
    run: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        if n >= BUNDLE_BELOW_BYTES or (run and total + n > chunk_bytes):
            if run:
                out.append(run)
            run, total = [], 0
        if n >= BUNDLE_BELOW_BYTES:
            out.append([i])
        else:
            run.append(i)
            total += n
    if run:
        out.append(run)
    return out


def _move(
    pieces: Sequence[Any], source: int, group: Any, sending: bool, flip: bool, chunk_bytes: int
) -> list[int]:
    """Broadcast ``pieces`` (flat uint8 arrays) from ``source`` over ``group``, the small ones
    bundled (:func:`bundles`); their xxh3-64s, each piece's as it is on this rank once all
    arrived. ``flip``: damage the first received piece (a test's fault)."""
    for bundle in bundles([p.nbytes for p in pieces], chunk_bytes):
        if len(bundle) == 1:
            piece = pieces[bundle[0]]
            if sending and not piece.flags.writeable:
                # gloo writes into its root's buffer: a read-only one (bytes read from disk)
                # goes through a copy, one chunk at a time.
                _broadcast(piece.copy(), source, group)
            else:
                _broadcast(piece, source, group)
            continue
        if sending:
            _broadcast(np.concatenate([pieces[i] for i in bundle]), source, group)
            continue
        buf = np.empty(sum(pieces[i].nbytes for i in bundle), np.uint8)
        _broadcast(buf, source, group)
        at = 0
        for i in bundle:
            n = pieces[i].nbytes
            pieces[i][:] = buf[at : at + n]
            at += n
    if flip and pieces:
        pieces[0][0] ^= 0xFF
    return [xxhash.xxh3_64_intdigest(piece) for piece in pieces]


def _exchange_digests(digests: list[int], source: int, group: Any, sending: bool) -> list[int]:
    """The source's digests on every rank of ``group``."""
    count = np.array([len(digests)], np.int64)
    _broadcast(count, source, group)
    if not count[0]:
        # A sender without a share (fewer chunks than senders): gloo refuses an empty tensor.
        return []
    theirs = np.array(digests, dtype=np.uint64).view(np.int64)
    if not sending:
        theirs = np.empty(int(count[0]), np.int64)
    _broadcast(theirs, source, group)
    return [int(d) for d in theirs.view(np.uint64)]


def _send_over_group(
    arrays: Mapping[str, Any] | None,
    tensor_specs: list[TensorSpec],
    source: int,
    rank: int,
    chunk_bytes: int,
    keep: bool,
    group: Any,
    into: Mapping[str, Any] | None,
) -> Transferred:
    sending = rank == source
    out = Transferred()
    chunks = _chunks(tensor_specs, chunk_bytes)
    if sending:
        assert arrays is not None
        flats = {s.name: byte_view(arrays[s.name]) for s in tensor_specs}
    elif keep:
        out.arrays = _destinations(tensor_specs, into or {})
        flats = {s.name: byte_view(out.arrays[s.name]) for s in tensor_specs}
    else:
        scratch = np.empty(chunk_bytes, np.uint8)
        sizes = [size for _, _, size in chunks]
        for bundle in bundles(sizes, chunk_bytes):
            _broadcast(scratch[: sum(sizes[i] for i in bundle)], source, group)
        _exchange_digests([], source, group, False)
        return out
    pieces = [flats[name][start : start + size] for name, start, size in chunks]
    flip = keep and not sending and os.environ.get(FAULT_ENV, "") == "flip"
    digests = _move(pieces, source, group, sending, flip, chunk_bytes)
    theirs = _exchange_digests(digests, source, group, sending)
    if sending:
        out.arrays = dict(arrays or {})
    else:
        out.intact = theirs == digests
        out.chunks, out.nbytes = len(pieces), sum(p.nbytes for p in pieces)
    return out


def _matches(arrays: Mapping[str, Any] | None, tensor_specs: list[TensorSpec]) -> bool:
    """Whether ``arrays`` have every array of ``tensor_specs`` (but the source's small
    files) with the same dtype and shape: a stayer that can send a share."""
    if arrays is None:
        return False
    for spec in tensor_specs:
        if spec.name == FILES_TENSOR:
            continue
        have = arrays.get(spec.name)
        if have is None or have.dtype.str != spec.dtype or tuple(have.shape) != spec.shape:
            return False
    return True


def _send_over_groups(
    arrays: Mapping[str, Any] | None,
    tensor_specs: list[TensorSpec],
    rank: int,
    chunk_bytes: int,
    into: Mapping[str, Any] | None,
    fanout: Fanout,
) -> Transferred:
    """The chunks to ``fanout.receivers`` alone: one group per sender (the sender and the
    receivers, formed by every rank in the same order: ``new_group`` numbers groups per
    process), chunk k from sender k mod n, the small files from the source; a receiver
    takes every sender's share at once, one thread each. A keeper that does not send
    makes no collective call past the groups' numbering."""
    import paddle.distributed as dist

    out = Transferred()
    candidates = fanout.keepers[: fanout.senders_max]
    senders = candidates[:1]
    if len(candidates) > 1:
        # Every candidate must hold the source's layout at the planned step (a stayer whose
        # handover was damaged read an older step from disk): else the source alone sends.
        fits = rank not in candidates[1:] or _matches(arrays, tensor_specs)
        if agree(int(fits), op="min"):
            senders = candidates
    formed = time.monotonic()
    groups = [dist.new_group(sorted({s, *fanout.receivers})) for s in senders]
    out.group_s = time.monotonic() - formed
    out.senders = len(senders)
    chunks = _chunks(tensor_specs, chunk_bytes)
    owner = [
        0 if name == FILES_TENSOR else k % len(senders) for k, (name, _, _) in enumerate(chunks)
    ]
    if rank in senders:
        i = senders.index(rank)
        assert arrays is not None
        mine = [c for c, o in zip(chunks, owner, strict=True) if o == i]
        pieces = [byte_view(arrays[name])[start : start + size] for name, start, size in mine]
        moved = _move(pieces, rank, groups[i], True, False, chunk_bytes)
        _exchange_digests(moved, rank, groups[i], True)
        out.arrays = dict(arrays)
        return out
    if rank not in fanout.receivers:
        return out
    out.arrays = _destinations(tensor_specs, into or {})
    flats = {s.name: byte_view(out.arrays[s.name]) for s in tensor_specs}
    flip = os.environ.get(FAULT_ENV, "") == "flip"
    results: list[tuple[bool, int, int] | BaseException | None] = [None] * len(senders)

    def receive(i: int) -> None:
        try:
            mine = [c for c, o in zip(chunks, owner, strict=True) if o == i]
            pieces = [flats[name][start : start + size] for name, start, size in mine]
            digests = _move(pieces, senders[i], groups[i], False, flip and i == 0, chunk_bytes)
            theirs = _exchange_digests(digests, senders[i], groups[i], False)
            results[i] = (theirs == digests, len(pieces), sum(p.nbytes for p in pieces))
        except BaseException as exc:  # re-raised on the calling thread
            results[i] = exc

    threads = [
        threading.Thread(target=receive, args=(i,), daemon=True) for i in range(1, len(senders))
    ]
    for t in threads:
        t.start()
    receive(0)
    for t in threads:
        t.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
        assert result is not None
        intact, count, nbytes = result
        out.intact = out.intact and intact
        out.chunks += count
        out.nbytes += nbytes
    return out


def _destinations(tensor_specs: list[TensorSpec], into: Mapping[str, Any]) -> dict[str, Any]:
    """Where each received array goes: ``into``'s array of the same name, dtype and shape
    (writable and contiguous), or new memory."""

    def fits(spec: TensorSpec) -> bool:
        have = into.get(spec.name)
        return (
            have is not None
            and have.dtype.str == spec.dtype
            and tuple(have.shape) == spec.shape
            and have.flags.writeable
            and have.flags.c_contiguous
        )

    fresh = allocate([s for s in tensor_specs if not fits(s)])
    return {s.name: into[s.name] if fits(s) else fresh[s.name] for s in tensor_specs}


def send_state(
    files: StateFiles | None,
    step: int,
    source: int,
    rank: int,
    chunk_bytes: int,
    keep: bool,
    into: Mapping[str, Any] | None = None,
    fanout: Fanout | None = None,
) -> tuple[int, StateFiles, Transferred]:
    """A whole state (its arrays and its small files, and its step) from ``source`` to the
    ranks that ``keep`` it: (step, files, what moved); the others get (0, empty, ...).
    ``files``: the source's, and any other keeper's that holds the planned step (it may
    send a share of the arrays, see :class:`Fanout`)."""
    arrays: dict[str, Any] | None = None
    if rank == source:
        assert files is not None
        blob = pack({**files, "tide.step": str(step).encode()})
        arrays = {**files.arrays, FILES_TENSOR: np.frombuffer(blob, np.uint8)}
    elif files is not None:
        arrays = dict(files.arrays)
    moved = send_tensors(arrays, source, rank, chunk_bytes, keep, into=into, fanout=fanout)
    if not keep:
        return 0, StateFiles(), moved
    got = dict(moved.arrays)
    small = unpack(got.pop(FILES_TENSOR).tobytes())
    got_step = int(small.pop("tide.step", b"0"))
    return got_step, StateFiles(small, got), moved


def pack(files: Mapping[str, bytes]) -> bytes:
    header = json.dumps([[name, len(data)] for name, data in files.items()]).encode()
    return struct.pack("<Q", len(header)) + header + b"".join(files.values())


def unpack(blob: bytes) -> dict[str, bytes]:
    (n,) = struct.unpack_from("<Q", blob)
    entries = json.loads(blob[8 : 8 + n])
    out, offset = {}, 8 + n
    for name, size in entries:
        out[str(name)] = blob[offset : offset + int(size)]
        offset += int(size)
    if offset != len(blob):
        raise ValueError(f"state files blob has {len(blob) - offset} stray bytes")
    return out
