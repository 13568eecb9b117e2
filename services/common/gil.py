"""The GIL switch interval of a process whose event loop shares the GIL with SQL threads.

A scaler replica runs its SQL in worker threads so that ingestion never waits on the
database. While the loop thread is busy, a worker that wants the GIL back waits up
to the switch interval (CPython's default 5 ms), and one transaction takes it back a
dozen times: at 5 ms, that wait, not the SQL, was most of a decision's latency under
load (bench/ingest). A short interval fixes that, but the loop thread then hands the
GIL over every 0.5 ms to whichever thread asks (gRPC's completion threads ask all the
time), each handover a context switch on the replica's core: at 5,000 agents, one
replica on one core spent 94-99 % of it with the short interval always on (three runs),
75-79 % with it on only while a transaction runs (two runs; bench.scale --sweep 5000,
docs/scaler.md).

:data:`SWITCH` is the process's one switch interval: :meth:`SwitchInterval.short`
holds it short while any unit of work runs, in any thread, and puts the normal one
back when the last ends. Nothing changes until :meth:`SwitchInterval.configure` is
called (the scaler's entry point and the benchmarks that stand for it do).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: CPython's own default, seconds.
DEFAULT_SWITCH_INTERVAL_S = 0.005


class SwitchInterval:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy = 0
        self._short_s: float | None = None
        self._normal_s = DEFAULT_SWITCH_INTERVAL_S

    def configure(self, short_s: float, normal_s: float = DEFAULT_SWITCH_INTERVAL_S) -> None:
        """Short while units run, normal otherwise; the normal one from now."""
        for name, v in (("short_s", short_s), ("normal_s", normal_s)):
            if not v > 0:
                raise ValueError(f"switch interval {name}={v!r}: must be > 0")
        with self._lock:
            self._short_s, self._normal_s = short_s, normal_s
            sys.setswitchinterval(short_s if self._busy else normal_s)

    @property
    def busy(self) -> int:
        """Units running now."""
        return self._busy

    @contextmanager
    def short(self) -> Iterator[None]:
        """The short interval while this block runs (and any other such block)."""
        with self._lock:
            self._busy += 1
            if self._busy == 1 and self._short_s is not None:
                sys.setswitchinterval(self._short_s)
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
                if self._busy == 0 and self._short_s is not None:
                    sys.setswitchinterval(self._normal_s)


SWITCH = SwitchInterval()
