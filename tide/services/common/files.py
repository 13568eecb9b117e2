"""Writing a file whole or not at all: a temporary beside it, then a rename, so a reader
(or a crash) never sees half of it. One helper for local mode's CA, the CLI's contexts
file and the local actuator's job files."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, data: bytes, *, private: bool = False, sync: bool = False) -> None:
    """``data`` into ``path``; ``private``: readable by its owner alone from the start (a
    key, a file naming credentials), never chmod-ed after a moment of the umask's mode;
    ``sync``: on disk before the rename (a file that must survive a machine's crash)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
