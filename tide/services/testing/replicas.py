"""The command line of one scaler replica among several (``python -m
tide.services.testing.scaler``), for the benchmarks and tests that run replicas side by
side: the in-memory coordinator with its state in a file under ``tmp`` (the
coordinator outlives any replica), one store, an owner id, a port of its own.
"""

from __future__ import annotations

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
