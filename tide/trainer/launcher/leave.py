"""SIGTERM to a trainer pod (eviction, graceful node shutdown, ``kubectl delete pod``)
becomes a coordinated leave (docs/preemption.md).

The launcher's heartbeats say ``leave_requested``; the scaler sees it on the member and
drains the pod like one on a noticed node, with the grace's end as the notice's deadline:
a checkpoint barrier, then DRAIN, on which the
launcher exits 0 through its ordinary path. If no DRAIN comes within ``leave_grace_s``
(no scaler, or one that cannot act in time), the launcher stops anyway, before the
kubelet's SIGKILL. A launcher that is in no generation (STANDBY) has nothing to lose and
stops at once; a second SIGTERM stops it at once too.
"""

from __future__ import annotations

import asyncio
import logging
import time

from tide.trainer.launcher.core import Launcher
from tide.trainer.launcher.model import State

logger = logging.getLogger(__name__)


class LeaveOnSigterm:
    """The SIGTERM handler of one launcher."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self._timer: asyncio.TimerHandle | None = None

    def __call__(self) -> None:
        la = self.launcher
        grace_s = la.s.leave_grace_s
        if grace_s <= 0 or la.leave_requested or la.state in (State.STANDBY, State.DONE):
            la.stop(0)
            return
        la.leave_requested = True
        # Sent with the request: the scaler plans the barrier within what is left.
        la.leave_deadline_s = time.time() + grace_s
        la.link.wake_heartbeat()
        logger.info(
            "launcher %s: SIGTERM; asking for a coordinated leave (stopping in %.1fs if no DRAIN)",
            la.s.pod_name,
            grace_s,
        )
        self._timer = asyncio.get_running_loop().call_later(grace_s, self._give_up)

    def _give_up(self) -> None:
        logger.warning(
            "launcher %s: no DRAIN within %.1fs of SIGTERM; stopping",
            self.launcher.s.pod_name,
            self.launcher.s.leave_grace_s,
        )
        self.launcher.stop(0)
