"""The state a stayer hands to its own next worker, in the pod's memory.

At a planned resize every rank holds at one step; the pod's first worker (local rank 0;
of a model-parallel job every worker, each its slice, in a handover directory of its own)
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

The one copy at the hold is a copy into pages that already exist. A put writes over a
``state.tensors`` of this pod that no process maps: the newest handed-over one, else the spare
(``reserve.tensors``). Every mapping of a handed-over file holds a shared ``flock`` on it for as
long as it lives, and a put takes a file only under an exclusive one, so the pages of a state
some process still reads (rank 0's durable write streams the state it took from its mapping for
seconds after its restore, and a leaving worker's for a moment more) are never written over. A
handed-over file still mapped at the put becomes the spare, for the put after next; where no
file would be free at the next put, the pod's first worker fills a spare after its first step,
on a thread beside training (:meth:`ShmHandover.reserve`: a fresh pod; rank 0's pod while its
durable write maps the state it took), and a put that comes first writes over as much of it as
was filled. On this VM a write(2) into fresh tmpfs pages cost 0.4-1.5 s per GB on a quiet
machine and 3 s at load (the guest and the host back each page on first touch), into existing
ones 0.3-0.4 s. So a pod holds one state's size in ``/dev/shm`` from its first worker's first
step on, and two where the state it took is mapped beyond the restore (rank 0's pod): at most
the handover and one spare, besides files deleted while still mapped (per worker of a
model-parallel pod: the sum of its workers' slices, and twice that at most).
``TIDE_HANDOVER_SPARE=0`` (:class:`HandoverSettings`) keeps a pod to one file, for a pod whose
``/dev/shm`` counts in a memory limit sized for one state: a hold while the state taken is
mapped then puts into fresh pages, as before the spare.
"""

from __future__ import annotations

import fcntl
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tide.base.errors import ConfigError
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
# "0": no spare beyond a fresh pod's (a pod whose /dev/shm counts in a memory limit sized for one
# state): a hold while the state taken is mapped puts into fresh pages instead.
SPARE_ENV = "TIDE_HANDOVER_SPARE"
SHM = Path("/dev/shm")
# Pages filled ahead of the next put (ShmHandover.reserve).
RESERVE = "reserve.tensors"
_FILL_CHUNK_BYTES = 8 * 2**20
# What a spare's fill leaves free in /dev/shm and in the pod's memory limit.
_ROOM_SPARE_BYTES = 512 * 2**20
_CGROUP = Path("/sys/fs/cgroup")
# A launcher's handover directories, and the file whose lock says its launcher lives.
_DIR_PREFIX = "tide-handover-"
_OWNER = "launcher.lock"
_OWNED_FDS: dict[Path, int] = {}
# The longest a take waits for a put's claim to end (a rename: microseconds).
_LOCK_WAIT_S = 2.0
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

    def reserve(self, nbytes: int, room_bytes: int = 0) -> bool:
        """Ready memory for the next put's ``nbytes`` of tensors ahead of the hold, where
        nothing handed over will serve, if ``room_bytes`` (at least ``nbytes``: the pod's
        other workers' spares too) fit; True if it started to."""
        ...


@dataclass(frozen=True)
class HandoverSettings:
    """``spare``: a pod may hold a second state-sized file beside the handover (see the
    module docstring); off, only a fresh pod fills one, and a file still mapped at a put is
    deleted (its pages freed once unmapped), as before the spare."""

    spare: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> HandoverSettings:
        raw = (os.environ if env is None else env).get(SPARE_ENV, "")
        if raw not in ("", "0", "1"):
            raise ConfigError(f"{SPARE_ENV}={raw!r}: 0 or 1")
        return cls(spare=raw != "0")


class ShmHandover:
    def __init__(self, root: Path | str, settings: HandoverSettings | None = None) -> None:
        self.root = Path(root)
        self.settings = settings or HandoverSettings.from_env()
        self._lock = threading.Lock()
        # Set by a put: a spare being filled is no longer wanted (the put takes what is there).
        self._cancel = threading.Event()
        self._filling: threading.Thread | None = None

    def put(
        self, step: int, files: Mapping[str, bytes], meta: Mapping[str, Any]
    ) -> WrittenCheckpoint:
        started = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{step_dir_name(step)}.tmp-{secrets.token_hex(4)}"
        tmp.mkdir()
        sizes: dict[str, int] = {}
        reused = False
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
        self._drop_older_than(step)
        written = WrittenCheckpoint(
            step, final, hashlib.sha256(body).hexdigest(), time.monotonic() - started
        )
        logger.info(
            "handover of step %d (%d bytes) written in %.3fs (%s pages)",
            step,
            sum(sizes.values()),
            written.write_s,
            "existing" if reused else "fresh",
        )
        return written

    def _claim_pages(self, dest: Path) -> bool:
        """Moves existing pages to ``dest`` for the put to write over: the newest handed-over
        ``state.tensors`` that no process maps, else the spare (as far as it was filled).
        False: none is free."""
        with self._lock:
            self._cancel.set()
            filling = self._filling
        if filling is not None:
            # At most one chunk's write away: what it filled is renamed to the spare.
            filling.join()
        with self._lock:
            for path in tensor_files(self.root):
                if _claim(path, dest):
                    return True
        return False

    def _drop_older_than(self, step: int) -> None:
        """Removes the handed-over steps before ``step``; a ``state.tensors`` of one that a
        process still maps becomes the spare if there is none (its pages serve the put after
        next), and the spare stays: the pod keeps at most two state-sized files."""
        spare = self.root / RESERVE
        for old in list_step_dirs(self.root):
            if old >= step:
                continue
            directory = self.root / step_dir_name(old)
            tensors = directory / rawstate.TENSORS
            keep = self.settings.spare and tensors.exists() and not spare.exists()
            if keep and not _free(tensors):
                os.replace(tensors, spare)
            shutil.rmtree(directory, ignore_errors=True)

    def reserve(self, nbytes: int, room_bytes: int = 0) -> bool:
        """Fills ``nbytes`` of this pod's shared memory as the spare, on a thread, for the
        next put to write over (see the module docstring): only where no file the next put
        could write over is there (a fresh pod; a pod whose handover this process still maps,
        as rank 0's durable write does). A put cancels it and takes what it filled.
        ``room_bytes``: what must fit for it, ``nbytes`` at least; the workers of a
        model-parallel pod each fill one at once, each asking room for all."""
        with self._lock:
            if nbytes <= 0 or self._filling is not None or self._cancel.is_set():
                return False
            files = tensor_files(self.root)
            if any(_free(path) for path in files) or (files and not self.settings.spare):
                return False
            self.root.mkdir(parents=True, exist_ok=True)
            if not _room_for(self.root, max(nbytes, room_bytes)):
                # A full /dev/shm fails other users of it (a DataLoader's shared memory,
                # NCCL's segments) with SIGBUS, and a memory-backed one counted in the pod's
                # limit is an OOM kill: the spare is a speed-up, never worth either.
                logger.info("handover spare of %d bytes skipped: too little room", nbytes)
                return False
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
                # Cancelled half-way too: the put that cancelled it writes over what is there.
                os.replace(tmp, self.root / RESERVE)
            logger.info(
                "handover spare: %d of %d bytes filled in %.3fs",
                nbytes - left,
                nbytes,
                time.monotonic() - started,
            )
            return
        except OSError:
            logger.warning("handover spare of %d bytes failed", nbytes, exc_info=True)
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
                    files.arrays = rawstate.decode(_map(path, size))
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
    copied whole by MAP_POPULATE. The mapping lives as long as a view of it, and holds a
    shared ``flock`` on the file as long as it lives: no put writes over it (:func:`_claim`)."""
    if size == 0:
        return np.zeros(0, np.uint8)
    f = open(path, "r+b")  # noqa: SIM115 - closed with the mapping
    try:
        _lock_shared(f.fileno(), path)
        # A put may have claimed the file between the open and the lock (it renames it away
        # and writes over it): the lock then holds pages of another step, or half-written
        # ones. Under the lock, the path must still name this file, at the manifest's size.
        if not _same_file(f.fileno(), path) or os.fstat(f.fileno()).st_size != size:
            raise ValueError(f"{path.name} was replaced while it was opened")
        mapped = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | _POPULATE)
    except BaseException:
        f.close()
        raise
    weakref.finalize(mapped, f.close)
    return np.frombuffer(mapped, np.uint8)


def tensor_files(root: Path) -> list[Path]:
    """The pod's state-sized files, in the order a put prefers to write over them: each
    handed-over step's ``state.tensors``, newest first, then the spare."""
    steps = [root / step_dir_name(s) / rawstate.TENSORS for s in reversed(list_step_dirs(root))]
    return [p for p in [*steps, root / RESERVE] if p.exists()]


def _free(path: Path) -> bool:
    """True if no process maps ``path`` (no shared ``flock`` on it: :func:`_map`)."""
    return _claim(path, None)


def _claim(path: Path, dest: Path | None) -> bool:
    """Renames ``path`` to ``dest`` if no process maps it, under an exclusive ``flock`` so
    that none can start to in between; ``dest`` None: only whether it could."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        # The lock is on the file opened; another claim may have renamed it away since, and
        # what the path names now may be mapped: only the file locked is renamed.
        if not _same_file(fd, path):
            return False
        if dest is not None:
            os.replace(path, dest)
        return True
    finally:
        os.close(fd)


def _lock_shared(fd: int, path: Path) -> None:
    """A shared ``flock`` on ``fd``, waited for at most ``_LOCK_WAIT_S``. A put's claim holds
    the exclusive one for a rename only, but a process forked during it (a DataLoader worker)
    keeps it until it exits: then the state is read from disk instead, the restore not hung."""
    deadline = time.monotonic() + _LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise ValueError(
                    f"{path.name} stayed locked by a put for {_LOCK_WAIT_S} s"
                ) from None
            time.sleep(0.005)


def _room_for(root: Path, nbytes: int) -> bool:
    """True if ``nbytes`` more fit in the file system at ``root`` and in the cgroup's memory
    limit (cgroup v2; a tmpfs's pages count in it), with ``_ROOM_SPARE_BYTES`` left over."""
    need = nbytes + _ROOM_SPARE_BYTES
    st = os.statvfs(root)
    if st.f_bavail * st.f_frsize < need:
        return False
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        used = int((_CGROUP / "memory.current").read_text())
    except (OSError, ValueError):
        return True  # no cgroup v2 memory controller to ask
    return limit == "max" or int(limit) - used >= need


def _same_file(fd: int, path: Path) -> bool:
    """True if ``path`` still names the file open at ``fd``."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)


def pod_handover_dir(job_id: str, pod_name: str, launcher_id: str) -> Path:
    """Where a launcher's workers hand state over: shared memory when the pod has it."""
    base = SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else Path(tempfile.gettempdir())
    safe_job = job_id.replace("/", "_")
    return base / f"{_DIR_PREFIX}{safe_job}-{pod_name}-{launcher_id[:8]}"


def own_pod_handover_dir(job_id: str, pod_name: str, launcher_id: str) -> Path:
    """:func:`pod_handover_dir`, created with this process's exclusive ``flock`` on its owner
    file for as long as the process lives; first, the directories of launchers that died
    without removing theirs (SIGKILL, OOM) are removed: a container restarted in its pod keeps
    ``/dev/shm``, and each would keep a state's size there until the pod ends."""
    path = pod_handover_dir(job_id, pod_name, launcher_id)
    for other in path.parent.glob(f"{_DIR_PREFIX}*"):
        if other != path:
            _remove_if_orphan(other)
    # Created under another name and renamed once locked: a launcher starting beside this
    # one never sees it without its owner's lock.
    tmp = path.parent / f".{path.name}.tmp-{secrets.token_hex(4)}"
    tmp.mkdir(parents=True)
    fd = os.open(tmp / _OWNER, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _OWNED_FDS[path] = fd  # held until release_pod_handover_dir, or the process's end
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def release_pod_handover_dir(path: Path) -> None:
    """Removes a launcher's handover directory (what was handed over goes with the launcher:
    the pod's memory is the pod's) and lets go of its owner's lock."""
    shutil.rmtree(path, ignore_errors=True)
    fd = _OWNED_FDS.pop(path, None)
    if fd is not None:
        os.close(fd)


def _remove_if_orphan(directory: Path) -> None:
    """Removes a launcher's handover directory if no process holds its owner's lock (one
    with no owner file is of an older release: left alone)."""
    try:
        fd = os.open(directory / _OWNER, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return
    try:
        shutil.rmtree(directory, ignore_errors=True)
        logger.info("removed the handover directory %s of a launcher that died", directory)
    finally:
        os.close(fd)
