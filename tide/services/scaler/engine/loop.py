"""The control loop: a job is evaluated as soon as one of its buckets closes, every job
once per interval (the pass spread over the interval in slices), finished rollup
minutes flushed and the parties reconciled, until cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Mapping, Sequence

from tide.base.errors import Unavailable
from tide.services.common.clock import Clock
from tide.services.common.heap import HeapFreezer
from tide.services.scaler.coordination import CoordinatorClient
from tide.services.scaler.engine.jobs import JobBook
from tide.services.scaler.engine.losses import Losses
from tide.services.scaler.engine.ownership import Ownership
from tide.services.scaler.engine.pipeline import Pipeline
from tide.services.scaler.engine.wakeups import Wakeups
from tide.services.scaler.ingest import Ingest
from tide.services.scaler.metrics import ScalerMetrics
from tide.services.scaler.rollup_writer import RollupWriter
from tide.services.scaler.tuning import PASS_SLICES, YIELD_EVERY_JOBS
from tide.services.store.probe import StoreProbe

logger = logging.getLogger(__name__)

#: Seconds between two log lines about lost evaluation passes: an outage fails
#: every pass, and one line says as much as a hundred (the metric counts them all).
LOOP_LOG_EVERY_S = 10.0


class Loop:
    def __init__(
        self,
        *,
        clock: Clock,
        coordinator: CoordinatorClient,
        book: JobBook,
        ownership: Ownership,
        ingest: Ingest,
        pipeline: Pipeline,
        losses: Losses,
        rollups: RollupWriter,
        wakeups: Wakeups,
        metrics: ScalerMetrics,
        evaluate_interval_s: float,
        reconcile_interval_s: float,
        rollup_flush_interval_s: float,
        store_probe: StoreProbe | None = None,
        heap: HeapFreezer | None = None,
    ) -> None:
        self.clock = clock
        self.coordinator = coordinator
        self.book = book
        self.ownership = ownership
        self.ingest = ingest
        self.pipeline = pipeline
        self.losses = losses
        self.rollups = rollups
        self.wakeups = wakeups
        self.metrics = metrics
        self.evaluate_interval_s = evaluate_interval_s
        self.reconcile_interval_s = reconcile_interval_s
        self.rollup_flush_interval_s = rollup_flush_interval_s
        #: Whether the store answers (tide.services.store.probe): while it does not, no
        #: job is evaluated (nothing could be recorded, so nothing may be done).
        self.store_probe = store_probe
        #: Freezes the long-lived heap as the fleet grows (tide/services/scaler/tuning.py);
        #: the process's entry sets it, never a test (it would freeze pytest's heap).
        self.heap = heap
        self._loop_logged_s = -math.inf

    async def tick(self, some: Sequence[str] | None = None) -> None:
        """Evaluate every job (or ``some`` of them: one slice of the pass)."""
        now = self.clock.now()
        jobs_known, acts_on = self.book.jobs, self.ownership.acts_on
        if some is None:
            # The whole fleet counted once is cheaper than job by job.
            fresh: Mapping[str, int] | None = self.ingest.fresh_gpus(now)
            jobs = [j for j in jobs_known if acts_on(j)]
        else:
            fresh = None
            jobs = [j for j in some if j in jobs_known and acts_on(j)]
        running: list[tuple[str, float | None]] = []
        latest_status = self.coordinator.latest_status
        losses = self.losses
        for n, job_id in enumerate(jobs, 1):
            if n % YIELD_EVERY_JOBS == 0:
                await asyncio.sleep(0)
            # One status read per job and pass (three were a tenth of the pass).
            st = latest_status(job_id)
            if st is None:
                running.append((job_id, None))
                continue
            losses.measure(job_id, now, st)
            if losses.may_have_lost(job_id, st):
                with self.pipeline.guard(job_id):
                    await losses.record_loss(job_id)
            if not st.over:
                running.append((job_id, None))
            elif st.failure:
                losses.note_failure(job_id, st)
        await self.pipeline.evaluate_many(running, fresh, reuse=self.pipeline.reuse_answers)

    async def drain_triggers(self) -> None:
        """Evaluate the jobs whose window slid to meet their sustain condition, and those
        with a node notice, side by side (windows of many jobs slide together)."""
        due = self.wakeups.triggers.take(
            lambda j, t: self.ingest.window_view(j, t, 0, 0),
            self.book.policies,
            self.book.active,
            self.clock.now(),
        )
        due = [(j, t) for j, t in due if self.ownership.acts_on(j) and not self.losses.finished(j)]
        if due:
            await self.pipeline.evaluate_many(due)

    async def flush_rollups(self, *, final: bool = False) -> int:
        """Finished minutes of every known job to SQL, then retention (rollup_writer.py)."""
        replicas = {j: r.current_replicas for j, r in self.book.jobs.items()}
        return await self.rollups.flush(replicas, final=final)

    async def run(self) -> None:
        """Until cancelled: triggers as they come, the pass in slices, flushes and
        reconcile passes on their intervals."""
        wake = self.wakeups.event
        next_tick = self.clock.monotonic()
        round_start = next_tick
        order: list[str] = []  # this round's jobs, PASS_SLICES to a round
        slices = 1
        k = 0  # the next slice of the round
        next_flush = next_tick + self.rollup_flush_interval_s
        # At once: this runs at start and each time this replica takes the lead.
        next_reconcile = next_tick
        while True:
            timeout = max(0.0, next_tick - self.clock.monotonic())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout)
            wake.clear()
            mono = self.clock.monotonic()
            if self.store_probe is not None and not self.store_probe.ok:
                # Triggers wait in their queue and unwritten minutes in memory;
                # both are taken up on the first pass after the store is back.
                next_tick = mono + self.evaluate_interval_s
                self._failed("store unavailable; not evaluating", None)
                continue
            try:
                if self.wakeups.triggers:
                    await self.drain_triggers()
                if mono >= next_tick:
                    if k == 0:
                        round_start = mono
                        order = [j for j in self.book.jobs if self.ownership.acts_on(j)]
                        slices = max(1, min(PASS_SLICES, len(order) // YIELD_EVERY_JOBS))
                    if slices == 1:
                        await self.tick()
                    else:
                        per = -(-len(order) // slices)
                        await self.tick(order[k * per : (k + 1) * per])
                    k = (k + 1) % slices
                    next_tick = round_start + (k or slices) * self.evaluate_interval_s / slices
                    if k == 0 and self.heap is not None:
                        ingest = self.ingest
                        self.heap.grown(
                            len(self.book.jobs) + len(ingest.nodes) + ingest.streams_open
                        )
                if mono >= next_flush:
                    await self.flush_rollups()
                    next_flush = mono + self.rollup_flush_interval_s
                if mono >= next_reconcile:
                    next_reconcile = mono + self.reconcile_interval_s
                    await self.losses.reconcile()
            except Unavailable as exc:
                # The store (or the coordinator) went away mid-pass: this pass is
                # lost, the loop is not. Ended once, it would decide nothing more
                # while the process kept serving (reliability catalog, T03).
                next_tick = mono + self.evaluate_interval_s
                self._failed("evaluation pass failed", exc)

    def _failed(self, what: str, exc: BaseException | None) -> None:
        """A line at most every LOOP_LOG_EVERY_S, however often the loop fails."""
        self.metrics.loop_failures.inc()
        mono = self.clock.monotonic()
        if mono - self._loop_logged_s < LOOP_LOG_EVERY_S:
            return
        self._loop_logged_s = mono
        logger.warning("%s%s", what, f": {exc}" if exc is not None else "")
