"""Jittered exponential backoff for every reconnect loop in Tide.

The agent's telemetry stream, the launcher's link to the coordinator and the
launcher's respawn of a dead prewarmed worker all wait with :class:`Backoff`.
These loops run for the life of the process and start over after a success,
which a retry decorator around one call (tenacity, stamina) does not model; the
bounded retry of a database unit of work does use tenacity (tide/services/store/db.py).
"""

from __future__ import annotations

import random

from tide.base.errors import ConfigError


class Backoff:
    """Delays grow as initial × 2^n up to ``max_s``; each delay is drawn from the
    upper half of that range ("equal jitter"), so a fleet of agents that lost the
    same scaler does not reconnect in lock step, and no delay collapses to zero."""

    def __init__(self, initial_s: float, max_s: float, rng: random.Random | None = None) -> None:
        if initial_s <= 0:
            raise ConfigError(f"backoff initial_s: must be > 0, got {initial_s!r}")
        if max_s < initial_s:
            raise ConfigError(f"backoff max_s: must be >= initial_s ({initial_s}), got {max_s!r}")
        self._initial_s = initial_s
        self._max_s = max_s
        self._rng = rng or random.Random()
        self._attempt = 0

    @property
    def attempt(self) -> int:
        return self._attempt

    def next_delay_s(self) -> float:
        ceiling = min(self._max_s, self._initial_s * (2.0 ** min(self._attempt, 60)))
        self._attempt += 1
        return ceiling / 2 + self._rng.uniform(0.0, ceiling / 2)

    def reset(self) -> None:
        self._attempt = 0
