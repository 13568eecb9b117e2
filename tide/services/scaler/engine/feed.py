"""The event feed: every decision event to the WatchDecisions streams (one bounded
queue per watcher) and to the observers (the Kubernetes Events); and the end of a job
that failed for good (its restart budget spent, issue 27) to the failure observers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from tide.services.scaler.store import DecisionRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Watched:
    decision: DecisionRecord
    detail: str


class DecisionFeed:
    """Fans each decision event out to the watchers of its job (or of every job).
    None in a queue ends that watch (the scaler stops, or the watcher fell behind)."""

    def __init__(self, max_queued: int = 1000) -> None:
        self.max_queued = max_queued
        self._watchers: list[tuple[str, asyncio.Queue[Watched | None]]] = []
        #: Told of every decision state (the Kubernetes Events); must not block.
        self.observers: list[Callable[[DecisionRecord, str], None]] = []
        #: Told once of each job the coordinator failed for good, with why; must not block.
        self.failure_observers: list[Callable[[str, str], None]] = []

    def subscribe(self, job_id: str) -> asyncio.Queue[Watched | None]:
        q: asyncio.Queue[Watched | None] = asyncio.Queue(maxsize=self.max_queued)
        self._watchers.append((job_id, q))
        return q

    def unsubscribe(self, q: asyncio.Queue[Watched | None]) -> None:
        self._watchers = [(j, w) for j, w in self._watchers if w is not q]

    def publish(self, d: DecisionRecord, detail: str) -> None:
        self._enqueue(d, detail)
        for observe in self.observers:
            try:
                observe(d, detail)
            except Exception:
                logger.exception(
                    "decision %d: an observer failed",
                    d.id,
                    extra={"job_id": d.job_id, "decision_id": d.id},
                )

    def job_failed(self, job_id: str, why: str) -> None:
        for observe in self.failure_observers:
            try:
                observe(job_id, why)
            except Exception:
                logger.exception(
                    "job %s: a failure observer failed", job_id, extra={"job_id": job_id}
                )

    def _enqueue(self, d: DecisionRecord, detail: str) -> None:
        for job_id, q in list(self._watchers):
            if job_id and job_id != d.job_id:
                continue
            try:
                q.put_nowait(Watched(d, detail))
            except asyncio.QueueFull:
                # A watcher that does not read must not hold memory or the loop.
                logger.warning(
                    "decision watcher fell behind; dropping it",
                    extra={"job_id": d.job_id, "decision_id": d.id},
                )
                self.unsubscribe(q)
                q.get_nowait()
                q.put_nowait(None)

    def close(self) -> None:
        for _, q in self._watchers:
            q.put_nowait(None)
