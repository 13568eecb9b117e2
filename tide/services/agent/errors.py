"""The agent's errors: subclasses of tide.base.errors, so every layer reads them alike."""

from __future__ import annotations

from tide.base.errors import Unavailable


class SourceError(Unavailable):
    """The source cannot produce readings at all (NVML missing, trace unreadable).

    An environment problem, not a bug: the agent logs one line and exits 1."""
