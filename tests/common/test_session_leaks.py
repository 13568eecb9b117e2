"""The session's end finds what a test left running (tests/support/leaks.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.support import leaks

pytestmark = pytest.mark.integration


def test_a_process_started_by_a_test_carries_the_sessions_mark() -> None:
    token = os.environ[leaks.MARK]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert child.pid in {pid for pid, _ in leaks._marked(token)}
        # Another session's mark does not match it.
        assert child.pid not in {pid for pid, _ in leaks._marked("another")}
    finally:
        child.kill()
        child.wait()
    assert child.pid not in {pid for pid, _ in leaks._marked(token)}


def test_an_idle_pool_worker_is_not_stuck_and_a_busy_one_is() -> None:
    import sys
    import threading
    from concurrent.futures import ThreadPoolExecutor

    started, release = threading.Event(), threading.Event()

    def task() -> None:
        started.set()
        release.wait(30)

    with (
        ThreadPoolExecutor(1, thread_name_prefix="idle") as idle_pool,
        ThreadPoolExecutor(1, thread_name_prefix="busy") as busy_pool,
    ):
        idle_pool.submit(lambda: None).result()
        busy = busy_pool.submit(task)
        try:
            assert started.wait(10)
            # The idle worker is back in its queue's get a moment after its result is set.
            deadline = time.monotonic() + 5
            while True:
                frames = sys._current_frames()
                by_name = {
                    t.name.split("_")[0]: leaks._idle_pool_worker(frames.get(t.ident or 0))
                    for t in threading.enumerate()
                    if t.name.startswith(("idle", "busy"))
                }
                if by_name == {"idle": True, "busy": False} or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            assert by_name == {"idle": True, "busy": False}
        finally:
            release.set()
        busy.result()
