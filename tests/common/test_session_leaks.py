"""The session's end finds what a test left running (tests/support/leaks.py)."""

from __future__ import annotations

import os
import subprocess
import sys

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
