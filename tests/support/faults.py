"""Root-only faults on this machine: a small tmpfs to fill or make read-only, and
(tests/support/netns.py) network namespaces to partition.

Each fault is undone in ``finally`` and again at exit (``atexit``), so a test that
fails, or a pytest that is interrupted, never leaves a mount behind. A test that
cannot have the fault (not root, no ``mount``) is skipped with the reason.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def require_root(*tools: str) -> None:
    """Skip the calling test unless it runs as root with every tool on PATH."""
    if os.geteuid() != 0:
        pytest.skip("needs root (mount / ip netns)")
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} on PATH")


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)


@contextlib.contextmanager
def small_tmpfs(size_bytes: int) -> Iterator[Path]:
    """A tmpfs of ``size_bytes`` mounted on a fresh directory; unmounted however the test ends."""
    require_root("mount", "umount")
    where = Path(tempfile.mkdtemp(prefix="tide-tmpfs-"))
    done = _run("mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tide-test", str(where))
    if done.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")

    def undo() -> None:
        # Lazy: a process that still holds a file there (a killed scaler's last
        # descriptor) must not keep the mount, or the directory, alive.
        if os.path.ismount(where):
            _run("umount", "-l", str(where))
        with contextlib.suppress(OSError):
            where.rmdir()

    atexit.register(undo)
    try:
        yield where
    finally:
        undo()
        atexit.unregister(undo)


def fill(directory: Path) -> Path:
    """Write zeros to ``directory/filler`` until its file system is full; returns the file."""
    filler = directory / "filler"
    with open(filler, "wb") as f:
        chunk = b"\0" * (1 << 16)
        with contextlib.suppress(OSError):  # ENOSPC is the point
            while True:
                f.write(chunk)
                f.flush()
    return filler


def remount(where: Path, mode: str) -> None:
    """Remount ``where`` ``ro`` or ``rw`` (fails, EBUSY, while a file there is open to write)."""
    done = _run("mount", "-o", f"remount,{mode}", str(where))
    assert done.returncode == 0, done.stderr
