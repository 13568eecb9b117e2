"""Ports for processes that must be told theirs before they start (a gloo master, a service
given a fixed ``--listen``), on one host shared by parallel test workers and benchmarks.

A port probed with ``bind(("127.0.0.1", 0))`` comes from the kernel's ephemeral range, the
range every outgoing connection also takes its local port from, and between the probe and
the process's own bind anyone may take it. Under ``-n 4`` that happened (docs/reliability.md,
"Flakes"): a gloo master's port was taken by another test's socket, the master's TCPStore
failed to bind and aborted, and its two peers, connected to the foreign listener, hung. So
these ports come from below the ephemeral range (which the kernel never hands out on its
own) and are handed out in turn by one counter shared by every process of the host, each
checked free before it is given: two callers never get the same port while the range lasts.
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from pathlib import Path

# Below Linux's default ephemeral range (32768-60999) and below the range launchers pick
# their rendezvous port from (tide/trainer/launcher/link.py, 20000 up): disjoint from both.
FIRST_PORT = 10_000
END_PORT = 20_000
_COUNTER = Path(tempfile.gettempdir()) / f"tide-test-ports.{os.getuid()}"


def free_port() -> int:
    """A port no other caller on this host was given recently and that is free now."""
    with open(_COUNTER, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        raw = f.read().strip()
        at = int(raw) if raw.isdigit() else 0
        for _ in range(END_PORT - FIRST_PORT):
            port = FIRST_PORT + at % (END_PORT - FIRST_PORT)
            at += 1
            if _bindable(port):
                break
        else:
            raise RuntimeError(f"no free port in {FIRST_PORT}..{END_PORT - 1}")
        f.seek(0)
        f.truncate()
        f.write(str(at % (END_PORT - FIRST_PORT)).encode())
        return port


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
