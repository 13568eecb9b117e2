"""Tide services as real processes, their ports read from the LISTENING line."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tide.base.listening import parse_listening

ROOT = Path(__file__).resolve().parent.parent.parent


@dataclass
class ServiceProcess:
    proc: subprocess.Popen[str]
    port: int
    metrics_port: int | None
    #: The last lines of stdout and stderr once :meth:`drain` runs, and how many bytes.
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=200))
    drained_bytes: list[int] = field(default_factory=lambda: [0])

    def drain(self) -> ServiceProcess:
        """Read the process's stdout and stderr from now on, keeping their last lines.

        A process whose pipes nobody reads blocks in its next write once the pipe's
        buffer (64 KiB) is full: its logging is synchronous, so the whole process
        stops. A long test whose process may log a lot under load (warnings each
        round, a traceback each pass) drains it, and can show its last lines."""
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                threading.Thread(target=self._read, args=(stream,), daemon=True).start()
        return self

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.tail.append(line)
            self.drained_bytes[0] += len(line)

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
        ports = parse_listening(line)
        if ports is not None:
            return ServiceProcess(proc, ports.grpc_port, ports.metrics_port)
    proc.kill()
    _, err = proc.communicate(timeout=10)
    raise AssertionError(f"service {args} did not start: {err[-2000:]}")


def gone(pid: int) -> bool:
    """``pid`` is dead, or a zombie nobody has reaped yet (it holds no memory)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    # The command name is in parentheses and may hold spaces; the state follows the last ')'.
    return raw[raw.rfind(")") + 2 :].split()[0] == "Z"


def memory_scaler_args(db_url: str, *extra: str) -> list[str]:
    """The arguments of the production scaler with the in-memory coordinator and actuator
    (``python -m tide.services.testing.scaler``): decisions run their whole lifecycle at once."""
    return [
        "-m",
        "tide.services.testing.scaler",
        "--coordinator",
        "memory",
        "--actuator",
        "memory",
        "--db",
        db_url,
        *extra,
    ]


def start_memory_scaler(db_url: str, *extra: str) -> ServiceProcess:
    """That scaler, started on a free port."""
    return start_service(memory_scaler_args(db_url, "--listen", "127.0.0.1:0", *extra))
