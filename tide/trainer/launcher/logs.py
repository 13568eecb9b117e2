"""The workers' log files in a launcher's state folder: bounded, and read back when one
fails.

Every worker (each generation's, each prewarmed one) writes its own file, so a worker
that crashes at every start once left one file per attempt, forever. :func:`rotate`
keeps the newest few (and never one a live worker writes); :func:`tail` is what the
coordinator hears of a failed worker, and :func:`exit_cause` says how it ended.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Collection
from pathlib import Path

from tide.trainer.launcher.model import WorkerExit

logger = logging.getLogger(__name__)

#: What a failure report carries of the worker's log: its end, this many bytes at most.
LOG_TAIL_BYTES = 4096
#: The files :func:`rotate` manages (the supervisor names every worker's log so).
LOG_GLOB = "worker-*.log"


def exit_cause(code: int) -> str:
    """A worker's exit status in words (negative: the signal that killed it)."""
    if code >= 0:
        return f"exited with {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"was killed by {name}"


def tail(path: str | Path | None, max_bytes: int = LOG_TAIL_BYTES) -> str:
    """The end of the log at ``path``, from a line start where the cut allows; "" if
    there is none."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ""
    if size > max_bytes and b"\n" in data:
        data = data[data.index(b"\n") + 1 :]
    return data.decode("utf-8", errors="replace")


def worker_exit(code: int, log_path: str | None) -> WorkerExit:
    return WorkerExit(exit_code=code, cause=exit_cause(code), log_tail=tail(log_path))


def rotate(folder: Path, keep: int, in_use: Collection[str] = ()) -> list[Path]:
    """Delete all but the newest ``keep`` worker logs in ``folder`` (those in ``in_use``,
    written by live workers, are never deleted nor counted); returns what went."""
    try:
        logs = [p for p in folder.glob(LOG_GLOB) if str(p) not in in_use]
        logs.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return []
    gone = logs[max(0, keep - len(in_use)) :]
    for p in gone:
        with contextlib.suppress(OSError):
            p.unlink()
    if gone:
        logger.debug("rotated %d worker log(s) out of %s", len(gone), folder)
    return gone
