"""Garbage collection for a server whose heap is mostly long-lived.

CPython's full (generation 2) collection walks every object the collector tracks.
A scaler replica holding 500 jobs and 2,000 agent streams tracks a few hundred
thousand (per-job metric children, per-stream gRPC state, per-node arrays), nearly
all of which live as long as the fleet does, and a full pass over them took
130–260 ms on the project machine, five times in 45 s (bench.scale, gc callbacks):
the event loop writes no ack meanwhile, and the ack p99 is those pauses.

:class:`HeapFreezer` moves what is alive into the permanent generation
(``gc.freeze``) each time the fleet has grown by a quarter since the last time, so
that the collector walks only what came since. The number of freezes is logarithmic
in the fleet's size. What it gives up: an object frozen while alive that later
becomes part of a reference cycle is never collected (reference counting still
frees everything that is not in a cycle), nor is cyclic garbage the older
generation held when it froze. Before each freeze only the young generations are
collected: a full collection first took 2.2 s at 1,200 agents (the whole heap,
imports included), the very pause this is for.

:func:`tune_collector` sets the collector's thresholds for such a heap. Frozen, the
heap still churns: every telemetry stream's pending read (a coroutine, futures, gRPC's
operation objects) lives about a second, long enough to be promoted to the oldest
generation, where CPython's default thresholds (700, 10, 10) ran a full collection
every few seconds at 5,000 agents, 120-230 ms each, and young collections of 10-65 ms
a few times a second (timed with gc.callbacks in the replica): the ack p99 was those
pauses (121.7 ms, against 6.8 and 30.0 ms in two runs with the thresholds below;
bench.scale --sweep 5000 --resizing-every 0, docs/scaler.md). What
it gives up: cyclic garbage that reached the oldest generation waits for the next full
collection, at most GC_THRESHOLDS[2] young-generation collections away (minutes at
that rate, sooner on a quieter replica); reference counting frees everything else at
once.
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
