"""Training state from a peer over the new process group, instead of from storage.

When a generation forms, every rank says which step it holds and where
(:class:`Holding`: in memory, handed over by its pod's previous worker, or on disk in its
durable store). :func:`plan_restore` picks the newest step any rank holds, and
a source for it: when every rank holds that step in memory, each takes its own; otherwise
the lowest rank that has it in memory (on disk only if nobody has it in memory) broadcasts
it to all. So a newcomer never reads storage, a stayer never reads disk on a planned
resize, and after a crash one rank reads the durable store and the others get it from it.
This is how TorchFT and Horovod's elastic mode bring a new worker up to date.

The files travel as one ``uint8`` tensor (a small header of names and sizes, then the
bytes), length first. The plan is a pure function of the ranks' reports.
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


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
    # The rank that broadcasts the state; -1: every rank loads its own (or step is 0).
    source: int

    @property
    def broadcast(self) -> bool:
        return self.source >= 0


def plan_restore(holdings: Sequence[Holding]) -> RestorePlan:
    newest = max(h.step for h in holdings)
    if newest == 0:
        return RestorePlan(0, -1)
    if all(h.step == newest and h.where is Where.MEMORY for h in holdings):
        return RestorePlan(newest, -1)
    have = [(r, h) for r, h in enumerate(holdings) if h.step == newest]
    in_memory = [r for r, h in have if h.where is Where.MEMORY]
    return RestorePlan(newest, in_memory[0] if in_memory else have[0][0])


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
        raise ValueError(f"transfer blob has {len(blob) - offset} stray bytes")
    return out


def all_holdings(mine: Holding, world_size: int) -> list[Holding]:
    """Every rank's holding, gathered over the current group."""
    if world_size == 1:
        return [mine]
    import paddle
    import paddle.distributed as dist

    gathered: list[paddle.Tensor] = []
    dist.all_gather(gathered, paddle.to_tensor([mine.step, int(mine.where)], dtype="int64"))
    return [Holding(int(t[0]), Where(int(t[1]))) for t in (g.numpy() for g in gathered)]


def broadcast_files(files: Mapping[str, bytes] | None, source: int, rank: int) -> dict[str, bytes]:
    """``source``'s files on every rank (``files`` is read on ``source`` only)."""
    import paddle
    import paddle.distributed as dist

    blob = pack(files) if rank == source and files is not None else b""
    size = paddle.to_tensor([len(blob)], dtype="int64")
    dist.broadcast(size, src=source)
    n = int(size.numpy()[0])
    if rank == source:
        data = paddle.to_tensor(np.frombuffer(blob, dtype=np.uint8))
    else:
        data = paddle.zeros([n], dtype="uint8")
    dist.broadcast(data, src=source)
    return dict(files) if rank == source and files is not None else unpack(data.numpy().tobytes())
