"""The GIL switch interval of a process whose event loop shares the GIL with SQL threads.

A process that runs its SQL in worker threads (so that its event loop never waits
on the database) wants the GIL back in those threads quickly: while the loop thread
is busy, a worker waits up to the switch interval each time it wants the GIL, and a
transaction wants it many times. A short interval always on, though, has the loop
thread hand the GIL over to whichever thread asks (gRPC's completion threads ask all
the time), each handover a context switch.

:data:`SWITCH` is the process's one switch interval: :meth:`SwitchInterval.short`
holds it short while any unit of work runs, in any thread, and puts the normal one
back when the last ends. Nothing changes until :meth:`SwitchInterval.configure` is
called (tide/services/scaler/tuning.py; the measurements behind its value are in
docs/scaler.md, "Tuning").
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
