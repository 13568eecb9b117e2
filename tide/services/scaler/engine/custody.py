"""How jobs come into this replica's hands and leave them: loaded at start (or, as a
follower, watched for the read API), taken with a shard and dropped with it, made
or changed through the API, and what other replicas ship of the jobs held here.

Taking a job is a new owner epoch in the store (whatever the last owner still
writes is refused), what its last resize tells the policy read back, and its
decisions that are not final resumed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from tide.base.errors import InvalidArgument
from tide.services.common.clock import Clock
from tide.services.scaler import policy as pol
from tide.services.scaler.actuators import Actuator
from tide.services.scaler.engine.decisions import DecisionDriver
from tide.services.scaler.engine.jobs import JobBook
from tide.services.scaler.engine.ownership import Ownership
from tide.services.scaler.engine.wakeups import Wakeups
from tide.services.scaler.ingest import Ingest
from tide.services.scaler.members import CoordinatorMemberRegistry
from tide.services.scaler.metrics import ScalerMetrics
from tide.services.scaler.partials import JobPartial, NodeNotice
from tide.services.scaler.store import DecisionStore, JobRecord

logger = logging.getLogger(__name__)

#: Jobs a starting scaler takes (and reads the last resize of) per transaction: with
#: 1,000 jobs, 1,000 acquire transactions and as many reads were most of the start-up.
START_BATCH = 200


class Custody:
    def __init__(
        self,
        *,
        store: DecisionStore,
        actuator: Actuator,
        clock: Clock,
        book: JobBook,
        ownership: Ownership,
        ingest: Ingest,
        members: CoordinatorMemberRegistry,
        driver: DecisionDriver,
        wakeups: Wakeups,
        metrics: ScalerMetrics,
    ) -> None:
        self.store = store
        self.actuator = actuator
        self.clock = clock
        self.book = book
        self.ownership = ownership
        self.ingest = ingest
        self.members = members
        self.driver = driver
        self.wakeups = wakeups
        self.metrics = metrics

    def know(self, job: JobRecord) -> None:
        """Hold ``job`` as the store has it: its policy, its windows' shape, its members
        watched (so telemetry is attributed to it), its metrics. Nothing acts on it."""
        if self.book.know(job):
            self.ingest.reshape(job.job_id)
        self.members.track(job.job_id)

    def adopt(self, job: JobRecord) -> None:
        """Hold ``job`` and tell the actuator its size: this replica acts on it."""
        self.know(job)
        self.actuator.adopt(
            job.job_id, replicas=job.current_replicas, gpus_per_replica=job.gpus_per_replica
        )

    async def follow(self) -> None:
        """A follower's view: every job and the decisions in flight as the store has
        them, and each job's members watched so the telemetry it ingests fills warm
        windows. It takes no job and tells the actuator nothing."""
        jobs = await self.store.list_jobs()
        in_flight = await self.store.non_final()
        for job in jobs:
            self.know(job)
        self.book.active.clear()
        self.book.active.update((d.job_id, d.id) for d in in_flight)

    async def start(self) -> None:
        """Load jobs, take every one of them and resume every decision that is not final."""
        await self.store.warm_up()
        # What a follower saw in flight may have ended since: the store says what is.
        self.book.active.clear()
        jobs = await self.store.list_jobs()
        for job in jobs:
            self.adopt(job)
        await self._acquire([j.job_id for j in jobs])
        for d in await self.store.non_final():
            self.driver.track(d)
        await self.driver.controller.recover(self.book.deadline_of)

    async def _acquire(self, job_ids: Sequence[str]) -> None:
        """A new owner epoch for each job, and what its last resize tells the policy."""
        for i in range(0, len(job_ids), START_BATCH):
            batch = list(job_ids[i : i + START_BATCH])
            await self.store.acquire_many(batch)
            for job_id, last in (await self.store.last_completed_many(batch)).items():
                self.book.restore_last(job_id, last)

    async def refresh(self) -> list[str]:
        """Jobs as the store has them, for those this replica does not act on (another
        replica writes them); returns the jobs new here. The ones it acts on are its own
        writes, already mirrored."""
        acts_on, active = self.ownership.acts_on, self.book.active
        jobs = await self.store.list_jobs()
        in_flight = await self.store.non_final()
        new = [j.job_id for j in jobs if j.job_id not in self.book.jobs]
        for job in jobs:
            if job.job_id not in self.book.jobs or not acts_on(job.job_id):
                self.know(job)
        for job_id in [j for j in active if not acts_on(j)]:
            del active[job_id]
        active.update((d.job_id, d.id) for d in in_flight if not acts_on(d.job_id))
        return new

    async def take(self, job_ids: Sequence[str]) -> None:
        """Act on ``job_ids`` from now on (their shard was gained): take each, and resume
        its decisions that are not final."""
        job_ids = [j for j in job_ids if j in self.book.jobs]
        if not job_ids:
            return
        await self._acquire(job_ids)
        taken = set(job_ids)
        for job_id in taken:
            self.book.active.pop(job_id, None)
        self.ownership.took(taken)
        # The jobs as they stand after the last owner's writes (its epoch is now refused).
        for job in await self.store.list_jobs():
            if job.job_id in taken:
                self.adopt(job)
        for d in await self.store.non_final():
            if d.job_id not in taken:
                continue
            self.driver.track(d)
            logger.info(
                "resuming decision %d of job %s from %s (shard taken)",
                d.id,
                d.job_id,
                d.state.value,
                extra={"job_id": d.job_id, "decision_id": d.id},
            )
            self.driver.controller.start(d, deadline_s=self.book.deadline_of(d.job_id), armed=False)
        self.wakeups.wake()

    async def drop(self, job_ids: Sequence[str]) -> None:
        """Stop acting on ``job_ids`` (their shard is given up or lost): their decisions in
        flight here are cancelled and awaited; the new owner resumes them from the store."""
        self.ownership.dropped(job_ids)
        await self.driver.cancel(job_ids)

    def accept_partials(self, parts: Sequence[JobPartial]) -> list[JobPartial]:
        """The partials of jobs kept here (``Ownership.accepts``); the others are refused,
        and their sender ships them to the new owner next."""
        return [p for p in parts if self.ownership.accepts(p.job_id)]

    def receive_notices(self, notices: Sequence[NodeNotice]) -> tuple[int, int]:
        """Another replica's node notices: those of jobs acted on here are applied as this
        replica's own agent streams' are (docs/preemption.md), a resent one once. Returns
        (applied, refused); the refused are resent to the job's new owner."""
        ours = [n for n in notices if self.ownership.acts_on(n.job_id)]
        applied, duplicate = self.ingest.merge_notices(ours)
        m = self.metrics.notices_received
        m.labels("applied").inc(applied)
        m.labels("duplicate").inc(duplicate)
        m.labels("refused").inc(len(notices) - len(ours))
        return applied, len(notices) - len(ours)

    async def upsert(
        self,
        job_id: str,
        overrides: Mapping[str, Any],
        *,
        initial_replicas: int = 0,
        gpus_per_replica: int = 0,
        clear: Sequence[str] = (),
    ) -> JobRecord:
        """Create or update a job; ``clear`` names overrides to remove (back to the default)."""
        self.ownership.require(job_id)
        existing = self.book.jobs.get(job_id)
        # Validated in full before anything is written; ConfigError names the field.
        merged, rest = self.book.merged_policy(job_id, overrides, clear)
        if existing is None and initial_replicas > 0:
            started = await self._start_job(
                job_id, merged, rest, initial_replicas, gpus_per_replica or None
            )
            if started is not None:
                return started
        job = await self.store.upsert_job(
            job_id,
            min_replicas=merged.min_replicas,
            max_replicas=merged.max_replicas,
            initial_replicas=initial_replicas or None,
            gpus_per_replica=gpus_per_replica or None,
            # A key mapped to None is removed from the stored overrides.
            policy_overrides={**{k: None for k in clear if k not in rest}, **rest},
        )
        self.adopt(job)
        if self.ownership.must_take(job_id, self.store.epochs):
            await self.store.acquire(job_id)
        self.ownership.took([job_id])
        return self.book.jobs[job_id]

    async def _start_job(
        self,
        job_id: str,
        p: pol.PolicySettings,
        overrides: Mapping[str, Any],
        replicas: int,
        gpus_per_replica: int | None,
    ) -> JobRecord | None:
        """A new job asked to start at ``replicas``: the JOB_STARTED decision 0 -> replicas,
        carried out like a grow (pods first, then the coordinator forms generation 1).
        None when the job turned out to exist already (another scaler made it)."""
        if not p.min_replicas <= replicas <= p.max_replicas:
            # The store checks it too; here the message names the request's field.
            raise InvalidArgument(
                f"initial_replicas={replicas}: must be within [{p.min_replicas}, {p.max_replicas}]"
            )
        free = await self.actuator.free_gpus()
        message = f"new job: start {replicas} replica(s) and form its first generation"
        inputs: dict[str, Any] = {
            "policy": dataclasses.asdict(p),
            "current_replicas": 0,
            "free_gpus": -1 if free is None else free,
            "raw_target_replicas": replicas,
        }
        started = await self.store.create_started_job(
            job_id,
            min_replicas=p.min_replicas,
            max_replicas=p.max_replicas,
            initial_replicas=replicas,
            gpus_per_replica=gpus_per_replica,
            policy_overrides=overrides,
            message=message,
            inputs=inputs,
        )
        if started is None:
            return None
        job, record = started
        self.adopt(job)
        self.ownership.took([job_id])
        self.driver.launch(record, message)
        logger.info(
            "job %s: decision %d: %s",
            job_id,
            record.id,
            message,
            extra={"job_id": job_id, "decision_id": record.id},
        )
        return self.book.jobs[job_id]

    async def set_autoscaling(self, job_id: str, paused: bool, reason: str) -> JobRecord:
        self.ownership.require(job_id)
        self.book.get(job_id)
        job = await self.store.set_paused(job_id, paused, reason)
        self.adopt(job)
        return job
