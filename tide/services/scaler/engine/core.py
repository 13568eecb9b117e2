"""The scaler's control loop put together: ingestion feeds windows, a closed bucket
wakes the policy, a resize becomes a committed decision, the controller carries it out.

:class:`ScalerCore` wires the rooms of this package and is what the gRPC servicers
call:

- ``jobs.py``: the job registry (:class:`JobBook`), pure memory;
- ``ownership.py``: which jobs this replica acts on (alone, elected or sharded);
- ``custody.py``: jobs loaded, taken, dropped, made and changed;
- ``pipeline.py``: the evaluation pipeline (stage, arbitrate, commit);
- ``decisions.py``: the decision lifecycle driver over the controller;
- ``losses.py``: loss accounting and reconcile;
- ``feed.py``: the event feed; ``wakeups.py``: what wakes the loop;
- ``loop.py``: the loop itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tide.services.common.clock import Clock
from tide.services.common.heap import HeapFreezer
from tide.services.scaler import policy as pol
from tide.services.scaler.actuators import Actuator
from tide.services.scaler.coordination import CoordinatorClient
from tide.services.scaler.engine.custody import Custody
from tide.services.scaler.engine.decisions import DecisionDriver
from tide.services.scaler.engine.feed import DecisionFeed, Watched
from tide.services.scaler.engine.jobs import Evaluation, JobBook
from tide.services.scaler.engine.loop import Loop
from tide.services.scaler.engine.losses import Losses
from tide.services.scaler.engine.ownership import Ownership
from tide.services.scaler.engine.pipeline import Pipeline
from tide.services.scaler.engine.wakeups import Wakeups
from tide.services.scaler.ingest import Ingest, IngestSettings
from tide.services.scaler.lifecycle import FaultHook
from tide.services.scaler.members import CoordinatorMemberRegistry
from tide.services.scaler.metrics import ScalerMetrics
from tide.services.scaler.partials import JobPartial, NodeNotice
from tide.services.scaler.pool import PoolClaims
from tide.services.scaler.reconcile import Drift
from tide.services.scaler.rollup_writer import RollupWriter
from tide.services.scaler.store import DecisionRecord, DecisionStore, JobRecord
from tide.services.store.probe import StoreProbe

__all__ = ["Evaluation", "ScalerCore", "Watched"]

_DEFAULT_POLICY = pol.PolicySettings()


class ScalerCore:
    def __init__(
        self,
        *,
        store: DecisionStore,
        actuator: Actuator,
        coordinator: CoordinatorClient,
        clock: Clock,
        defaults: pol.PolicySettings = _DEFAULT_POLICY,
        ingest: IngestSettings | None = None,
        fault: FaultHook | None = None,
        evaluate_interval_s: float = 1.0,
        reconcile_interval_s: float = 30.0,
        rollup_flush_interval_s: float = 15.0,
        rollup_retention_days: float = 30.0,
        metrics: ScalerMetrics | None = None,
        detail_retention_days: float = 7.0,
        store_probe: StoreProbe | None = None,
        decision_retention_days: float | None = None,
        retention_batch_rows: int = 1000,
        heap: HeapFreezer | None = None,
    ) -> None:
        self.store = store
        self.actuator = actuator
        self.coordinator = coordinator
        self.clock = clock
        self.defaults = defaults
        self.evaluate_interval_s = evaluate_interval_s
        self.metrics = metrics = metrics or ScalerMetrics()
        self.book = book = JobBook(defaults, metrics)
        # The book's own maps, for the servicers and the tests that read them.
        self.jobs, self.policies = book.jobs, book.policies
        self.evaluations, self.active = book.evaluations, book.active
        self.ownership = ownership = Ownership()
        self.fenced = ownership.fenced
        self.wakeups = wakeups = Wakeups(clock, ownership, book.jobs)
        self.registry = members = CoordinatorMemberRegistry(coordinator.watch_members, clock)
        self.ingest = Ingest(
            ingest or IngestSettings(),
            members,
            clock,
            window_shape=book.shape,
            on_slot=wakeups.slot_opened,
            on_notice=wakeups.noticed,
        )
        self.feed = DecisionFeed()
        pool = PoolClaims(stale_after_s=3 * evaluate_interval_s + 1.0)
        self.driver = driver = DecisionDriver(
            store=store,
            actuator=actuator,
            coordinator=coordinator,
            clock=clock,
            book=book,
            pool=pool,
            feed=self.feed,
            wakeups=wakeups,
            metrics=metrics,
            fault=fault,
            wait_store=store_probe.wait_up if store_probe is not None else None,
        )
        self.controller = driver.controller
        rooms: dict[str, Any] = {"clock": clock, "book": book, "ownership": ownership}
        self.pipeline = Pipeline(
            **rooms,
            actuator=actuator,
            ingest=self.ingest,
            members=members,
            pool=pool,
            triggers=wakeups.triggers,
            driver=driver,
            metrics=metrics,
        )
        self.custody = Custody(
            **rooms,
            store=store,
            actuator=actuator,
            ingest=self.ingest,
            members=members,
            driver=driver,
            wakeups=wakeups,
            metrics=metrics,
        )
        losses = Losses(
            actuator=actuator,
            coordinator=coordinator,
            book=book,
            ownership=ownership,
            driver=driver,
            pipeline=self.pipeline,
            metrics=metrics,
            feed=self.feed,
        )
        self.rollups = RollupWriter(
            store,
            self.ingest.rollups,
            clock,
            retention_days=rollup_retention_days,
            detail_retention_days=detail_retention_days,
            decision_retention_days=decision_retention_days,
            batch_rows=retention_batch_rows,
        )
        self.loop = Loop(
            **rooms,
            coordinator=coordinator,
            ingest=self.ingest,
            pipeline=self.pipeline,
            losses=losses,
            rollups=self.rollups,
            wakeups=wakeups,
            metrics=metrics,
            evaluate_interval_s=evaluate_interval_s,
            reconcile_interval_s=reconcile_interval_s,
            rollup_flush_interval_s=rollup_flush_interval_s,
            store_probe=store_probe,
            heap=heap,
        )

    # -- jobs coming and going (engine/custody.py) ------------------------------------------

    def acts_on(self, job_id: str) -> bool:
        return self.ownership.acts_on(job_id)

    async def start(self) -> None:
        """Load jobs, take ownership of them, derive cooldowns from the database and
        resume every decision that is not final."""
        await self.custody.start()

    async def follow(self) -> None:
        """A follower's view of every job, refreshed while it follows."""
        await self.custody.follow()

    async def start_sharded(self) -> None:
        """Sharded: load every job for the read API and attribution; act on none yet
        (:meth:`take_jobs` as this replica's rounds gain their shards)."""
        await self.store.warm_up()
        await self.custody.refresh()

    async def refresh_jobs(self) -> list[str]:
        return await self.custody.refresh()

    async def take_jobs(self, job_ids: Sequence[str]) -> None:
        await self.custody.take(job_ids)

    async def drop_jobs(self, job_ids: Sequence[str]) -> None:
        """Stop acting on ``job_ids``: nothing acts on them once this returns."""
        await self.custody.drop(job_ids)
        # An evaluation batch under way may have staged these jobs before the drop: once
        # it is over, nothing evaluates them (acts_on), and its commit checks again.
        async with self.pipeline.lock:
            pass

    async def receive_partials(self, sender: str, parts: Sequence[JobPartial]) -> int:
        """Another replica's partial aggregates; returns how many were refused."""
        mine = self.custody.accept_partials(parts)
        self.ingest.merge_partials(sender, mine)
        return len(parts) - len(mine)

    def receive_notices(self, notices: Sequence[NodeNotice]) -> tuple[int, int]:
        return self.custody.receive_notices(notices)

    async def upsert_job(
        self,
        job_id: str,
        overrides: Mapping[str, Any],
        *,
        initial_replicas: int = 0,
        gpus_per_replica: int = 0,
        clear: Sequence[str] = (),
    ) -> JobRecord:
        return await self.custody.upsert(
            job_id,
            overrides,
            initial_replicas=initial_replicas,
            gpus_per_replica=gpus_per_replica,
            clear=clear,
        )

    async def set_autoscaling(self, job_id: str, paused: bool, reason: str) -> JobRecord:
        return await self.custody.set_autoscaling(job_id, paused, reason)

    # -- deciding (engine/pipeline.py, engine/losses.py, engine/loop.py) --------------------

    async def evaluate(
        self, job_id: str, *, tipping_s: float | None = None, fresh: Mapping[str, int] | None = None
    ) -> pol.Decision:
        """Evaluate one job now (its errors raised to the caller)."""
        return await self.pipeline.evaluate(job_id, tipping_s=tipping_s, fresh=fresh)

    async def request_resize(
        self, job_id: str, replicas: int, reason: str, requested_by: str
    ) -> DecisionRecord:
        self.ownership.require(job_id)
        return await self.pipeline.manual(job_id, replicas, reason, requested_by)

    async def tick(self, some: Sequence[str] | None = None) -> None:
        await self.loop.tick(some)

    async def reconcile(self) -> list[Drift]:
        return await self.loop.losses.reconcile()

    async def flush_rollups(self, *, final: bool = False) -> int:
        return await self.loop.flush_rollups(final=final)

    async def run(self) -> None:
        await self.loop.run()

    async def close(self) -> None:
        await self.rollups.close()
        await self.driver.close()
        await self.registry.close()
        self.feed.close()
