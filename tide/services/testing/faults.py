"""Fault points for crash tests: SIGKILL this process when a named point is reached.

The scaler's controller calls its fault hook (tide.services.scaler.lifecycle.FaultHook)
at every lifecycle point; production passes none. The test entry point
(``python -m tide.services.testing.scaler``) passes a :class:`FaultPoint` armed from
TIDE_FAULT, e.g. ``decision:PREPARING`` (right after PREPARING is committed,
before its side effect) or ``decision:PREPARING+effect`` (right after the side
effect, before the next commit).
"""

from __future__ import annotations

import logging
import os
import signal

logger = logging.getLogger(__name__)

#: Environment variable that arms a fault point.
FAULT_ENV = "TIDE_FAULT"


class FaultPoint:
    """Kills this process with SIGKILL when the armed point is reached."""

    def __init__(self, armed: str | None = None) -> None:
        self.armed = armed if armed is not None else os.environ.get(FAULT_ENV, "")

    def __call__(self, point: str) -> None:
        if self.armed and point == self.armed:
            logger.error("fault point %s reached: SIGKILL", point)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
