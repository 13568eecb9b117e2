"""Replicas side by side, for the benchmarks and tests that run them: the command line
of one scaler replica among several (``python -m tide.services.testing.scaler``: the
in-memory coordinator with its state in a file under ``tmp``, as the coordinator
outlives any replica; one store, an owner id, a port of its own), and the pause of a
leader that its store can survive.
"""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import time
from pathlib import Path


def replica_args(
    tmp: Path, owner: str, db: str, *extra: str, actuator: str | None = None
) -> list[str]:
    """The interpreter arguments of replica ``owner`` on store ``db``; the actuator is
    ``file:`` a log under ``tmp`` that every replica shares unless ``actuator`` names
    another; ``extra`` holds what the caller's run is about (election, lease, policy)."""
    return [
        "-m",
        "tide.services.testing.scaler",
        "--coordinator",
        "memory",
        "--coordinator-state-file",
        str(tmp / "coordinator.json"),
        "--actuator",
        actuator if actuator is not None else f"file:{tmp / 'actuator.jsonl'}",
        "--db",
        db,
        "--listen",
        "127.0.0.1:0",
        "--insecure",
        "--owner-id",
        owner,
        *extra,
        "--log-level",
        "WARNING",
    ]


def pause_outside_a_write(proc: subprocess.Popen[str], db_url: str) -> None:
    """SIGSTOP ``proc``, a replica on store ``db_url``; on SQLite, at a moment it holds
    no write lock.

    A SQLite writer paused inside its transaction keeps the file's write lock until it
    runs again, so no standby can take the lease meanwhile: nothing ends a paused
    process's lock, unlike PostgreSQL's idle_in_transaction_session_timeout
    (docs/coordinator.md, Standby replicas). That pause is one SQLite cannot survive,
    so on SQLite the leader is paused between its writes; on PostgreSQL, anywhere.
    """
    if not db_url.startswith("sqlite:///"):
        proc.send_signal(signal.SIGSTOP)
        return
    path = db_url.removeprefix("sqlite:///")
    for _ in range(50):
        proc.send_signal(signal.SIGSTOP)
        probe = sqlite3.connect(path, timeout=0.2, isolation_level=None)
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.execute("ROLLBACK")
            return
        except sqlite3.OperationalError:
            proc.send_signal(signal.SIGCONT)  # paused mid-write: let it finish
            time.sleep(0.05)
        finally:
            probe.close()
    raise AssertionError("the leader held the SQLite write lock at 50 pauses in a row")
