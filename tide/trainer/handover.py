"""The state a stayer hands to its own next worker, in the pod's memory.

At a planned resize every rank holds at one step; the pod's first worker (local rank 0)
writes the training state into the pod's shared memory (``/dev/shm``, which every process
of the pod's container shares and which lives in RAM), and the next generation's workers of
the same pod read it from there: a planned resize reads nothing from disk. A newcomer pod
has nothing there and receives the state from a peer over the new process group
(tide/trainer/transfer.py).

:class:`StateHandover` is the seam; :class:`ShmHandover` the one real implementation. One
directory per step, as a checkpoint: the tensors go straight from the live tensors into one
file (``state.tensors``, tide/trainer/rawstate.py: one copy by write(2), no joined buffer),
the small files beside it, ``manifest.json`` (sizes) last, then the directory is renamed to
``step-N``: a worker killed half-way leaves nothing a reader takes. The next worker maps the
file and gets the tensors as views of it (no copy until they are loaded into its model). No
hash of the bytes: this memory is the pod's own RAM, written and read by the same code; what
it guards against is a torn write (the rename, the sizes), not bit flips, which are the
memory's ECC's business. A peer transfer checks every chunk it moves (tide/trainer/transfer.py).
The launcher names the directory (``TIDE_HANDOVER_DIR``) and removes it when it exits.

The one copy at the hold is a copy into pages that already exist: a put writes over the
previous handover's ``state.tensors`` (the one this pod's worker took, obsolete once a newer
step is handed over; never one whose mapping this process still uses, as rank 0's durable write
of it does) or over a reserve that a pod with nothing handed over yet fills beforehand
(:meth:`ShmHandover.reserve`, after its worker's first step, on a thread beside training). On this
VM a write(2) into fresh tmpfs pages cost 0.4-1.5 s per GB (the guest and the host back each
page on first touch), into existing ones 0.3-0.4 s. So a pod holds one state's size in
``/dev/shm`` from its first worker's first step on, as a stayer's pod already did after a take.
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
import threading
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tide.trainer import rawstate
from tide.trainer.checkpoint import (
    MANIFEST,
    LoadedCheckpoint,
    WrittenCheckpoint,
    list_step_dirs,
    step_dir_name,
)

logger = logging.getLogger(__name__)

HANDOVER_DIR_ENV = "TIDE_HANDOVER_DIR"
SHM = Path("/dev/shm")
# Pages filled ahead of the next put (ShmHandover.reserve).
RESERVE = "reserve.tensors"
_FILL_CHUNK_BYTES = 8 * 2**20
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

    def reserve(self, nbytes: int) -> bool:
        """Ready memory for the next put's ``nbytes`` of tensors ahead of the hold, where
        nothing handed over will serve; True if it started to."""
        ...


class ShmHandover:
    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self._lock = threading.Lock()
        # Set by a put: a reserve being filled is no longer wanted.
        self._cancel = threading.Event()
        self._filling: threading.Thread | None = None
        # The step this process took last and its mapping (alive while a view of it is).
        self._taken: tuple[int, weakref.ref[mmap.mmap]] | None = None

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
                reused = self._claim_pages(tmp / rawstate.TENSORS)
                sizes[rawstate.TENSORS] = _write_pieces(tmp / rawstate.TENSORS, arrays, reused)
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
        (self.root / RESERVE).unlink(missing_ok=True)
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

    def _claim_pages(self, dest: Path) -> bool:
        """Moves existing pages to ``dest`` for the put to write over: the newest handed-over
        ``state.tensors`` that no view in this process maps, else the reserve. False: none."""
        with self._lock:
            self._cancel.set()
            in_use = self._taken[0] if self._taken and self._taken[1]() is not None else None
            olds = [
                self.root / step_dir_name(s) / rawstate.TENSORS
                for s in reversed(list_step_dirs(self.root))
                if s != in_use
            ]
            for path in [*olds, self.root / RESERVE]:
                try:
                    os.replace(path, dest)
                except FileNotFoundError:
                    continue
                return True
        return False

    def reserve(self, nbytes: int) -> bool:
        """Fills ``nbytes`` of this pod's shared memory, on a thread, for the next
        put to write over (see the module docstring): only where nothing handed over will
        serve (a pod whose worker took a handover puts over that one's pages). The put
        that comes first cancels it."""
        with self._lock:
            if nbytes <= 0 or self._filling is not None or self._cancel.is_set():
                return False
            if list_step_dirs(self.root) or (self.root / RESERVE).exists():
                return False
            self.root.mkdir(parents=True, exist_ok=True)
            self._filling = threading.Thread(
                target=self._fill, args=(nbytes,), name="handover-reserve", daemon=True
            )
            self._filling.start()
        return True

    def _fill(self, nbytes: int) -> None:
        # At the training's own priority: at nice 19 a 1 GB fill took 15.8 s at load 8 here
        # and was still under way at the hold; it is a one-off cost of the first step's
        # seconds (0.4-1.5 s of CPU per GB), which is what it takes out of the pause.
        started = time.monotonic()
        tmp = self.root / f"{RESERVE}.tmp-{secrets.token_hex(4)}"
        try:
            with open(tmp, "wb") as f:
                zeros = memoryview(bytes(min(nbytes, _FILL_CHUNK_BYTES)))
                left = nbytes
                while left > 0 and not self._cancel.is_set():
                    left -= f.write(zeros[: min(left, len(zeros))])
            with self._lock:
                if not self._cancel.is_set():
                    os.replace(tmp, self.root / RESERVE)
                    logger.info(
                        "handover reserve of %d bytes filled in %.3fs",
                        nbytes,
                        time.monotonic() - started,
                    )
                    return
        except OSError:
            logger.warning("handover reserve of %d bytes failed", nbytes, exc_info=True)
        tmp.unlink(missing_ok=True)

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
                    mapped = _map(path, size)
                    owner = getattr(mapped.base, "obj", None)  # the memoryview's mmap
                    if isinstance(owner, mmap.mmap):
                        self._taken = (step, weakref.ref(owner))
                    files.arrays = rawstate.decode(mapped)
                else:
                    files[name] = path.read_bytes()
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("handover of step %d in %s is damaged: %s", step, directory, exc)
            return None
        return LoadedCheckpoint(
            step, directory, hashlib.sha256(body).hexdigest(), files, manifest.get("meta", {})
        )


def _write_pieces(path: Path, arrays: Mapping[str, Any], over: bool = False) -> int:
    """``state.tensors`` of ``arrays`` into the file at ``path`` (``over``: over the pages of
    the file there, cut to size after): each array's bytes copied once, by write(2), straight
    from its memory. (Through a memory map instead it cost twice as much here: a page fault
    for every 4 KiB page, 0.9 against 0.39 ms per MB.)"""
    size = 0
    with open(path, "r+b" if over else "wb") as f:
        for piece in rawstate.pieces(arrays):
            size += f.write(piece)
        f.truncate(size)
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
