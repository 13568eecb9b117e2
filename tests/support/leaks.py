"""What a test session leaves behind cannot hang it.

A CI run once finished its last test at 16 min 40 s and then sat until the
runner's 90-minute limit killed it: something the tests had started outlived
them and kept the interpreter from exiting (a process still holding a pipe a
drain thread reads, or a non-daemon thread blocked for good; Python joins those
before it exits). The session therefore marks every process it starts through
the environment, and at its very end

- kills every process that still carries its mark, naming each one, and
- names every non-daemon thread still alive with its stack; when one does not
  end within a few seconds, the session exits with its own status rather than
  wait for it.

Both print to the real stderr, so a leak is seen in the CI log and can be mended
where it starts; this module only keeps it from costing the run.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import signal
import sys
import threading
import traceback
import uuid
from collections.abc import Collection
from pathlib import Path
from types import FrameType

MARK = "TIDE_TEST_SESSION"
_THREAD_GRACE_S = 5.0

_status = 0
#: pid → the test after which it was first seen carrying the mark (or "" when it does
#: not carry it): a leak at the end names the test that started it.
_seen: dict[int, str] = {}


def mark_session() -> None:
    """Give this session its own mark; a pytest run inside a test gets another."""
    os.environ[MARK] = uuid.uuid4().hex


def remember_status(status: int) -> None:
    global _status
    _status = status


def _carries(entry: Path, needle: bytes) -> bool | None:
    """Whether the process at ``entry`` (/proc/PID) has ``needle`` in its environment;
    None when it is gone or not ours to read."""
    try:
        return needle in (entry / "environ").read_bytes().split(b"\0")
    except OSError:
        return None


def note_test(nodeid: str) -> None:
    """After each test: the new processes carrying the mark are that test's. Only pids
    not seen before are read, so this costs a directory listing per test."""
    token = os.environ.get(MARK)
    if not token or not Path("/proc").is_dir():
        return
    needle = f"{MARK}={token}".encode()
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid in _seen or pid == me:
            continue
        carries = _carries(entry, needle)
        if carries is not None:
            _seen[pid] = nodeid if carries else ""


def _marked(token: str) -> list[tuple[int, str]]:
    needle = f"{MARK}={token}".encode()
    me = os.getpid()
    found: list[tuple[int, str]] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        if not _carries(entry, needle):
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone since
        found.append((int(entry.name), cmd.strip()[:200]))
    return found


def _idle_pool_worker(frame: FrameType | None) -> bool:
    """A ThreadPoolExecutor's worker waiting for work: the interpreter tells it to end at
    exit, so it holds nothing up. One running a task is not idle."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_worker" and code.co_filename.endswith(
            os.path.join("concurrent", "futures", "thread.py")
        ):
            return "work_queue.get" in linecache.getline(code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return False


def _say(text: str) -> None:
    err = sys.__stderr__ or sys.stderr
    err.write(text + "\n")
    err.flush()


def end_session(spare: Collection[int] = ()) -> None:
    """``spare``: processes of the session's own that it ends itself, after this check."""
    token = os.environ.get(MARK)
    if token and Path("/proc").is_dir():
        left = _marked(token)
        for pid, cmd in left:
            if pid in spare:
                continue
            if "multiprocessing.resource_tracker" in cmd:
                # multiprocessing's own helper: it ends with this process, nothing leaked.
                continue
            by = _seen.get(pid) or "an unknown test"
            _say(f"tests/support/leaks: process {pid} (from {by}) outlived it, killed: {cmd}")
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    frames = sys._current_frames()
    stuck = [
        t
        for t in threading.enumerate()
        if t is not threading.main_thread()
        and not t.daemon
        and t.is_alive()
        and not _idle_pool_worker(frames.get(t.ident or 0))
    ]
    for t in stuck:
        t.join(_THREAD_GRACE_S / max(1, len(stuck)))
    stuck = [t for t in stuck if t.is_alive()]
    if not stuck:
        return
    frames = sys._current_frames()
    for t in stuck:
        stack = "".join(traceback.format_stack(frames[t.ident])) if t.ident in frames else ""
        _say(f"tests/support/leaks: non-daemon thread {t.name!r} still running:\n{stack}")
    _say(f"tests/support/leaks: exiting with status {_status} without waiting for them")
    sys.stdout.flush()
    os._exit(_status)
