"""Durable checkpoints in object storage (S3, GCS, Azure, ... through fsspec).

Object stores have no atomic rename of a directory, so the commit point is the manifest:
a checkpoint is written under ``step-N.<nonce>/``, every file first, ``manifest.json`` (sizes
and sha256 sums, as in tide/trainer/checkpoint.py) last. A prefix without a manifest that verifies
is never loaded: a writer killed half-way leaves an invisible prefix that
:meth:`ObjectStore.cleanup_tmp` removes. Keep the newest ``keep`` steps.

``make_store(url)``: a URL with a scheme (``s3://bucket/job``, ``memory://x``) is an object
store; a path (or ``file://``) is a :class:`~tide.trainer.checkpoint.CheckpointStore` directory,
which is also what a PVC is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tide.base.errors import ConfigError
from tide.trainer.checkpoint import (
    FORMAT_VERSION,
    MANIFEST,
    CheckpointCorrupt,
    CheckpointNotFound,
    CheckpointStore,
    LoadedCheckpoint,
    WrittenCheckpoint,
)
from tide.trainer.persist import DurableStore
from tide.trainer.rawstate import file_pieces

logger = logging.getLogger(__name__)

_PREFIX = re.compile(r"^step-(\d{8,})\.([0-9a-f]+)$")


class ObjectStore:
    def __init__(self, url: str, keep: int = 3) -> None:
        import fsspec

        if keep < 1:
            raise ConfigError(f"keep must be >= 1, got {keep}")
        self.url = url
        self.keep = keep
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.root = self.root.rstrip("/")

    def _prefixes(self) -> list[tuple[int, str, bool]]:
        """(step, prefix, has a manifest) of every checkpoint prefix, oldest first."""
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        out = []
        for entry in entries:
            name = str(entry).rstrip("/").rsplit("/", 1)[-1]
            m = _PREFIX.match(name)
            if m:
                prefix = f"{self.root}/{name}"
                out.append((int(m.group(1)), prefix, self.fs.exists(f"{prefix}/{MANIFEST}")))
        return sorted(out)

    def write(
        self, step: int, files: Mapping[str, bytes], meta: Mapping[str, Any]
    ) -> WrittenCheckpoint:
        started = time.monotonic()
        prefix = f"{self.root}/step-{step:08d}.{secrets.token_hex(4)}"
        entries = {}
        for name, pieces in file_pieces(files):
            digest, size = hashlib.sha256(), 0
            with self.fs.open(f"{prefix}/{name}", "wb") as f:
                for piece in pieces:
                    f.write(piece)
                    digest.update(piece)
                    size += len(piece) if isinstance(piece, bytes) else piece.nbytes
            entries[name] = {"size": size, "sha256": digest.hexdigest()}
        manifest = {"format": FORMAT_VERSION, "step": step, "files": entries, "meta": dict(meta)}
        body = json.dumps(manifest, sort_keys=True, indent=1).encode()
        self.fs.pipe_file(f"{prefix}/{MANIFEST}", body)
        self._prune()
        written = WrittenCheckpoint(
            step, Path(prefix), hashlib.sha256(body).hexdigest(), time.monotonic() - started
        )
        logger.info("checkpoint of step %d written to %s in %.3fs", step, prefix, written.write_s)
        return written

    def _prune(self) -> None:
        committed = [p for p in self._prefixes() if p[2]]
        steps = sorted({s for s, _, _ in committed})
        old = set(steps[: -self.keep])
        for step, prefix, _ in committed:
            if step in old:
                self.fs.rm(prefix, recursive=True)

    def list_steps(self) -> list[int]:
        return sorted({s for s, _, committed in self._prefixes() if committed})

    def cleanup_tmp(self) -> int:
        """Remove prefixes without a manifest (interrupted writes); returns how many."""
        torn = [prefix for _, prefix, committed in self._prefixes() if not committed]
        for prefix in torn:
            self.fs.rm(prefix, recursive=True)
        return len(torn)

    def _load(self, prefix: str, step: int) -> LoadedCheckpoint:
        where = Path(prefix)
        try:
            body = self.fs.cat_file(f"{prefix}/{MANIFEST}")
            manifest = json.loads(body)
            entries = manifest["files"]
            if manifest.get("format") != FORMAT_VERSION or manifest.get("step") != step:
                raise ValueError(f"format {manifest.get('format')} step {manifest.get('step')}")
        except (ValueError, KeyError, TypeError, FileNotFoundError) as exc:
            raise CheckpointCorrupt(where, "bad_manifest", str(exc)) from None
        data = {}
        for name, entry in entries.items():
            try:
                blob = self.fs.cat_file(f"{prefix}/{name}")
            except FileNotFoundError:
                raise CheckpointCorrupt(where, "missing", f"{name!r} is missing") from None
            if len(blob) != entry.get("size") or (
                hashlib.sha256(blob).hexdigest() != entry.get("sha256")
            ):
                raise CheckpointCorrupt(where, "checksum", f"{name!r} differs from its manifest")
            data[name] = blob
        digest = hashlib.sha256(body).hexdigest()
        return LoadedCheckpoint(step, where, digest, data, manifest.get("meta", {}))

    def load_latest(self, at_most: int | None = None) -> LoadedCheckpoint:
        skipped: list[CheckpointCorrupt] = []
        for step, prefix, committed in reversed(self._prefixes()):
            if not committed or (at_most is not None and step > at_most):
                continue
            try:
                loaded = self._load(prefix, step)
            except CheckpointCorrupt as exc:
                logger.warning("skipping damaged checkpoint of step %d: %s", step, exc)
                skipped.append(exc)
                continue
            return LoadedCheckpoint(
                loaded.step, loaded.path, loaded.digest, loaded.files, loaded.meta, tuple(skipped)
            )
        raise CheckpointNotFound(f"no good checkpoint under {self.url}")


def make_store(url: str, keep: int = 3) -> DurableStore:
    """The durable store a checkpoint location names (see the module docstring)."""
    if "://" in url and not url.startswith("file://"):
        return ObjectStore(url, keep)
    return CheckpointStore(url.removeprefix("file://"), keep)
