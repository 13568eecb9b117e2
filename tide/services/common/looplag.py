"""How late the event loop runs: ``tide_event_loop_lag_seconds``, for every service.

A service answers health checks, heartbeats and streams on one asyncio loop; anything
that blocks it (a ``time.sleep``, a database call made on the loop) silences all of
them at once, and a liveness probe that goes unanswered restarts a healthy process.
The probe sleeps :data:`PROBE_INTERVAL_S` again and again and measures how much later
than asked it wakes: that lateness is the time the loop could not run anything.

The gauge holds the worst lateness of the last one to two windows
(:data:`WINDOW_S`), so that a scrape every 15 s still sees a stall of a tenth of a
second between two scrapes. :func:`tide.services.common.server.serve` runs the probe in
every service; the alert TideEventLoopLag (deploy/observability/tide.rules.yaml)
watches it.

A loop is late for one of two causes: code on it blocked it (a bug in the service: a
WARNING), or the process was runnable and waited for a CPU (the machine has more
runnable work than cores: its own state, logged at INFO; the gauge and the alert count
it all the same). Linux tells the two apart: ``/proc/thread-self/schedstat`` counts the
time the loop's thread waited on a run queue. On a shared 2-core machine at load 10-20,
every service of a healthy `tide up` logged "blocked" a few times per run (issue 32).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Final

from prometheus_client import Gauge

from tide.base.cpuwait import CpuWait

logger = logging.getLogger(__name__)

#: Seconds between two wake-ups of the probe: short enough to see a 100 ms stall,
#: cheap (one timer per 50 ms).
PROBE_INTERVAL_S: Final = 0.05
#: Seconds of each window the gauge's maximum covers.
WINDOW_S: Final = 10.0
#: A stall this long (seconds) is logged, at most once per window.
LOG_STALL_S: Final = 0.5

LAG = Gauge(
    "tide_event_loop_lag_seconds",
    "The longest the event loop could not run anything (how late a timer fired), over"
    " the last 10 to 20 s.",
)


class LoopLag:
    """The lateness measured so far: the worst of the window running and of the last."""

    def __init__(self, window_s: float = WINDOW_S, gauge: Gauge = LAG) -> None:
        self._window_s = window_s
        self._gauge = gauge
        self._started = time.monotonic()
        self._current = 0.0
        self._previous = 0.0
        self._logged_at = float("-inf")

    @property
    def worst_s(self) -> float:
        return max(self._current, self._previous)

    def record(self, lag_s: float, now: float, cpu_wait_s: float = 0.0) -> None:
        """``lag_s`` late at ``now``, ``cpu_wait_s`` of it spent waiting for a CPU."""
        if now - self._started >= self._window_s:
            self._previous, self._current, self._started = self._current, 0.0, now
        self._current = max(self._current, lag_s)
        self._gauge.set(self.worst_s)
        if lag_s >= LOG_STALL_S and now - self._logged_at >= self._window_s:
            self._logged_at = now
            if lag_s - cpu_wait_s >= LOG_STALL_S:
                logger.warning(
                    "the event loop was blocked for %.2f s: health checks and heartbeats waited",
                    lag_s,
                )
            else:
                logger.info(
                    "the event loop ran %.2f s late, %.2f s of it waiting for a CPU (more"
                    " runnable work than cores): health checks and heartbeats waited",
                    lag_s,
                    cpu_wait_s,
                )


async def watch_loop_lag(interval_s: float = PROBE_INTERVAL_S, lag: LoopLag | None = None) -> None:
    """Measure the loop's lateness until cancelled."""
    lag = lag or LoopLag()
    # Opened here, on the loop's thread: thread-self is the thread that opens it.
    cpu = CpuWait()
    try:
        while True:
            asked, waited = time.monotonic(), cpu.seconds()
            await asyncio.sleep(interval_s)
            now = time.monotonic()
            lag.record(max(0.0, now - asked - interval_s), now, cpu.seconds() - waited)
    finally:
        cpu.close()
