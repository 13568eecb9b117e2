"""Explicit state machines: one table type for every lifecycle in Tide.

The scaler's decisions, the coordinator's members and resizes, the launcher and
the agent each declare their legal edges once, as a :class:`TransitionTable`,
and move through :meth:`TransitionTable.check`. A move the table does not allow
is a bug in Tide, never a user's mistake or a race: races are caught before
(a version or epoch check raises ``Conflict``), so :class:`InvalidTransition`
maps to gRPC INTERNAL and is logged with its traceback.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Generic, TypeVar

S = TypeVar("S", bound=enum.Enum)


class InvalidTransition(Exception):
    """A lifecycle was asked to take an edge its table does not have: a bug.

    Deliberately not a TideError: the gRPC edge answers INTERNAL for it, and a
    client cannot fix it by changing its request."""


class TransitionTable(Generic[S]):
    """The legal edges of one lifecycle, keyed by state; states with no edges are final."""

    def __init__(self, name: str, edges: Mapping[S, Iterable[S]]) -> None:
        self.name = name
        self._edges: dict[S, frozenset[S]] = {k: frozenset(v) for k, v in edges.items()}
        states = {s for s in self._edges} | {t for v in self._edges.values() for t in v}
        if not states:
            raise ValueError(f"{name}: a lifecycle needs at least one state")
        kind = type(next(iter(states)))
        missing = [s for s in kind if s not in self._edges]
        if missing:
            # Every state must be listed, final ones with no edges, so the table is the whole story.
            raise ValueError(f"{name}: states without a row: {', '.join(m.name for m in missing)}")

    def allowed(self, old: S) -> frozenset[S]:
        return self._edges[old]

    def is_final(self, state: S) -> bool:
        return not self._edges[state]

    @property
    def final_states(self) -> frozenset[S]:
        return frozenset(s for s, v in self._edges.items() if not v)

    def edges(self) -> list[tuple[S, S]]:
        """Every legal (old, new) pair, for tests that walk the whole table."""
        return [(a, b) for a, targets in self._edges.items() for b in sorted(targets, key=str)]

    def check(self, old: S, new: S, *, what: str = "") -> S:
        """Return ``new`` if ``old → new`` is an edge, else raise :class:`InvalidTransition`."""
        if new not in self._edges[old]:
            subject = f" {what}" if what else ""
            raise InvalidTransition(
                f"{self.name}{subject}: {old.name} -> {new.name} is not an edge"
            )
        return new
