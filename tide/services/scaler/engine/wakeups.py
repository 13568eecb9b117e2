"""What wakes the loop between its passes: a slot opened in a job's window, a node
notice, a preemption that may now go ahead. Each is noted in :class:`Triggers` and
sets one event the loop waits on."""

from __future__ import annotations

import asyncio
from collections.abc import Container

from tide.services.common.clock import Clock
from tide.services.scaler.engine.ownership import Ownership
from tide.services.scaler.triggers import Triggers


class Wakeups:
    def __init__(self, clock: Clock, ownership: Ownership, known: Container[str]) -> None:
        self.clock = clock
        self.ownership = ownership
        self.known = known
        self.triggers = Triggers()
        self.event = asyncio.Event()

    def slot_opened(self, job_id: str, t: float) -> None:
        if job_id in self.known and self.ownership.acts_on(job_id):
            self.triggers.slot_opened(job_id, t, self.clock.now())
            self.event.set()

    def noticed(self, job_id: str) -> None:
        if job_id in self.known and self.ownership.acts_on(job_id):
            self.triggers.noticed(job_id, self.clock.now())
            self.event.set()

    def wake(self) -> None:
        """Evaluate on the next pass, not a tick later."""
        self.event.set()
