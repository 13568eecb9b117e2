"""Garbage collection for a server whose heap is mostly long-lived.

CPython's full (generation 2) collection walks every object the collector tracks,
and a server that holds a large fleet (metric children per job, gRPC state per
stream, arrays per node) tracks a great many, nearly all as long-lived as the
fleet: each full pass stops the event loop.

:class:`HeapFreezer` moves what is alive into the permanent generation
(``gc.freeze``) each time the fleet has grown by a quarter since the last time, so
that the collector walks only what came since; the number of freezes is
logarithmic in the fleet's size. What it gives up: an object frozen while alive
that later becomes part of a reference cycle is never collected (reference
counting still frees everything that is not in a cycle), nor is cyclic garbage the
older generation held when it froze. Before each freeze only the young
generations are collected: a full collection first is the very pause this is for.

:func:`tune_collector` sets the collector's thresholds for such a heap, whose
short-lived objects (a stream's pending read) still reach the oldest generation.
What it gives up: cyclic garbage that reached the oldest generation waits for the
next full collection, at most GC_THRESHOLDS[2] young-generation collections away.

The scaler applies both from tide/services/scaler/tuning.py; the measurements behind
the values are in docs/scaler.md, "Tuning".
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)

#: gc.set_threshold for a server's long-lived heap (tune_collector): a young collection
#: every 5,000 net allocations, the middle generation every 20 of those, and a full
#: collection considered only every 1,000 middle-generation collections.
GC_THRESHOLDS = (5000, 20, 1000)

#: The fleet (jobs, nodes, streams) grows by this fraction before the next freeze.
GROWTH_FRACTION = 0.25
#: ...and by at least this many: a small fleet's heap is small anyway.
MIN_GROWTH = 64


def tune_collector(thresholds: tuple[int, int, int] = GC_THRESHOLDS) -> tuple[int, int, int]:
    """Set the collector's thresholds (see the module docstring); returns the old ones."""
    old = gc.get_threshold()
    gc.set_threshold(*thresholds)
    return old


class HeapFreezer:
    def __init__(
        self, growth_fraction: float = GROWTH_FRACTION, min_growth: int = MIN_GROWTH
    ) -> None:
        self.growth_fraction = growth_fraction
        self.min_growth = min_growth
        self.frozen_at = 0
        self.freezes = 0

    def grown(self, size: int) -> bool:
        """Freeze the heap if the fleet (``size``: its jobs, nodes and streams) grew
        enough since the last freeze; True when it did."""
        if size - self.frozen_at < max(self.min_growth, self.frozen_at * self.growth_fraction):
            return False
        gc.collect(1)
        gc.freeze()
        self.frozen_at = size
        self.freezes += 1
        logger.info(
            "heap frozen at a fleet of %d (%d objects permanent)", size, gc.get_freeze_count()
        )
        return True
