"""How long a thread has waited for a CPU: Linux schedstat's run-queue time.

A timer that fires late or a probe that answers late has two causes that call for
different answers: the code (or the thing it waits on) was slow, or the thread was
runnable and the machine had no CPU free for it. ``/proc/.../schedstat`` tells them
apart: its second field is the nanoseconds the thread spent runnable on a run queue
(not the time it slept on I/O, a lock or a timer). Every reader returns 0.0 where the
kernel does not say (no schedstat, another OS), so callers fall back to wall time.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping


def _run_queue_s(raw: bytes) -> float:
    return int(raw.split()[1]) / 1e9


class CpuWait:
    """The calling thread's run-queue time, cheap to read again and again (one pread)."""

    def __init__(self) -> None:
        self._fd: int | None = None
        # thread-self resolves at open: the file stays the opening thread's.
        with contextlib.suppress(OSError):
            self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)

    def seconds(self) -> float:
        if self._fd is None:
            return 0.0
        try:
            return _run_queue_s(os.pread(self._fd, 128, 0))
        except (OSError, ValueError, IndexError):
            return 0.0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def thread_cpu_wait_s(native_id: int) -> float:
    """The run-queue time of this process's thread ``native_id`` (threading.get_native_id)."""
    try:
        with open(f"/proc/self/task/{native_id}/schedstat", "rb") as f:
            return _run_queue_s(f.read())
    except (OSError, ValueError, IndexError):
        return 0.0


def process_thread_waits_s(pid: int) -> dict[int, float]:
    """The run-queue time of each thread of process ``pid``, by thread id (empty when the
    process is gone). Every thread, not the main one's alone: what a process waits on may
    be another of its threads (a reader that has not read the message yet, a thread holding
    the GIL), and the waiting thread then sleeps, which is no run-queue time of its own."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    waits: dict[int, float] = {}
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                waits[int(tid)] = _run_queue_s(f.read())
        except (OSError, ValueError, IndexError):
            continue
    return waits


def waited_since(before: Mapping[int, float], after: Mapping[int, float]) -> float:
    """The run-queue time the threads of ``after`` gained since ``before``, summed: a thread
    new since then counts whole, one that ended between the two reads drops out (a lower
    bound, never negative)."""
    return sum(max(0.0, w - before.get(tid, 0.0)) for tid, w in after.items())
