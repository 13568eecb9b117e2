"""A process's CPU wait counts every thread of it (tide/base/cpuwait.py): a worker whose main
thread sleeps while the thread it waits on sits on a run queue was starved all the same."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tide.base.cpuwait import process_thread_waits_s, waited_since

pytestmark = pytest.mark.unit

#: Two threads hashing (hashlib releases the GIL) on one CPU while the main thread sleeps:
#: each waits on the run queue for the other.
_CHILD = """
import hashlib, os, sys, threading
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
data = bytes(1 << 20)
stop = threading.Event()
def spin():
    while not stop.is_set():
        hashlib.sha256(data).digest()
threads = [threading.Thread(target=spin) for _ in range(2)]
for t in threads:
    t.start()
sys.stdout.write("ready\\n"); sys.stdout.flush()
sys.stdin.readline()
stop.set()
for t in threads:
    t.join()
"""


def _main_thread_wait_s(pid: int) -> float:
    with open(f"/proc/{pid}/schedstat", "rb") as f:
        return int(f.read().split()[1]) / 1e9


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="no schedstat")
def test_the_wait_of_threads_other_than_the_main_one_counts() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline() == "ready\n"
        before = process_thread_waits_s(child.pid)
        main_before = _main_thread_wait_s(child.pid)
        deadline = time.monotonic() + 10.0
        # Polled: on a loaded machine the two threads take longer to queue behind each other.
        while waited_since(before, process_thread_waits_s(child.pid)) < 0.2:
            assert time.monotonic() < deadline, "the spinning threads never waited for the CPU"
            time.sleep(0.05)
        # The main thread slept on stdin throughout: its own wait is not what was counted.
        assert _main_thread_wait_s(child.pid) - main_before < 0.1
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(10) == 0
    finally:
        child.kill()
        child.wait()


def test_a_gone_process_waited_nothing() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_thread_waits_s(child.pid) == {}


def test_a_thread_that_ended_between_the_reads_takes_nothing_away() -> None:
    # Thread 2 ended (its 3 s gone from the second read), thread 3 is new: 0.5 + 0.2 waited.
    assert waited_since({1: 5.0, 2: 3.0}, {1: 5.5, 3: 0.2}) == pytest.approx(0.7)
    assert waited_since({1: 5.0, 2: 3.0}, {}) == 0.0
