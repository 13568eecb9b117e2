"""A training state's files with its tensors kept as arrays: the form that moves at memory speed.

:class:`StateFiles` is a mapping of small files (bytes: the RNGs, the LR scheduler, whatever
Paddle must pickle) that also carries ``arrays``, the model's and optimizer's plain tensors by
name, as numpy arrays that are not copied until they reach their destination: zero-copy views
of the live tensors when a stayer hands its state over, views of the pod's shared memory when
its next worker takes it, the receive buffers of a peer transfer. Written to a file (the
handover, a durable checkpoint) the arrays are one file, ``state.tensors``: an 8-byte length, a
JSON index (name: dtype, shape, offset), then each array's bytes at a 64-byte aligned offset.
Nothing here imports Paddle, so the stores and the transfer can use it.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

TENSORS = "state.tensors"
ALIGN = 64
Piece = bytes | memoryview


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver allocates for one named tensor before the bytes arrive."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.dtype(self.dtype).itemsize * int(np.prod(self.shape, dtype=np.int64)))


class StateFiles(dict[str, bytes]):
    """Small files by name (the mapping) and the tensors as arrays (``arrays``)."""

    def __init__(
        self, files: Mapping[str, bytes] | None = None, arrays: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(files or {})
        self.arrays: dict[str, Any] = dict(arrays or {})

    @property
    def nbytes(self) -> int:
        return sum(len(v) for v in self.values()) + sum(int(a.nbytes) for a in self.arrays.values())


def specs(arrays: Mapping[str, Any]) -> list[TensorSpec]:
    return [TensorSpec(n, a.dtype.str, tuple(int(d) for d in a.shape)) for n, a in arrays.items()]


def layout(tensor_specs: list[TensorSpec]) -> tuple[bytes, list[int], int]:
    """``state.tensors``' header (length and index), each array's offset in the file, and
    the file's size."""
    index: dict[str, tuple[str, list[int], int]] = {}
    offset = 0
    for spec in tensor_specs:
        offset += -offset % ALIGN
        index[spec.name] = (spec.dtype, list(spec.shape), offset)
        offset += spec.nbytes
    body = json.dumps(index).encode()
    header = struct.pack("<Q", len(body)) + body
    base = len(header) + (-len(header) % ALIGN)
    return header, [base + v[2] for v in index.values()], base + offset


def byte_view(array: Any) -> Any:
    """``array``'s bytes as a flat uint8 array, without a copy."""
    flat = np.ascontiguousarray(array).reshape(-1)
    return flat.view(np.uint8)


def pieces(arrays: Mapping[str, Any]) -> Iterator[Piece]:
    """``state.tensors`` as the buffers to write one after the other (no joined copy)."""
    header, offsets, total = layout(specs(arrays))
    yield header
    at = len(header)
    for array, offset in zip(arrays.values(), offsets, strict=True):
        if offset > at:
            yield b"\0" * (offset - at)
        view = byte_view(array)
        yield memoryview(view)
        at = offset + view.nbytes
    if total > at:
        yield b"\0" * (total - at)


def file_pieces(files: Mapping[str, bytes]) -> Iterator[tuple[str, list[Piece]]]:
    """Every file a store writes for ``files``: the small ones, then ``state.tensors``."""
    for name, data in files.items():
        yield name, [data]
    arrays = getattr(files, "arrays", None)
    if arrays:
        yield TENSORS, list(pieces(arrays))


def allocate(tensor_specs: list[TensorSpec]) -> dict[str, Any]:
    """Empty arrays for ``tensor_specs``, in one region of memory whose pages are all mapped
    at once (MAP_POPULATE): page by page, the first write into fresh memory cost up to 3 ms
    per MB on this machine's VM, ten times a copy."""
    _, offsets, total = layout(tensor_specs)
    if total == 0:
        region = np.zeros(0, np.uint8)
    else:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        region = np.frombuffer(mmap.mmap(-1, total, flags=flags), np.uint8)
    return {
        s.name: region[o : o + s.nbytes].view(np.dtype(s.dtype)).reshape(s.shape)
        for s, o in zip(tensor_specs, offsets, strict=True)
    }


def decode(data: Any) -> dict[str, Any]:
    """The arrays of a ``state.tensors`` buffer, as views of it (no copy)."""
    buf = np.frombuffer(data, np.uint8)
    (length,) = struct.unpack_from("<Q", bytes(buf[:8]))
    index = json.loads(bytes(buf[8 : 8 + length]))
    header_len = 8 + length
    base = header_len + (-header_len % ALIGN)
    out: dict[str, Any] = {}
    for name, (dtype, shape, offset) in index.items():
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        start = base + offset
        out[name] = buf[start : start + count * dt.itemsize].view(dt).reshape(shape)
    return out


def encode(arrays: Mapping[str, Any]) -> bytes:
    """``state.tensors`` as one bytes object (small states and tests)."""
    return b"".join(bytes(p) for p in pieces(arrays))
