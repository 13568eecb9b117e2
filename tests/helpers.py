"""Helpers shared by the test tiers: polling instead of sleeping, service processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent


def wait_for(
    condition: Callable[[], T | None],
    timeout_s: float = 10.0,
    interval_s: float = 0.02,
    what: str = "",
) -> T:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or condition}")
        time.sleep(interval_s)


@dataclass
class ServiceProcess:
    proc: subprocess.Popen[str]
    port: int
    metrics_port: int | None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def terminate(self, timeout_s: float = 15.0) -> int:
        self.proc.terminate()
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


_LISTENING = re.compile(r"LISTENING grpc=(\d+) metrics=(\d+|None)")


def start_service(
    args: Sequence[str], env: dict[str, str] | None = None, timeout_s: float = 30.0
) -> ServiceProcess:
    """Start ``python <args>`` and wait for the runtime's LISTENING line on stdout."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = _LISTENING.search(line)
        if m:
            metrics = None if m.group(2) == "None" else int(m.group(2))
            return ServiceProcess(proc, int(m.group(1)), metrics)
    proc.kill()
    _, err = proc.communicate(timeout=10)
    raise AssertionError(f"service {args} did not start: {err[-2000:]}")
