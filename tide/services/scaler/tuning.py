"""The scaler process's interpreter and collector tuning, in one place, applied once at
process start (:func:`tune_process`; the benchmarks that stand for a replica in their
own process call it too). Why each value is what it is, with the measurements:
docs/scaler.md, "Tuning".
"""

from __future__ import annotations

from tide.services.common.gil import SWITCH
from tide.services.common.heap import GC_THRESHOLDS, HeapFreezer, tune_collector

__all__ = [
    "GC_THRESHOLDS",
    "PASS_SLICES",
    "SWITCH_INTERVAL_S",
    "YIELD_EVERY_JOBS",
    "heap_freezer",
    "tune_process",
]

#: GIL switch interval while a unit of SQL work runs in a worker thread, seconds
#: (CPython's 5 ms otherwise: tide/services/common/gil.py).
SWITCH_INTERVAL_S = 0.0005

#: A pass over many jobs hands the event loop back every this many jobs, so that the
#: telemetry acks that arrive meanwhile do not wait for the whole pass.
YIELD_EVERY_JOBS = 64

#: The pass over every job is spread over the evaluation interval in up to this many
#: slices of at least YIELD_EVERY_JOBS jobs each (tide/services/scaler/engine/loop.py).
PASS_SLICES = 10


def tune_process() -> None:
    """The switch interval (short only while SQL runs) and the collector thresholds."""
    SWITCH.configure(SWITCH_INTERVAL_S)
    tune_collector(GC_THRESHOLDS)


def heap_freezer() -> HeapFreezer:
    """What freezes the long-lived heap as the fleet grows (tide/services/common/heap.py);
    a process's entry makes one, never a test (it would freeze pytest's heap)."""
    return HeapFreezer()
