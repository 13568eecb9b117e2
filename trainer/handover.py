"""The state a stayer hands to its own next worker, in the pod's memory.

At a planned resize every rank holds at one step; the pod's first worker (local rank 0)
writes the training state into the pod's shared memory (``/dev/shm``, which every process
of the pod's container shares and which lives in RAM), and the next generation's workers of
the same pod read it from there: a planned resize reads nothing from disk. A newcomer pod
has nothing there and receives the state from a peer over the new process group
(trainer/transfer.py).

:class:`StateHandover` is the seam; :class:`ShmHandover` the one real implementation. One
directory per step, as a checkpoint: the tensors go straight from the live tensors into one
file (``state.tensors``, trainer/rawstate.py: one copy by write(2), no joined buffer),
the small files beside it, ``manifest.json`` (sizes) last, then the directory is renamed to
``step-N``: a worker killed half-way leaves nothing a reader takes. The next worker maps the
file and gets the tensors as views of it (no copy until they are loaded into its model). No
hash of the bytes: this memory is the pod's own RAM, written and read by the same code; what
it guards against is a torn write (the rename, the sizes), not bit flips, which are the
memory's ECC's business. A peer transfer checks every chunk it moves (trainer/transfer.py).
The launcher names the directory (``TIDE_HANDOVER_DIR``) and removes it when it exits.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from trainer import rawstate
from trainer.checkpoint import (
    MANIFEST,
    LoadedCheckpoint,
    WrittenCheckpoint,
    list_step_dirs,
    step_dir_name,
)

logger = logging.getLogger(__name__)

HANDOVER_DIR_ENV = "TIDE_HANDOVER_DIR"
SHM = Path("/dev/shm")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


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
        """The state handed over (complete), or None. It stays handed over."""
        ...


class ShmHandover:
    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    def put(
        self, step: int, files: Mapping[str, bytes], meta: Mapping[str, Any]
    ) -> WrittenCheckpoint:
        started = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{step_dir_name(step)}.tmp-{secrets.token_hex(4)}"
        tmp.mkdir()
        sizes: dict[str, int] = {}
        try:
            for name, data in files.items():
                (tmp / name).write_bytes(data)
                sizes[name] = len(data)
            arrays = getattr(files, "arrays", None)
            if arrays:
                sizes[rawstate.TENSORS] = _write_pieces(tmp / rawstate.TENSORS, arrays)
            body = json.dumps(
                {"step": step, "files": sizes, "meta": dict(meta)}, sort_keys=True
            ).encode()
            (tmp / MANIFEST).write_bytes(body)
            final = self.root / step_dir_name(step)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in list_step_dirs(self.root)[:-1]:
            shutil.rmtree(self.root / step_dir_name(old), ignore_errors=True)
        written = WrittenCheckpoint(
            step, final, hashlib.sha256(body).hexdigest(), time.monotonic() - started
        )
        logger.info(
            "handover of step %d (%d bytes) written in %.3fs",
            step,
            sum(sizes.values()),
            written.write_s,
        )
        return written

    def latest_step(self) -> int | None:
        steps = list_step_dirs(self.root)
        return steps[-1] if steps else None

    def take(self) -> LoadedCheckpoint | None:
        step = self.latest_step()
        if step is None:
            return None
        directory = self.root / step_dir_name(step)
        try:
            body = (directory / MANIFEST).read_bytes()
            manifest = json.loads(body)
            files = rawstate.StateFiles()
            for name, size in manifest["files"].items():
                path = directory / name
                if path.stat().st_size != size:
                    raise ValueError(f"{name} has {path.stat().st_size} bytes, not {size}")
                if name == rawstate.TENSORS:
                    files.arrays = rawstate.decode(_map(path, size))
                else:
                    files[name] = path.read_bytes()
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("handover of step %d in %s is damaged: %s", step, directory, exc)
            return None
        return LoadedCheckpoint(
            step, directory, hashlib.sha256(body).hexdigest(), files, manifest.get("meta", {})
        )


def _write_pieces(path: Path, arrays: Mapping[str, Any]) -> int:
    """``state.tensors`` of ``arrays`` into a new file at ``path``: each array's bytes copied
    once, by write(2), straight from its memory. (Through a memory map instead it cost twice
    as much here: a page fault for every 4 KiB page, 0.9 against 0.39 ms per MB.)"""
    size = 0
    with open(path, "wb") as f:
        for piece in rawstate.pieces(arrays):
            size += f.write(piece)
    return size


def _map(path: Path, size: int) -> Any:
    """The file's bytes, mapped with every page mapped at once (MAP_POPULATE: page by page,
    the first read of a fresh mapping cost up to 3 ms per MB here). Shared and writable, but
    written by nobody: gloo's broadcast writes into its root's buffer (the same bytes, onto
    themselves; a read-only mapping is a SIGSEGV), and a private writable mapping would be
    copied whole by MAP_POPULATE. The mapping lives as long as a view of it."""
    if size == 0:
        return np.zeros(0, np.uint8)
    with open(path, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | _POPULATE)
    return np.frombuffer(mapped, np.uint8)


def pod_handover_dir(job_id: str, pod_name: str, launcher_id: str) -> Path:
    """Where a launcher's workers hand state over: shared memory when the pod has it."""
    base = SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else Path(tempfile.gettempdir())
    safe_job = job_id.replace("/", "_")
    return base / f"tide-handover-{safe_job}-{pod_name}-{launcher_id[:8]}"
