"""Atomic, verifiable checkpoints: one directory per step, a sha256 manifest written last.

Commit protocol (a SIGKILL between any two lines leaves the previous checkpoint loadable):

1. ``step-N.tmp-<nonce>/`` is created; every file is written as ``name.part``, fsynced and
   renamed to ``name``;
2. ``manifest.json`` (size and sha256 of every file, plus the metadata) is written the same way,
   then the directory is fsynced;
3. the directory is renamed to ``step-N`` and the root fsynced: only now is it visible;
4. all but the newest ``keep`` checkpoints are deleted.

A writer holds an exclusive lock on ``.lock`` in the root for the whole write, so writers of
one store take turns (an old generation's rank 0 that is still finishing and the new one's),
and :meth:`CheckpointStore.cleanup_tmp` removes the ``.tmp-`` directories of crashed writers
only when it gets that lock without waiting: a temp directory a live writer is filling is
never deleted. A SIGKILLed writer's lock goes with its process.

A directory without a manifest that verifies is never loaded; :meth:`CheckpointStore.load_latest`
walks back to the newest one that does. The file layer deals in bytes so it can be tested without
Paddle; :mod:`tide.trainer.session` serialises Paddle state into it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tide.base.errors import ConfigError, FailedPrecondition, NotFound
from tide.trainer.rawstate import Piece, file_pieces

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LOCK = ".lock"
FORMAT_VERSION = 1
# Env var naming a fault point at which the writing process SIGKILLs itself (crash tests).
FAULT_ENV = "TIDE_CKPT_FAULT"
FAULT_POINTS = (
    "after_mkdir",
    "after_file_write",
    "after_file_fsync",
    "after_file_rename",
    "after_manifest_write",
    "after_manifest_fsync",
    "after_manifest_rename",
    "before_dir_rename",
    "after_dir_rename",
    "during_prune",
)

_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_TMP_DIR = re.compile(r"^step-\d{8,}\.tmp-[0-9a-f]+$")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class CheckpointNotFound(NotFound):
    """No checkpoint (or no good one) exists where one was asked for."""


class CheckpointCorrupt(FailedPrecondition):
    """A checkpoint failed verification. ``kind`` says how (e.g. ``checksum``, ``missing``)."""

    def __init__(self, path: Path, kind: str, detail: str) -> None:
        super().__init__(f"checkpoint {path} is damaged ({kind}): {detail}")
        self.path = path
        self.kind = kind


@dataclass(frozen=True)
class CheckpointSettings:
    # Keep this many newest checkpoints; older ones are deleted after each write.
    keep: int = 3
    # Periodic checkpoints: every this many steps (0: never by steps)...
    every_steps: int = 0
    # ...or when this many seconds have passed since the last one (0: never by time).
    every_s: float = 0.0

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise ConfigError(f"keep must be >= 1, got {self.keep}")
        if self.every_steps < 0:
            raise ConfigError(f"every_steps must be >= 0, got {self.every_steps}")
        if self.every_s < 0:
            raise ConfigError(f"every_s must be >= 0, got {self.every_s}")


@dataclass(frozen=True)
class WrittenCheckpoint:
    step: int
    path: Path
    # sha256 (hex) of the manifest bytes: names the whole checkpoint.
    digest: str
    write_s: float


@dataclass(frozen=True)
class LoadedCheckpoint:
    step: int
    path: Path
    digest: str
    files: Mapping[str, bytes]
    meta: Mapping[str, Any]
    # Newer checkpoints that were skipped because they failed verification.
    skipped: tuple[CheckpointCorrupt, ...] = field(default=())


def _fault(point: str) -> None:
    if os.environ.get(FAULT_ENV) == point:
        logger.warning("fault point %s armed: killing pid %d", point, os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(
    directory: Path, name: str, data: Sequence[Piece], fault_prefix: str
) -> dict[str, Any]:
    """Writes ``data`` (the file's pieces, one after the other) durably; its size and sha256."""
    part = directory / f"{name}.part"
    digest = hashlib.sha256()
    size = 0
    with open(part, "wb") as f:
        for piece in data:
            f.write(piece)
            digest.update(piece)
            size += len(piece) if isinstance(piece, bytes) else piece.nbytes
        f.flush()
        _fault(f"after_{fault_prefix}_write")
        os.fsync(f.fileno())
    _fault(f"after_{fault_prefix}_fsync")
    os.replace(part, directory / name)
    _fault(f"after_{fault_prefix}_rename")
    return {"size": size, "sha256": digest.hexdigest()}


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def list_step_dirs(root: Path) -> list[int]:
    """The steps of ``root``'s committed step directories (``step_dir_name``), oldest
    first: the durable store's and the pod's handover's."""
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and entry.is_dir() and not entry.is_symlink():
            steps.append(int(m.group(1)))
    return sorted(steps)


class CheckpointStore:
    """Checkpoints of one job under ``root`` (a local folder or a shared volume)."""

    def __init__(self, root: Path | str, keep: int = 3) -> None:
        if keep < 1:
            raise ConfigError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep

    def write(
        self, step: int, files: Mapping[str, bytes], meta: Mapping[str, Any]
    ) -> WrittenCheckpoint:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        for name in files:
            if (
                not _SAFE_NAME.match(name)
                or name in (MANIFEST, ".", "..")
                or name.endswith(".part")
            ):
                raise ValueError(f"bad checkpoint file name {name!r}")
        started = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        with self._writer_lock(wait=True):
            final, digest = self._write_locked(step, files, meta)
        written = WrittenCheckpoint(step, final, digest, time.monotonic() - started)
        logger.info("checkpoint of step %d written to %s in %.3fs", step, final, written.write_s)
        return written

    @contextlib.contextmanager
    def _writer_lock(self, wait: bool) -> Iterator[bool]:
        """Holds the store's writer lock; yields False (holding nothing) when ``wait`` is
        False and another process holds it."""
        fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # releases the lock

    def _write_locked(
        self, step: int, files: Mapping[str, bytes], meta: Mapping[str, Any]
    ) -> tuple[Path, str]:
        """The commit protocol of the module docstring; the caller holds the writer lock."""
        tmp = self.root / f"{step_dir_name(step)}.tmp-{secrets.token_hex(4)}"
        tmp.mkdir()
        _fault("after_mkdir")
        entries: dict[str, dict[str, Any]] = {}
        try:
            # A raw state's tensors stream from their arrays into state.tensors.
            for name, data in file_pieces(files):
                entries[name] = _write_durable(tmp, name, data, "file")
            manifest = {
                "format": FORMAT_VERSION,
                "step": step,
                "files": entries,
                "meta": dict(meta),
            }
            manifest_bytes = json.dumps(manifest, sort_keys=True, indent=1).encode()
            _write_durable(tmp, MANIFEST, [manifest_bytes], "manifest")
            _fsync_dir(tmp)
        except OSError:
            # A full or read-only volume: the half-written step goes now, not at the next
            # start, so it does not hold the space the next attempt needs.
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        final = self.root / step_dir_name(step)
        _fault("before_dir_rename")
        if final.exists():
            # Re-writing a step (after a fallback) replaces it; move the old one out of sight
            # first, because rename(2) does not replace a non-empty directory.
            trash = self.root / f"{step_dir_name(step)}.tmp-{secrets.token_hex(4)}"
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fault("after_dir_rename")
        _fsync_dir(self.root)
        self._prune()
        return final, hashlib.sha256(manifest_bytes).hexdigest()

    def _prune(self) -> None:
        steps = self.list_steps()
        for old in steps[: -self.keep]:
            shutil.rmtree(self.root / step_dir_name(old), ignore_errors=True)
            _fault("during_prune")

    def list_steps(self) -> list[int]:
        """Steps with a committed directory, oldest first (not verified)."""
        return list_step_dirs(self.root)

    def cleanup_tmp(self) -> int:
        """Delete the temporary directories of interrupted writes; returns how many.

        Only when no writer is running (the writer lock is free): a live writer's temporary
        directory is not a leftover. Then it does nothing and the next call tries again."""
        if not self.root.is_dir():
            return 0
        with self._writer_lock(wait=False) as free:
            if not free:
                logger.info("checkpoint store %s: a writer is running; leftovers stay", self.root)
                return 0
            leftovers = [e for e in self.root.iterdir() if _TMP_DIR.match(e.name)]
            for entry in leftovers:
                shutil.rmtree(entry, ignore_errors=True)
        if leftovers:
            logger.warning(
                "checkpoint store %s: removed %d directories of interrupted writes: %s",
                self.root,
                len(leftovers),
                ", ".join(sorted(e.name for e in leftovers)),
            )
        return len(leftovers)

    def verify(self, step: int) -> tuple[dict[str, Any], str]:
        """The manifest of ``step`` and its digest, if every file matches it."""
        manifest, digest, _ = self._read(step, with_data=False)
        return manifest, digest

    def load(self, step: int) -> LoadedCheckpoint:
        manifest, digest, data = self._read(step, with_data=True)
        return LoadedCheckpoint(
            step=step,
            path=self.root / step_dir_name(step),
            digest=digest,
            files=data,
            meta=manifest.get("meta", {}),
        )

    def load_latest(self, at_most: int | None = None) -> LoadedCheckpoint:
        """The newest checkpoint (with step <= at_most) that verifies, skipping damaged ones."""
        skipped: list[CheckpointCorrupt] = []
        for step in reversed(self.list_steps()):
            if at_most is not None and step > at_most:
                continue
            try:
                loaded = self.load(step)
            except CheckpointCorrupt as exc:
                logger.warning("skipping damaged checkpoint of step %d: %s", step, exc)
                skipped.append(exc)
                continue
            return LoadedCheckpoint(
                loaded.step, loaded.path, loaded.digest, loaded.files, loaded.meta, tuple(skipped)
            )
        raise CheckpointNotFound(
            f"no good checkpoint under {self.root}"
            + (f" at or before step {at_most}" if at_most is not None else "")
            + (f" ({len(skipped)} damaged)" if skipped else "")
        )

    def latest_good_step(self) -> int | None:
        for step in reversed(self.list_steps()):
            try:
                self.verify(step)
            except CheckpointCorrupt:
                continue
            return step
        return None

    def _read(self, step: int, with_data: bool) -> tuple[dict[str, Any], str, dict[str, bytes]]:
        directory = self.root / step_dir_name(step)
        if not directory.is_dir():
            raise CheckpointNotFound(f"no checkpoint of step {step} under {self.root}")
        try:
            manifest_bytes = (directory / MANIFEST).read_bytes()
        except FileNotFoundError:
            raise CheckpointCorrupt(directory, "no_manifest", "manifest.json is missing") from None
        try:
            manifest = json.loads(manifest_bytes)
            entries = manifest["files"]
            if manifest.get("format") != FORMAT_VERSION or manifest.get("step") != step:
                raise ValueError(f"format {manifest.get('format')} step {manifest.get('step')}")
            if not isinstance(entries, dict):
                raise ValueError("files is not an object")
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointCorrupt(directory, "bad_manifest", str(exc)) from None
        real_dir = directory.resolve()
        data: dict[str, bytes] = {}
        for name, entry in entries.items():
            path = directory / name
            if (
                not isinstance(name, str)
                or not _SAFE_NAME.match(name)
                or name in (".", "..")
                or path.resolve().parent != real_dir
            ):
                raise CheckpointCorrupt(directory, "path_escape", f"entry {name!r}")
            if path.is_symlink():
                raise CheckpointCorrupt(directory, "path_escape", f"{name!r} is a symlink")
            try:
                blob = path.read_bytes()
            except FileNotFoundError:
                raise CheckpointCorrupt(directory, "missing", f"{name!r} is missing") from None
            if len(blob) != entry.get("size"):
                raise CheckpointCorrupt(
                    directory,
                    "size",
                    f"{name!r} has {len(blob)} bytes, manifest {entry.get('size')}",
                )
            if hashlib.sha256(blob).hexdigest() != entry.get("sha256"):
                raise CheckpointCorrupt(directory, "checksum", f"{name!r} sha256 differs")
            if with_data:
                data[name] = blob
        return manifest, hashlib.sha256(manifest_bytes).hexdigest(), data


class PeriodicSchedule:
    """Decides when a periodic checkpoint is due: every N steps or T seconds since the last."""

    def __init__(self, settings: CheckpointSettings, now_s: float) -> None:
        self.settings = settings
        self._last_at_s = now_s
        self._last_step: int | None = None

    def due(self, step: int, now_s: float) -> bool:
        s = self.settings
        if self._last_step == step:
            return False
        by_steps = s.every_steps > 0 and step % s.every_steps == 0
        by_time = s.every_s > 0 and now_s - self._last_at_s >= s.every_s
        return by_steps or by_time

    def mark(self, step: int, now_s: float) -> None:
        self._last_step = step
        self._last_at_s = now_s
