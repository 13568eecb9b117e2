"""The decision lifecycle driver: a decision is written PENDING, handed to the
controller (tide/services/scaler/controller.py), published as each state commits, and
mirrored into the job book when final. A preemption that cannot wait aborts the
decision in flight here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from tide.base.errors import NotFound, TideError
from tide.base.retry import Backoff
from tide.services.common import tracing
from tide.services.common.clock import Clock
from tide.services.scaler import policy as pol
from tide.services.scaler.actuators import Actuator
from tide.services.scaler.controller import Controller
from tide.services.scaler.coordination import CoordinatorClient
from tide.services.scaler.engine.feed import DecisionFeed
from tide.services.scaler.engine.jobs import JobBook
from tide.services.scaler.engine.wakeups import Wakeups
from tide.services.scaler.lifecycle import FaultHook
from tide.services.scaler.metrics import ScalerMetrics
from tide.services.scaler.pool import PoolClaims
from tide.services.scaler.store import DecisionRecord, DecisionState, DecisionStore

logger = logging.getLogger(__name__)


def create_kwargs(d: pol.Decision, inputs: dict[str, Any], requested_by: str) -> dict[str, Any]:
    """``DecisionStore.create``'s arguments for ``d``."""
    return {
        "job_id": d.job_id,
        "from_replicas": d.from_replicas,
        "to_replicas": d.to_replicas,
        "reason": d.reason.name,
        "trigger": d.trigger.name,
        "message": d.message,
        "inputs": inputs,
        "requested_by": requested_by,
    }


class DecisionDriver:
    def __init__(
        self,
        *,
        store: DecisionStore,
        actuator: Actuator,
        coordinator: CoordinatorClient,
        clock: Clock,
        book: JobBook,
        pool: PoolClaims,
        feed: DecisionFeed,
        wakeups: Wakeups,
        metrics: ScalerMetrics,
        fault: FaultHook | None = None,
        wait_store: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.store = store
        self.coordinator = coordinator
        self.clock = clock
        self.book = book
        self.pool = pool
        self.feed = feed
        self.wakeups = wakeups
        self.metrics = metrics
        self.controller = Controller(
            store,
            actuator,
            coordinator,
            clock,
            fault=fault,
            on_event=self.publish,
            on_final=self.finished,
            wait_store=wait_store,
        )
        #: Decisions in flight that a preemption asked the coordinator to abort.
        self._superseded: set[int] = set()
        self._background: set[asyncio.Task[None]] = set()

    async def persist(
        self, d: pol.Decision, inputs: dict[str, Any], requested_by: str = ""
    ) -> DecisionRecord:
        """Write ``d`` as a PENDING decision (DecisionInProgress: the job has one)."""
        return await self.store.create(**create_kwargs(d, inputs, requested_by))

    async def persist_many(
        self, writes: Sequence[tuple[pol.Decision, dict[str, Any]]]
    ) -> Sequence[DecisionRecord | TideError]:
        """Every decision of ``writes`` in one transaction (``DecisionStore.create_many``)."""
        return await self.store.create_many([create_kwargs(d, i, "") for d, i in writes])

    async def create(
        self,
        d: pol.Decision,
        inputs: dict[str, Any],
        requested_by: str,
        *,
        started_s: float | None = None,
    ) -> DecisionRecord:
        record = await self.persist(d, inputs, requested_by)
        self.launch(record, d.message, started_s=started_s)
        return record

    def track(self, record: DecisionRecord) -> None:
        self.book.track(record)

    def launch(
        self, record: DecisionRecord, message: str, *, started_s: float | None = None
    ) -> None:
        """Hand a committed PENDING decision to the controller (its trace starts at
        ``started_s``, the tipping sample, when the policy made it)."""
        self.book.track(record)
        self.publish(record, message)
        self.controller.fault("decision:PENDING")
        self.controller.start(
            record, deadline_s=self.book.deadline_of(record.job_id), started_s=started_s
        )

    def publish(self, d: DecisionRecord, detail: str) -> None:
        if d.state is not DecisionState.PENDING:
            self.pool.fulfilled(d.job_id)  # the actuator counts its GPUs from PREPARING on
        self.feed.publish(d, detail)

    def finished(self, d: DecisionRecord) -> None:
        self._superseded.discard(d.id)
        self.book.finished(d)

    def trace_evaluation(self, decision_id: int, stages: tuple[tuple[float, float], ...]) -> None:
        """The decision's first spans, after the fact: the tipping sample's way to the
        scaler, its wait for the loop, and the evaluation up to the commit."""
        root = self.controller.spans.get(decision_id)
        if root is None:
            return
        for name, (start, end) in zip(("transport", "queue", "evaluate"), stages, strict=True):
            span = tracing.start_span(f"tide.{name}", parent=root, start_ns=int(start * 1e9))
            span.end(end_time=int(max(start, end) * 1e9))

    def supersede(self, job_id: str, decision_id: int, message: str) -> None:
        """A preemption cannot wait for the decision in flight: it is aborted (its record
        ends ABORTED with this reason in its history), and the job is evaluated again the
        moment it is final, when the preemption goes ahead alone."""
        if decision_id in self._superseded:
            return
        self._superseded.add(decision_id)
        logger.warning(
            "job %s: decision %d superseded: %s",
            job_id,
            decision_id,
            message,
            extra={"job_id": job_id, "decision_id": decision_id},
        )
        reason = f"superseded by a node termination: {message}"
        # Before Resize (a grow still starting its pods) the controller ends it itself.
        self.controller.superseded[decision_id] = reason
        task = self.controller.tasks.get(decision_id)
        t = asyncio.create_task(
            self._abort_then_evaluate(job_id, decision_id, reason, task),
            name=f"supersede-{decision_id}",
        )
        self._background.add(t)
        t.add_done_callback(self._background.discard)

    async def _abort_then_evaluate(
        self,
        job_id: str,
        decision_id: int,
        reason: str,
        task: asyncio.Task[DecisionRecord | None] | None,
    ) -> None:
        backoff = Backoff(0.1, 1.0)
        # NotFound: the coordinator has not seen the Resize yet; it may be on its way,
        # so the abort is asked again until the decision is final.
        while task is not None and not task.done():
            try:
                await self.coordinator.abort_resize(decision_id, job_id, reason)
                break
            except NotFound:
                pass
            except TideError as exc:
                # The decision runs its course; the preemption follows it.
                logger.warning(
                    "job %s: could not abort decision %d: %s",
                    job_id,
                    decision_id,
                    exc,
                    extra={"job_id": job_id, "decision_id": decision_id},
                )
                break
            await asyncio.wait({task}, timeout=backoff.next_delay_s())
        if task is not None:
            with contextlib.suppress(BaseException):
                await asyncio.shield(task)
        self.controller.superseded.pop(decision_id, None)
        self.wakeups.noticed(job_id)

    async def cancel(self, job_ids: Sequence[str]) -> None:
        """Cancel and await the decisions in flight of ``job_ids`` (their new owner
        resumes them from the store)."""
        tasks = []
        for job_id in job_ids:
            did = self.book.active.get(job_id)
            task = self.controller.tasks.get(did) if did is not None else None
            if task is not None and not task.done():
                task.cancel()
                tasks.append(task)
            self.book.forget_recommendations(job_id)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        for t in list(self._background):
            t.cancel()
        await self.controller.close()
