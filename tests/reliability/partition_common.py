"""What the partition links share: the test bounds, stamped log tails, a metrics
scrape and a poll (partition_driver.py runs the links).
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from tests.support.procs import ServiceProcess

KEEPALIVE_TIME_S = 2.0
KEEPALIVE_TIMEOUT_S = 1.0
BACKOFF_MAX_S = 1.0
#: The scaler closes a stream that sent nothing for this long (1 to 1.25 times it).
STREAM_IDLE_TIMEOUT_S = 2.0
STALE_AFTER_S = 2.0
#: How long the link stays cut: past every detection bound above.
PARTITION_S = 6.0
#: The scaler's coordinator channel keeps the production keepalive (20 s + 10 s); a
#: call on a cut link fails when its unacknowledged bytes pass the TCP user timeout,
#: which gRPC sets to the keepalive timeout (10 s).
COORDINATOR_KEEPALIVE_TIMEOUT_S = 10.0
CUT_AFTER_NOTICE_S = 2.0
#: The coordinator's member heartbeat timeout in the launcher test: past the partition.
MEMBER_TIMEOUT_S = 20.0
#: The Kubernetes actuator's bound on one read or patch in the API-server test.
API_REQUEST_TIMEOUT_S = 1.0
API_JOB_NAME = "cut"

T = TypeVar("T")


@dataclass
class LogTail:
    """A process's stderr (or stdout), each line stamped with the monotonic time it arrived."""

    proc: subprocess.Popen[str]
    stdout: bool = False
    lines: list[tuple[float, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        stream = self.proc.stdout if self.stdout else self.proc.stderr
        assert stream is not None
        for line in stream:
            self.lines.append((time.monotonic(), line.rstrip()))

    def first(self, after: float, *needles: str) -> tuple[float, str] | None:
        for at, line in list(self.lines):
            if at >= after and all(n in line for n in needles):
                return at, line
        return None


def scrape(proc: ServiceProcess, series: str) -> float:
    url = f"http://127.0.0.1:{proc.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(series + " "):
                return float(line.split()[-1])
    return 0.0


async def poll_until(condition: Callable[[], T | None], timeout_s: float) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s")
        await asyncio.sleep(0.02)
