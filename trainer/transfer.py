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
views on both sides, no packed buffer, no copy), each chunk checked with xxh3-64. It is the
path any state takes between ranks (optimizer shards of a sharded job too). The small files of
a state travel as one more tensor beside the arrays.

The broadcast is over the whole new group: a stayer that is not the source takes part with one
chunk-sized buffer and drops the bytes (it neither keeps, checks nor loads them). A group of
the source and the newcomers alone would spare the source those copies, but Paddle 3.3's gloo
gives no such group here: ``new_group`` failed in overlap mode (a gloo address of another
size: "136 vs 204", likely the fault trainer/gloo_groups.py works around for groups of the
whole world only), cost 0.5 s when it worked, and gloo's send/recv number their messages by a per-process counter, so a
pair's messages go out of step with the others'.

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
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from tidebase.errors import ConfigError
from trainer.rawstate import StateFiles, TensorSpec, allocate, byte_view, specs

# Env var: the largest piece one collective moves, MB (TransferSettings).
CHUNK_MB_ENV = "TIDE_TRANSFER_CHUNK_MB"
# Env var naming a fault a receiver injects (tests): "flip" changes one received byte.
FAULT_ENV = "TIDE_TRANSFER_FAULT"
# The small files of a state travel as this tensor beside its arrays.
FILES_TENSOR = "tide.files"


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

    def __post_init__(self) -> None:
        if self.chunk_mb <= 0:
            raise ConfigError(f"chunk_mb must be > 0, got {self.chunk_mb}")

    @property
    def chunk_bytes(self) -> int:
        return max(1, int(self.chunk_mb * 2**20))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TransferSettings:
        e = os.environ if env is None else env
        raw = e.get(CHUNK_MB_ENV, "")
        return cls(chunk_mb=float(raw)) if raw else cls()


@dataclass
class Transferred:
    """What :func:`send_tensors` moved, and whether every chunk arrived intact."""

    arrays: dict[str, Any] = field(default_factory=dict)
    nbytes: int = 0
    chunks: int = 0
    intact: bool = True
    seconds: float = 0.0


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
    if world_size == 1:
        return [mine]
    import paddle
    import paddle.distributed as dist

    gathered: list[paddle.Tensor] = []
    dist.all_gather(gathered, paddle.to_tensor([mine.step, int(mine.where)], dtype="int64"))
    return [Holding(int(t[0]), Where(int(t[1]))) for t in (g.numpy() for g in gathered)]


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
) -> Transferred:
    """``source``'s named arrays on every rank of ``group`` that ``keep``s them (``arrays``
    is read on ``source`` only; the others receive their names, dtypes and shapes first).
    Chunks of at most ``chunk_bytes`` go straight from the source's arrays into the
    receivers' (DLPack views: no copy); every chunk's xxh3-64 is sent after the data and
    compared. A rank that does not keep them (a stayer that holds the state already) takes
    part in each broadcast with one chunk-sized buffer and drops the bytes. ``into``: arrays
    a receiver has already (its live tensors) that the bytes of the same name, dtype and shape
    go straight into; the others are allocated. A receiver whose chunks differ returns
    ``intact=False`` (the caller decides what then; ``into`` then holds damaged bytes)."""
    started = time.monotonic()
    sending = rank == source
    header = None
    if sending:
        assert arrays is not None
        header = json.dumps([[s.name, s.dtype, list(s.shape)] for s in specs(arrays)]).encode()
    names = _broadcast_header(header, source, group)
    tensor_specs = [TensorSpec(n, d, tuple(s)) for n, d, s in json.loads(names)]
    out = Transferred()
    if not sending and keep:
        out.arrays = _destinations(tensor_specs, into or {})
    scratch = None if sending or keep else np.empty(chunk_bytes, np.uint8)
    digests: list[int] = []
    fault = os.environ.get(FAULT_ENV, "") if keep and not sending else ""
    for spec in tensor_specs:
        flat = None
        if sending:
            assert arrays is not None
            flat = byte_view(arrays[spec.name])
        elif keep:
            flat = byte_view(out.arrays[spec.name])
        for start in range(0, spec.nbytes, chunk_bytes):
            size = min(chunk_bytes, spec.nbytes - start)
            if flat is None:
                assert scratch is not None
                _broadcast(scratch[:size], source, group)
                continue
            piece = flat[start : start + size]
            if flat.flags.writeable:
                _broadcast(piece, source, group)
            else:
                # gloo writes into its root's buffer: a read-only one (bytes read from disk)
                # goes through a copy, one chunk at a time.
                _broadcast(piece.copy(), source, group)
            if fault == "flip" and out.chunks == 0:
                piece[0] ^= 0xFF
            digests.append(xxhash.xxh3_64_intdigest(piece))
            out.chunks += 1
            out.nbytes += piece.nbytes
    count = np.array([len(digests)], np.int64)
    _broadcast(count, source, group)
    theirs = np.array(digests, dtype=np.uint64).view(np.int64)
    if not sending:
        theirs = np.empty(int(count[0]), np.int64)
    _broadcast(theirs, source, group)
    if sending:
        out.arrays = dict(arrays or {})
    elif keep:
        mine = np.array(digests, dtype=np.uint64).view(np.int64)
        out.intact = bool(np.array_equal(theirs, mine))
    out.seconds = time.monotonic() - started
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
) -> tuple[int, StateFiles, Transferred]:
    """A whole state (its arrays and its small files, and its step) from ``source`` to the
    ranks that ``keep`` it: (step, files, what moved); the others get (0, empty, ...)."""
    arrays: dict[str, Any] | None = None
    if rank == source:
        assert files is not None
        blob = pack({**files, "tide.step": str(step).encode()})
        arrays = {**files.arrays, FILES_TENSOR: np.frombuffer(blob, np.uint8)}
    moved = send_tensors(arrays, source, rank, chunk_bytes, keep, into=into)
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
