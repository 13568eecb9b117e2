"""Loss accounting and reconcile: what the loop finds the parties did without a
decision of this scaler's.

- A generation that formed smaller with no decision in flight lost a member without
  notice: a MEMBER_LOST record with the steps it cost, so that the history holds
  every change of world size.
- A reconcile pass compares every idle job's recorded size with the actuator's
  replicas and the coordinator's world size, and corrects each drift through a
  recorded decision (tide/services/scaler/reconcile.py).
- The throughput each job trains at, once settled, for the goodput guard.
- A job the coordinator failed for good (its workers crashed at every start until the
  restart budget was spent): said once, to the log and the feed (a Kubernetes Event).
"""

from __future__ import annotations

import asyncio
import logging

from tide.services.scaler import policy as pol
from tide.services.scaler import reconcile
from tide.services.scaler.actuators import Actuator
from tide.services.scaler.coordination import CoordinatorClient, JobStatusView
from tide.services.scaler.engine.decisions import DecisionDriver
from tide.services.scaler.engine.feed import DecisionFeed
from tide.services.scaler.engine.jobs import JobBook
from tide.services.scaler.engine.ownership import Ownership
from tide.services.scaler.engine.pipeline import Pipeline
from tide.services.scaler.errors import DecisionInProgress
from tide.services.scaler.metrics import ScalerMetrics
from tide.services.scaler.reconcile import Drift

logger = logging.getLogger(__name__)

#: Jobs whose actuator and coordinator a reconcile pass asks at once.
RECONCILE_CONCURRENCY = 16


class Losses:
    def __init__(
        self,
        *,
        actuator: Actuator,
        coordinator: CoordinatorClient,
        book: JobBook,
        ownership: Ownership,
        driver: DecisionDriver,
        pipeline: Pipeline,
        metrics: ScalerMetrics,
        feed: DecisionFeed,
    ) -> None:
        self.actuator = actuator
        self.coordinator = coordinator
        self.book = book
        self.ownership = ownership
        self.driver = driver
        self.pipeline = pipeline
        self.metrics = metrics
        self.feed = feed
        #: The jobs whose failure was already said (once per job and process).
        self._failures_said: set[str] = set()
        #: Each job's lost_steps_total as last seen, to tell what a loss cost.
        self._lost_seen: dict[str, int] = {}

    def finished(self, job_id: str) -> bool:
        """The coordinator says every member finished its budget (or the job failed for
        good): no more resizes."""
        st = self.coordinator.latest_status(job_id)
        return st is not None and st.over

    def note_failure(self, job_id: str, st: JobStatusView) -> None:
        """Say once that the coordinator failed ``job_id`` for good, with its cause."""
        if not st.failure or job_id in self._failures_said:
            return
        self._failures_said.add(job_id)
        logger.warning(
            "job %s failed for good: %s",
            job_id,
            st.failure.splitlines()[0],
            extra={"job_id": job_id},
        )
        self.feed.job_failed(job_id, st.failure)

    def measure(self, job_id: str, now: float, status: JobStatusView) -> None:
        """The job's throughput at its size, once settled (the goodput guard's curve)."""
        job = self.book.jobs[job_id]
        if job_id not in self.book.active:
            ended = job.last_resize_ended_at.timestamp() if job.last_resize_ended_at else None
            self.book.throughput.settled(
                job_id, job.current_replicas, status.world_size, status.samples_per_s, ended, now
            )

    def may_have_lost(self, job_id: str, st: JobStatusView) -> bool:
        """Whether :meth:`record_loss` may find a loss: the coordinator's generation is
        newer than the job's and smaller (checked without the guard's cost, for every job)."""
        job = self.book.jobs[job_id]
        return job_id not in self._lost_seen or (
            st.generation > job.generation and 0 < st.world_size < job.current_replicas
        )

    async def record_loss(self, job_id: str) -> None:
        """A generation that formed smaller with no decision of ours in flight lost a
        member without notice: a MEMBER_LOST record, with the steps it cost."""
        job, st = self.book.jobs[job_id], self.coordinator.latest_status(job_id)
        if st is None:
            return
        seen = self._lost_seen.setdefault(job_id, st.lost_steps_total)
        if (
            job_id in self.book.active
            or st.finished
            or st.generation <= job.generation
            or not 0 < st.world_size < job.current_replicas
        ):
            return
        lost = max(0, st.lost_steps_total - seen)
        message = (
            f"{job.current_replicas - st.world_size} member(s) lost without notice;"
            f" generation {st.generation} re-formed with {st.world_size}, {lost} step(s) lost"
        )
        d = pol.Decision(
            job_id, pol.Reason.MEMBER_LOST, message, job.current_replicas, st.world_size
        )
        inputs = {"current_replicas": job.current_replicas, "lost_steps": lost}
        try:
            record = await self.driver.persist(d, inputs)
        except DecisionInProgress:
            return
        self._lost_seen[job_id] = st.lost_steps_total
        self.driver.track(record)
        self.driver.publish(record, message)
        logger.warning(
            "job %s: decision %d: %s",
            job_id,
            record.id,
            message,
            extra={"job_id": job_id, "decision_id": record.id},
        )
        await self.driver.controller.record_unplanned(
            record, generation=st.generation, lost_steps=lost, detail=message
        )

    async def reconcile(self) -> list[Drift]:
        """Compare every idle job's recorded size with the actuator's replicas and the
        coordinator's world size; correct each drift through a recorded decision.
        Returns the drifts found.

        The parties are asked for several jobs at once (a pass over a thousand jobs is
        a thousand reads of each): the evaluation loop waits for the pass."""
        self.metrics.reconcile_passes.inc()
        jobs, active = self.book.jobs, self.book.active
        idle = [
            (job_id, jobs[job_id])
            for job_id in jobs
            if self.ownership.acts_on(job_id) and job_id not in active and not self.finished(job_id)
        ]
        bound = asyncio.Semaphore(RECONCILE_CONCURRENCY)

        async def ask(job_id: str) -> reconcile.Observed:
            async with bound:
                return await reconcile.observe(job_id, self.actuator, self.coordinator)

        answers = await asyncio.gather(*(ask(j) for j, _ in idle), return_exceptions=True)
        found: list[Drift] = []
        for (job_id, seen), observed in zip(idle, answers, strict=True):
            with self.pipeline.guard(job_id):
                if isinstance(observed, BaseException):
                    raise observed
                # A decision started, or ended, while the parties were asked: the
                # answers may be from either side of it; the next pass asks again.
                if job_id in active or jobs.get(job_id) is not seen:
                    continue
                drift = reconcile.compare(
                    job_id,
                    seen.current_replicas,
                    seen.generation,
                    observed,
                    asked_replicas=self.book.asked.get(job_id),
                )
                if drift is None:
                    continue
                found.append(drift)
                for source in drift.sources:
                    self.metrics.drift.labels(source).inc()
                await self._correct(drift)
        self.metrics.drifting.set(len(found))
        return found

    async def _correct(self, drift: Drift) -> None:
        d = drift.decision()
        try:
            record = await self.driver.create(d, drift.inputs(), "")
        except DecisionInProgress:
            return  # a decision of its own started meanwhile: it sets the size
        logger.warning(
            "job %s: drift (%s): %s; decision %d",
            drift.job_id,
            ", ".join(drift.sources),
            d.message,
            record.id,
            extra={"job_id": drift.job_id, "decision_id": record.id},
        )
