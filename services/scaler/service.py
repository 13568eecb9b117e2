"""The scaler's control loop: ingestion feeds windows, a closed bucket wakes the
policy, a resize becomes a committed decision, the controller carries it out.

:class:`ScalerCore` owns the in-memory picture (jobs, effective policies, last
evaluations, recent recommendations) and is what the gRPC servicers call.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.common import logs, tracing
from services.common.clock import Clock
from services.common.heap import HeapFreezer
from services.scaler import policy as pol
from services.scaler import reconcile
from services.scaler.actuators import Actuator
from services.scaler.controller import Controller
from services.scaler.convert import decision_inputs
from services.scaler.coordination import CoordinatorClient, JobStatusView
from services.scaler.errors import DecisionInProgress, NotLeader, NotOwner, StaleEpoch
from services.scaler.feed import DecisionFeed, Watched
from services.scaler.goodput import ThroughputBook
from services.scaler.history import RollupHistory
from services.scaler.ingest import IngestEngine, IngestSettings
from services.scaler.leader import LeaderElector
from services.scaler.lifecycle import FaultHook
from services.scaler.members import CoordinatorMemberRegistry
from services.scaler.metrics import ScalerMetrics
from services.scaler.partials import JobPartial, NodeNotice
from services.scaler.pool import WANTING, PoolClaims
from services.scaler.preemption import plan_notice
from services.scaler.reconcile import Drift
from services.scaler.shards import ShardLeases
from services.scaler.store import DecisionRecord, DecisionState, DecisionStore, JobRecord
from services.scaler.triggers import Triggers
from services.store.probe import StoreProbe
from tidebase.errors import InvalidArgument, NotFound, TideError, Unavailable
from tidebase.retry import Backoff

logger = logging.getLogger(__name__)

#: Jobs whose actuator and coordinator a reconcile pass asks at once.
RECONCILE_CONCURRENCY = 16

__all__ = ["Evaluation", "ScalerCore", "Watched"]

_DEFAULT_POLICY = pol.PolicySettings()
#: PolicySettings fields stored as job columns rather than overrides.
_BOUNDS = ("min_replicas", "max_replicas")
#: Seconds between two log lines about lost evaluation passes: an outage fails
#: every pass, and one line says as much as a hundred (the metric counts them all).
LOOP_LOG_EVERY_S = 10.0

#: Jobs a starting scaler takes (and reads the last resize of) per transaction.
START_BATCH = 200
#: A pass over every job hands the event loop back this often: a pass over 1,000 jobs
#: takes a few hundred milliseconds here, and every telemetry stream's ack would wait
#: behind it (bench.scale's ack p99); 64 jobs take about 10 ms.
YIELD_EVERY_JOBS = 64
#: The pass over every job is spread over the evaluation interval in up to this many
#: slices, one slice per PASS_SLICES-th of the interval, of at least YIELD_EVERY_JOBS
#: jobs each (a fleet of up to 64 jobs is one slice, the whole pass at once). Each job
#: is still evaluated once per interval, but the loop never runs the whole pass in
#: one go: at 1,250 jobs the pass took 60-300 ms every second, and the telemetry acks
#: that arrived meanwhile waited for it (bench.scale --sweep 5000 --resizing-every 0,
#: read second by second: ack p99 of 50-120 ms in every second, against 6-9 ms sliced
#: but in the seconds of a full garbage collection; docs/scaler.md).
PASS_SLICES = 10


@dataclass(frozen=True)
class Evaluation:
    decision: pol.Decision
    at_s: float


@dataclass(frozen=True)
class _Staged:
    """One job's evaluation between ``decide`` and its commit."""

    decision: pol.Decision
    state: pol.JobState
    view: pol.WindowView
    policy: pol.PolicySettings
    history: pol.History
    # The actuator's free GPUs when the batch began (before this batch's promises).
    raw_free: int | None
    at: float
    now: float
    seen: float
    tipping_s: float | None
    # The answer of the job's last evaluation again, its inputs being the same.
    reused: bool = False

    @property
    def job_id(self) -> str:
        return self.decision.job_id


#: Answers that hold for as long as the inputs do: the others read the time (a cooldown
#: running out, recommendations leaving the stabilization window, a sustain window
#: sliding past the last resize) or claim free GPUs (a claim is renewed by evaluating).
_TIMED = frozenset({pol.Reason.COOLDOWN, pol.Reason.STABILIZING})


def _reusable(d: pol.Decision, hist: pol.History) -> bool:
    """Whether ``decide`` gives ``d`` again for the same inputs at any later time.

    ``decide`` reads the time only in the cooldown (COOLDOWN), the stabilization
    window (STABILIZING, or a shrink) and the check that the sustain window starts
    after the last resize (NOT_SUSTAINED once the job has resized: the window's end
    moves with the time and is left out of the key). A resize, a preemption and a
    job that wants GPUs are decided every time."""
    if d.resize or d.supersedes or d.reason in _TIMED or d.reason in WANTING:
        return False
    return not (d.reason is pol.Reason.NOT_SUSTAINED and hist.last_resize_end_s is not None)


def _inputs_key(
    state: pol.JobState, view: pol.WindowView, p: pol.PolicySettings, hist: pol.History
) -> tuple[Any, ...]:
    """What ``decide`` reads, less the time, the free GPUs and the recommendations.

    Free GPUs are read only by a grow (never reusable); recommendations only by a
    shrink and STABILIZING (never reusable); the window's end only by the check
    ``_reusable`` leaves out. NaN (an empty bucket) is None, so that equal windows
    compare equal."""
    return (
        state.job_id,
        state.current_replicas,
        state.gpus_per_replica,
        state.paused,
        state.resize_in_progress,
        state.terminating_replicas,
        state.terminating_node,
        state.terminating_deadline_s,
        state.terminating_pods,
        state.in_flight_decision,
        state.in_flight_leaving,
        view.bucket_s,
        tuple(None if m != m else m for m in view.bucket_means),
        view.gpus_expected,
        view.gpus_fresh,
        p,
        hist.last_resize_end_s,
        hist.last_direction,
        hist.last_from_replicas,
        hist.throughput,
    )


def _leaving_of(d: DecisionRecord) -> frozenset[str] | None:
    """The pods a preemption drains; None for any other decision."""
    if d.trigger != pol.Trigger.EMERGENCY.name:
        return None
    return frozenset(str(p) for p in d.inputs.get("leaving_pods", []) or [])


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
        #: Freezes the long-lived heap as the fleet grows (services/common/heap.py);
        #: the process's entry sets it, never a test (it would freeze pytest's heap).
        self.heap = heap
        #: Whether the store answers (services.store.probe): while it does not, no
        #: job is evaluated (nothing could be recorded, so nothing may be done).
        self.store_probe = store_probe
        self.metrics = metrics or ScalerMetrics()
        self.actuator = actuator
        self.coordinator = coordinator
        self.clock = clock
        self.defaults = defaults
        self.registry = CoordinatorMemberRegistry(coordinator.watch_members, clock)
        self.engine = IngestEngine(
            ingest or IngestSettings(),
            self.registry,
            clock,
            window_shape=self._shape,
            on_slot=self._slot_opened,
            on_notice=self._noticed,
        )
        self.controller = Controller(
            store,
            actuator,
            coordinator,
            clock,
            fault=fault,
            on_event=self._publish,
            on_final=self._on_final,
            wait_store=store_probe.wait_up if store_probe is not None else None,
        )
        self.evaluate_interval_s = evaluate_interval_s
        self.reconcile_interval_s = reconcile_interval_s
        self.rollup_flush_interval_s = rollup_flush_interval_s
        self.feed = DecisionFeed()
        self.history = RollupHistory(
            store,
            self.engine.rollups,
            clock,
            retention_days=rollup_retention_days,
            detail_retention_days=detail_retention_days,
            decision_retention_days=decision_retention_days,
            batch_rows=retention_batch_rows,
        )
        self.jobs: dict[str, JobRecord] = {}
        self.policies: dict[str, pol.PolicySettings] = {}
        self.evaluations: dict[str, Evaluation] = {}
        self.active: dict[str, int] = {}
        #: The pods each decision in flight drains, by decision id (None: not a preemption).
        self._leaving: dict[int, frozenset[str] | None] = {}
        #: Decisions in flight that a preemption asked the coordinator to abort.
        self._superseded: set[int] = set()
        self._background: set[asyncio.Task[None]] = set()
        #: Each job's lost_steps_total as last seen, to tell what a loss cost.
        self._lost_seen: dict[str, int] = {}
        self._recs: dict[str, list[tuple[float, int]]] = {}
        self._last_dir: dict[str, int] = {}
        self._last_from: dict[str, int] = {}
        #: Replicas the actuator is still asked for after a member was lost without
        #: notice (the last completed decision was MEMBER_LOST): its from_replicas.
        self._asked: dict[str, int] = {}
        self.throughput = ThroughputBook()
        self.pool = PoolClaims(stale_after_s=3 * evaluate_interval_s + 1.0)
        self.triggers = Triggers()
        self._wake: asyncio.Event | None = None
        # One evaluation (or batch) at a time: a batch decides for all its jobs before
        # any commits, and a job is never evaluated twice at once.
        self._eval_lock = asyncio.Lock()
        #: Jobs another scaler took (StaleEpoch): no longer evaluated here.
        self.fenced: set[str] = set()
        self._loop_logged_s = -math.inf
        #: Leader election (services/scaler/leader.py): None when this replica is the
        #: only one. A follower refuses writes, naming the leader.
        self.leader: LeaderElector | None = None
        #: Sharded (services/scaler/shards.py): this replica acts only on the jobs of the
        #: shards it holds; None: on every job (alone, or as the elected leader).
        self.shards: ShardLeases | None = None
        #: Sharded: the jobs taken since their shard was gained (a new epoch, their
        #: state read back). Between a round gaining a shard and the take, not acted on.
        self._taken: set[str] = set()
        #: Told of every decision state (the Kubernetes Events); must not block.
        self.observers: list[Callable[[DecisionRecord, str], None]] = []
        #: Per job, the inputs of its last evaluation and the answer, while that answer
        #: may be given again for the same inputs (``_reusable``).
        self._memo: dict[str, tuple[tuple[Any, ...], pol.Decision]] = {}
        #: Evaluations of the pass over every job answered from ``_memo`` (a plain int;
        #: bench.scale and the tests read it).
        self.reused = 0
        #: Whether the pass answers unchanged jobs from ``_memo`` (bench.tick turns it
        #: off to measure the pass that decides every job).
        self.reuse_answers = True

    # -- jobs and policies -----------------------------------------------------------

    def acts_on(self, job_id: str) -> bool:
        """Whether this replica evaluates and acts on the job now: not fenced off and,
        sharded, its shard held (by this replica's clock)."""
        if job_id in self.fenced:
            return False
        return self.shards is None or (job_id in self._taken and self.shards.owns(job_id))

    def _shape(self, job_id: str) -> tuple[float, int]:
        p = self.policies.get(job_id, self.defaults)
        return p.bucket_s, p.buckets

    def policy_of(self, job: JobRecord) -> pol.PolicySettings:
        overrides = {k: v for k, v in job.policy_overrides.items() if k not in _BOUNDS}
        return self.defaults.with_overrides(
            {**overrides, "min_replicas": job.min_replicas, "max_replicas": job.max_replicas}
        )

    def _adopt(self, job: JobRecord) -> None:
        self._know(job)
        self.actuator.adopt(
            job.job_id, replicas=job.current_replicas, gpus_per_replica=job.gpus_per_replica
        )

    def _know(self, job: JobRecord) -> None:
        """Hold ``job`` as the store has it: its policy, its windows' shape, its members
        watched (so telemetry is attributed to it), its metrics. Nothing acts on it."""
        old = self.policies.get(job.job_id)
        p = self.policy_of(job)
        self.jobs[job.job_id] = job
        self.policies[job.job_id] = p
        if old is not None and (old.bucket_s, old.sustain_s) != (p.bucket_s, p.sustain_s):
            self.engine.reshape(job.job_id)
        self.registry.track(job.job_id)
        self.metrics.job(job, p, resizing=job.job_id in self.active)

    async def follow(self) -> None:
        """A follower's view, refreshed while it follows: every job and the decisions in
        flight as the store has them, for the read API, and each job's members watched so
        the telemetry it ingests fills warm windows. It takes no job (no epoch) and tells
        the actuator nothing: the leader does both, and :meth:`start` on election."""
        jobs = await self.store.list_jobs()
        in_flight = await self.store.non_final()
        for job in jobs:
            self._know(job)
        self.active.clear()
        self.active.update((d.job_id, d.id) for d in in_flight)

    async def start(self) -> None:
        """Load jobs, take ownership of them, derive cooldowns from the database and
        resume every decision that is not final."""
        self._wake = asyncio.Event()
        await self.store.warm_up()
        # What a follower saw in flight may have ended since: the store says what is.
        self.active.clear()
        jobs = await self.store.list_jobs()
        for job in jobs:
            self._adopt(job)
        # A transaction per batch, not per job: with 1,000 jobs, 1,000 acquire
        # transactions and as many reads were most of the start-up.
        for i in range(0, len(jobs), START_BATCH):
            batch = [j.job_id for j in jobs[i : i + START_BATCH]]
            await self.store.acquire_many(batch)
            for job_id, last in (await self.store.last_completed_many(batch)).items():
                self._restore_last(job_id, last)
        for d in await self.store.non_final():
            self._track(d)
        await self.controller.recover(self._deadline_of)

    # -- sharded (services/scaler/shards.py, services/scaler/sharding.py) ------------------

    async def start_sharded(self) -> None:
        """Sharded: load every job for the read API and attribution; act on none yet
        (:meth:`take_jobs` as this replica's rounds gain their shards)."""
        self._wake = asyncio.Event()
        await self.store.warm_up()
        await self.refresh_jobs()

    async def refresh_jobs(self) -> list[str]:
        """Jobs as the store has them, for those this replica does not act on (another
        replica writes them); returns the jobs new here. The ones it acts on are its own
        writes, already mirrored."""
        jobs = await self.store.list_jobs()
        in_flight = await self.store.non_final()
        new = [j.job_id for j in jobs if j.job_id not in self.jobs]
        for job in jobs:
            if job.job_id not in self.jobs or not self.acts_on(job.job_id):
                self._know(job)
        for job_id in [j for j in self.active if not self.acts_on(j)]:
            del self.active[job_id]
        self.active.update((d.job_id, d.id) for d in in_flight if not self.acts_on(d.job_id))
        return new

    async def take_jobs(self, job_ids: Sequence[str]) -> None:
        """Act on ``job_ids`` from now on (their shard was gained): take each (a new owner
        epoch: whatever the last owner still writes is refused), read back what its last
        resize tells the policy, and resume its decisions that are not final."""
        job_ids = [j for j in job_ids if j in self.jobs]
        if not job_ids:
            return
        for i in range(0, len(job_ids), START_BATCH):
            batch = job_ids[i : i + START_BATCH]
            await self.store.acquire_many(batch)
            for job_id, last in (await self.store.last_completed_many(batch)).items():
                self._restore_last(job_id, last)
        taken = set(job_ids)
        for job_id in taken:
            self.fenced.discard(job_id)
            self.active.pop(job_id, None)
        self._taken |= taken
        # The jobs as they stand after the last owner's writes (its epoch is now refused).
        for job in await self.store.list_jobs():
            if job.job_id in taken:
                self._adopt(job)
        for d in await self.store.non_final():
            if d.job_id not in taken:
                continue
            self._track(d)
            logger.info(
                "resuming decision %d of job %s from %s (shard taken)",
                d.id,
                d.job_id,
                d.state.value,
                extra={"job_id": d.job_id, "decision_id": d.id},
            )
            self.controller.start(d, deadline_s=self._deadline_of(d.job_id), armed=False)
        if self._wake is not None:
            self._wake.set()  # evaluated on the next pass, not a tick later

    async def drop_jobs(self, job_ids: Sequence[str]) -> None:
        """Stop acting on ``job_ids`` (their shard is given up or lost): their decisions in
        flight here are cancelled and awaited, so nothing acts on them once this returns;
        the new owner resumes them from the store."""
        self._taken.difference_update(job_ids)
        tasks = []
        for job_id in job_ids:
            did = self.active.get(job_id)
            task = self.controller.tasks.get(did) if did is not None else None
            if task is not None and not task.done():
                task.cancel()
                tasks.append(task)
            self._recs.pop(job_id, None)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        # An evaluation batch under way may have staged these jobs before the drop: once
        # it is over, nothing evaluates them (acts_on), and _commit checks again.
        async with self._eval_lock:
            pass

    async def receive_partials(self, sender: str, parts: Sequence[JobPartial]) -> int:
        """Another replica's partial aggregates: those of jobs acted on here go into their
        windows and rollups; returns how many were refused (their shard is not held here,
        the sender ships to the new owner next). A job whose shard is held but not yet
        taken is accepted: a sender replays a moved job's slots once, as soon as it reads
        the new lease, which may be before this replica's round takes the job."""
        mine = [
            p
            for p in parts
            if self.acts_on(p.job_id)
            or (
                self.shards is not None
                and p.job_id not in self.fenced
                and self.shards.owns(p.job_id)
            )
        ]
        self.engine.merge_partials(sender, mine)
        return len(parts) - len(mine)

    def receive_notices(self, notices: Sequence[NodeNotice]) -> tuple[int, int]:
        """Another replica's node notices: those of jobs acted on here are applied as this
        replica's own agent streams' are (docs/preemption.md), a resent one once. Returns
        (applied, refused); the refused are resent to the job's new owner."""
        ours = [n for n in notices if self.acts_on(n.job_id)]
        applied, duplicate = self.engine.merge_notices(ours)
        m = self.metrics.notices_received
        m.labels("applied").inc(applied)
        m.labels("duplicate").inc(duplicate)
        m.labels("refused").inc(len(notices) - len(ours))
        return applied, len(notices) - len(ours)

    def _restore_last(self, job_id: str, last: DecisionRecord) -> None:
        """What the job's last completed resize tells the policy and the goodput guard."""
        self._note_asked(last)
        self._last_dir[job_id] = (last.to_replicas > last.from_replicas) - (
            last.to_replicas < last.from_replicas
        )
        self._last_from[job_id] = last.from_replicas
        measured = (last.inputs.get("goodput") or {}).get("throughput_by_replicas")
        if measured:
            self.throughput.restore(
                job_id,
                ((int(r), float(v)) for r, v in measured.items()),
                last.created_at.timestamp(),
            )

    async def close(self) -> None:
        await self.history.close()
        for t in list(self._background):
            t.cancel()
        await self.controller.close()
        await self.registry.close()
        self.feed.close()

    def _deadline_of(self, job_id: str) -> float:
        return self.policies.get(job_id, self.defaults).phase_timeout_s

    async def upsert_job(
        self,
        job_id: str,
        overrides: Mapping[str, Any],
        *,
        initial_replicas: int = 0,
        gpus_per_replica: int = 0,
        clear: Sequence[str] = (),
    ) -> JobRecord:
        """Create or update a job; ``clear`` names overrides to remove (back to the default)."""
        self._require_leader(job_id)
        existing = self.jobs.get(job_id)
        bounds = {k: overrides[k] for k in _BOUNDS if overrides.get(k) is not None}
        rest = {k: v for k, v in overrides.items() if k not in _BOUNDS and v is not None}
        base = self.policy_of(existing) if existing is not None else self.defaults
        if existing is not None and clear:
            kept = {k: v for k, v in existing.policy_overrides.items() if k not in clear}
            base = self.defaults.with_overrides(
                {
                    **kept,
                    "min_replicas": existing.min_replicas,
                    "max_replicas": existing.max_replicas,
                }
            )
        # Validated in full before anything is written; ConfigError names the field.
        merged = base.with_overrides({**rest, **bounds})
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
        self._adopt(job)
        untaken = self.shards is not None and job_id not in self._taken
        if job_id not in self.store.epochs or job_id in self.fenced or untaken:
            await self.store.acquire(job_id)
            self.fenced.discard(job_id)
        self._taken.add(job_id)
        return self.jobs[job_id]

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
        self._adopt(job)
        self.fenced.discard(job_id)
        self._taken.add(job_id)
        self._launch(record, message)
        logger.info(
            "job %s: decision %d: %s",
            job_id,
            record.id,
            message,
            extra={"job_id": job_id, "decision_id": record.id},
        )
        return self.jobs[job_id]

    async def set_autoscaling(self, job_id: str, paused: bool, reason: str) -> JobRecord:
        self._require_leader(job_id)
        self._job(job_id)
        job = await self.store.set_paused(job_id, paused, reason)
        self._adopt(job)
        return job

    def _job(self, job_id: str) -> JobRecord:
        job = self.jobs.get(job_id)
        if job is None:
            raise NotFound(f"job {job_id!r} not found")
        return job

    # -- evaluation ----------------------------------------------------------------------

    def _slot_opened(self, job_id: str, t: float) -> None:
        if job_id in self.jobs and self.acts_on(job_id):
            self.triggers.slot_opened(job_id, t, self.clock.now())
            if self._wake is not None:
                self._wake.set()

    def _noticed(self, job_id: str) -> None:
        if job_id in self.jobs and self.acts_on(job_id):
            self.triggers.noticed(job_id, self.clock.now())
            if self._wake is not None:
                self._wake.set()

    def _doomed(self, job_id: str) -> tuple[set[str], str, float | None]:
        """Pods of the job that must go: on nodes with a notice (one such node, the
        earliest deadline), and those whose launcher asked to leave (SIGTERM)."""
        pods, node, deadline = self.engine.terminating_pods(job_id)
        leaving = [
            m
            for m in self.registry.members(job_id)
            if m.active
            and m.leave_requested
            # The agent may name the same pod already (by name or uid): once is enough.
            and m.pod_name not in pods
            and m.pod_uid not in pods
        ]
        asked = {m.pod_uid or m.pod_name for m in leaving}
        # A pod's grace end is its deadline as a node's notice is: the earliest rules.
        ends = [m.leave_deadline_s for m in leaving if m.leave_deadline_s is not None]
        if ends:
            deadline = min([*ends, *([deadline] if deadline is not None else [])])
        return pods | asked, node or ("pod SIGTERM" if asked else ""), deadline

    def job_state(self, job_id: str, free_gpus: int | None) -> pol.JobState:
        job = self._job(job_id)
        pods, node, deadline = self._doomed(job_id)
        in_flight = self.active.get(job_id, 0)
        return pol.JobState(
            job_id=job_id,
            current_replicas=job.current_replicas,
            gpus_per_replica=job.gpus_per_replica,
            paused=job.autoscaling_paused,
            resize_in_progress=job_id in self.active,
            free_gpus=free_gpus,
            terminating_replicas=len(pods),
            terminating_node=node,
            terminating_deadline_s=deadline,
            terminating_pods=frozenset(pods),
            in_flight_decision=in_flight,
            in_flight_leaving=self._leaving.get(in_flight),
        )

    def window_of(
        self, job_id: str, now: float, fresh: Mapping[str, int] | None = None
    ) -> pol.WindowView:
        job = self._job(job_id)
        # Alone (a trigger's evaluation), only the job's own nodes are read; the tick,
        # which evaluates every job, counts the whole fleet once and passes it in.
        n = self.engine.fresh_gpus_of(job_id, now) if fresh is None else fresh.get(job_id, 0)
        expected = job.current_replicas * job.gpus_per_replica
        return self.engine.window_view(job_id, now, expected, n)

    async def evaluate(
        self, job_id: str, *, tipping_s: float | None = None, fresh: Mapping[str, int] | None = None
    ) -> pol.Decision:
        """Evaluate one job now (its errors raised to the caller)."""
        async with self._eval_lock:
            with self.metrics.evaluation.time():
                raw = await self.actuator.free_gpus()
                return await self._commit(self._stage(job_id, tipping_s, fresh, raw))

    async def evaluate_many(
        self,
        items: Sequence[tuple[str, float | None]],
        fresh: Mapping[str, int] | None = None,
        *,
        reuse: bool = False,
    ) -> None:
        """Evaluate several jobs: every ``decide`` first, then the pool step and the commits,
        so that a grow is shared with every job that wants to grow at the same moment.
        A job's error is logged and ends only that job's evaluation. ``reuse``: a job
        whose inputs did not change keeps its last answer (``_stage``)."""
        async with self._eval_lock:
            raw = await self.actuator.free_gpus()
            staged: list[tuple[_Staged, float]] = []
            for n, (job_id, tipping_s) in enumerate(items, 1):
                if n % YIELD_EVERY_JOBS == 0:
                    await asyncio.sleep(0)
                with self._guard(job_id):
                    t0 = time.perf_counter()
                    st = self._stage(job_id, tipping_s, fresh, raw, reuse=reuse)
                    if st.reused:
                        # Nothing to share or commit: the last answer, at this time.
                        self.evaluations[job_id] = Evaluation(st.decision, st.now)
                    else:
                        staged.append((st, time.perf_counter() - t0))
            await self._commit_batch(staged)

    def _stage(
        self,
        job_id: str,
        tipping_s: float | None,
        fresh: Mapping[str, int] | None,
        raw_free: int | None,
        *,
        reuse: bool = False,
    ) -> _Staged:
        """The policy's answer for one job (no I/O); its claim on free GPUs noted.

        ``reuse`` (the pass over every job): when the job's inputs equal those of its
        last evaluation and that answer did not depend on the time, the answer is
        that one again (``decide`` is pure), and nothing is decided, published or
        shared (see :func:`_reusable`)."""
        free = self.pool.free(raw_free)
        job = self._job(job_id)
        p = self.policies[job_id]
        now = self.clock.now()
        seen = self.triggers.seen_at.pop(job_id, now) if tipping_s is not None else now
        # An agent clock slightly ahead must not hide the slot it just opened.
        at = max(now, tipping_s) if tipping_s is not None else now
        state = self.job_state(job_id, free)
        view = self.window_of(job_id, at, fresh)
        last_end = job.last_resize_ended_at.timestamp() if job.last_resize_ended_at else None
        recs = self._recs.setdefault(job_id, [])
        curve = self.throughput.curve(job_id, at)
        hist = pol.History(
            last_end,
            self._last_dir.get(job_id, 0),
            tuple(recs),
            last_from_replicas=self._last_from.get(job_id, 0),
            throughput=curve,
        )
        key = _inputs_key(state, view, p, hist)
        memo = self._memo.get(job_id)
        if reuse and memo is not None and memo[0] == key:
            d = memo[1]
            self.reused += 1
        else:
            d = pol.decide(state, view, p, hist, at)
            self.metrics.window(job_id, view)
            if _reusable(d, hist):
                self._memo[job_id] = (key, d)
            else:
                self._memo.pop(job_id, None)
            memo = None
        if d.recommendation is not None:
            recs.append((at, d.recommendation))
            horizon = at - p.scale_down_stabilization_s
            while recs and recs[0][0] < horizon:
                recs.pop(0)
        if memo is None:
            # A reused answer neither wants GPUs nor held a claim (_reusable).
            self.pool.note(d, state, curve, at)
        return _Staged(
            d, state, view, p, hist, raw_free, at, now, seen, tipping_s, reused=memo is not None
        )

    async def _commit(self, st: _Staged) -> pol.Decision:
        """The pool step, then a resize is committed (PENDING) and handed to the controller."""
        d, inputs = await self._prepare(st)
        if inputs is None:
            return d
        try:
            record = await self._persist(d, inputs, "")
        except DecisionInProgress:
            self.pool.fulfilled(d.job_id)
            return d
        except BaseException:
            self.pool.fulfilled(d.job_id)
            raise
        self._created(st, d, record)
        return d

    async def _prepare(self, st: _Staged) -> tuple[pol.Decision, dict[str, Any] | None]:
        """``st``'s answer after the pool step, and the inputs of the decision to write
        (None: nothing to write). A grow's GPUs are promised here, before its write,
        so that the next job of the batch shares what is left; a write that does not
        happen takes its promise back (``pool.fulfilled``)."""
        d, state = st.decision, st.state
        free = self.pool.free(st.raw_free)
        if d.wanted_replicas and free != state.free_gpus:
            # Grows committed earlier in this batch took GPUs: decide with what is left.
            state = dataclasses.replace(state, free_gpus=free)
            d = pol.decide(state, st.view, st.policy, st.history, st.at)
        d = self.pool.share(d, state)
        job_id = d.job_id
        if not self.acts_on(job_id):
            return d, None  # its shard went while the batch was staged: the new owner decides
        self.evaluations[job_id] = Evaluation(d, st.now)
        if d.supersedes:
            await self._supersede(job_id, d.supersedes, d.message)
            return d, None
        if not d.resize:
            return d, None
        job = self._job(job_id)
        inputs = decision_inputs(
            job.current_replicas, st.policy, st.view, state.free_gpus, d, st.at
        )
        if d.trigger is pol.Trigger.EMERGENCY:
            pods, node, deadline = self._doomed(job_id)
            inputs["leaving_pods"] = sorted(pods)
            # Their names too, for the actuator: a pod named by uid that is gone before
            # the replicas drop (its launcher left on SIGTERM) is found by name only.
            inputs["leaving_pod_names"] = sorted(
                m.pod_name
                for m in self.registry.members(job_id)
                if m.pod_name in pods or (m.pod_uid and m.pod_uid in pods)
            )
            inputs["node_name"] = node
            inputs["node_deadline_s"] = deadline
            plan = plan_notice(
                st.policy.phase_timeout_s,
                deadline,
                self.clock.now(),
                self.controller.checkpoint_s.get(job_id),
            )
            inputs["barrier_deadline_s"] = plan.barrier_deadline_s
            inputs["notice_plan"] = {"reason": plan.reason.name, "message": plan.message}
        if d.direction > 0:
            self.pool.promise(job_id, (d.to_replicas - d.from_replicas) * job.gpus_per_replica)
        return d, inputs

    def _created(self, st: _Staged, d: pol.Decision, record: DecisionRecord) -> None:
        """A decision of the policy is written: the controller takes it from here."""
        self._launch(record, d.message, started_s=st.tipping_s)
        job_id = d.job_id
        if st.tipping_s is not None:
            done = self.clock.now()
            self.metrics.observe_decision(
                done - st.tipping_s, (st.seen - st.tipping_s, st.now - st.seen, done - st.now)
            )
            self._trace_evaluation(
                record.id, ((st.tipping_s, st.seen), (st.seen, st.now), (st.now, done))
            )
        logger.info(
            "job %s: decision %d: %s",
            job_id,
            record.id,
            d.message,
            extra={"job_id": job_id, "decision_id": record.id},
        )

    async def _commit_batch(self, staged: Sequence[tuple[_Staged, float]]) -> None:
        """The pool step of every staged answer in order, then every decision to write
        in one transaction (``DecisionStore.create_many``), then each is handed to the
        controller. Jobs that tip together (a bucket boundary, a burst of reports) are
        one write instead of one each: bench.tick's tipping phase had 1,000 creates
        queue behind each other and behind the lifecycle's writes. Should the batch
        fail as a whole, each decision is written alone as before, so one job's
        error ends only that job's evaluation."""
        writes: list[tuple[_Staged, pol.Decision, dict[str, Any], float]] = []
        for n, (st, spent) in enumerate(staged, 1):
            if n % YIELD_EVERY_JOBS == 0:
                await asyncio.sleep(0)
            with self._guard(st.job_id):
                t0 = time.perf_counter()
                d, inputs = await self._prepare(st)
                if inputs is None:
                    self.metrics.evaluation.observe(spent + time.perf_counter() - t0)
                else:
                    writes.append((st, d, inputs, spent + time.perf_counter() - t0))
        if not writes:
            return
        t0 = time.perf_counter()
        items = [self._create_kwargs(d, inputs, "") for _, d, inputs, _ in writes]
        results: Sequence[DecisionRecord | TideError | None]
        try:
            results = await self.store.create_many(items)
        except Exception as exc:
            # Any error, not only the store's: a job's shard dropped since it was
            # staged (no epoch) must not end the loop; alone, each write is guarded.
            logger.warning("a batch of %d decisions failed, writing each: %s", len(items), exc)
            results = [None] * len(writes)
        shared = (time.perf_counter() - t0) / len(writes)
        for (st, d, inputs, spent), result in zip(writes, results, strict=True):
            with self._guard(st.job_id):
                t1 = time.perf_counter()
                try:
                    if result is None:
                        result = await self._persist(d, inputs, "")
                    elif isinstance(result, TideError):
                        raise result
                except DecisionInProgress:
                    self.pool.fulfilled(d.job_id)
                    continue
                except BaseException:
                    self.pool.fulfilled(d.job_id)
                    raise
                self._created(st, d, result)
                self.metrics.evaluation.observe(spent + shared + time.perf_counter() - t1)

    async def _supersede(self, job_id: str, decision_id: int, message: str) -> None:
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
        self._noticed(job_id)

    @contextlib.contextmanager
    def _guard(self, job_id: str) -> Iterator[None]:
        """One job's evaluation failing is logged; a fenced job is no longer evaluated."""
        try:
            with logs.bound(job_id=job_id):
                yield
        except StaleEpoch as exc:
            # Another scaler took the job; stop deciding for it (once, not every tick).
            self.fenced.add(job_id)
            logger.warning(
                "job %s: fenced off, no longer deciding for it: %s",
                job_id,
                exc,
                extra={"job_id": job_id},
            )
        except TideError as exc:
            logger.warning("job %s: evaluation failed: %s", job_id, exc, extra={"job_id": job_id})
        except Exception:
            logger.exception("job %s: evaluation failed", job_id, extra={"job_id": job_id})

    def _trace_evaluation(self, decision_id: int, stages: tuple[tuple[float, float], ...]) -> None:
        """The decision's first spans, after the fact: the tipping sample's way to the
        scaler, its wait for the loop, and the evaluation up to the commit."""
        root = self.controller.spans.get(decision_id)
        if root is None:
            return
        for name, (start, end) in zip(("transport", "queue", "evaluate"), stages, strict=True):
            span = tracing.start_span(f"tide.{name}", parent=root, start_ns=int(start * 1e9))
            span.end(end_time=int(max(start, end) * 1e9))

    async def _create(
        self,
        d: pol.Decision,
        inputs: dict[str, Any],
        requested_by: str,
        *,
        started_s: float | None = None,
    ) -> DecisionRecord:
        record = await self._persist(d, inputs, requested_by)
        self._launch(record, d.message, started_s=started_s)
        return record

    async def _persist(
        self, d: pol.Decision, inputs: dict[str, Any], requested_by: str = ""
    ) -> DecisionRecord:
        """Write ``d`` as a PENDING decision (DecisionInProgress: the job has one)."""
        return await self.store.create(**self._create_kwargs(d, inputs, requested_by))

    @staticmethod
    def _create_kwargs(
        d: pol.Decision, inputs: dict[str, Any], requested_by: str
    ) -> dict[str, Any]:
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

    def _track(self, record: DecisionRecord) -> None:
        """A decision not final is the job's one in flight, with the pods it drains."""
        self.active[record.job_id] = record.id
        self._leaving[record.id] = _leaving_of(record)
        self.metrics.decision_started(record)

    def _launch(
        self, record: DecisionRecord, message: str, *, started_s: float | None = None
    ) -> None:
        """Hand a committed PENDING decision to the controller (its trace starts at
        ``started_s``, the tipping sample, when the policy made it)."""
        self._track(record)
        self._publish(record, message)
        self.controller.fault("decision:PENDING")
        self.controller.start(
            record, deadline_s=self._deadline_of(record.job_id), started_s=started_s
        )

    async def request_resize(
        self, job_id: str, replicas: int, reason: str, requested_by: str
    ) -> DecisionRecord:
        self._require_leader(job_id)
        job = self._job(job_id)
        p = self.policies[job_id]
        free = await self.actuator.free_gpus()
        d = pol.manual(self.job_state(job_id, free), p, replicas, reason)
        now = self.clock.now()
        view = self.window_of(job_id, now)
        inputs = decision_inputs(job.current_replicas, p, view, free, d, now)
        try:
            return await self._create(d, inputs, requested_by)
        except DecisionInProgress as exc:
            raise DecisionInProgress(str(exc)) from None

    def _on_final(self, d: DecisionRecord) -> None:
        if self.active.get(d.job_id) == d.id:
            del self.active[d.job_id]
        self._leaving.pop(d.id, None)
        self._superseded.discard(d.id)
        job = self.jobs.get(d.job_id)
        if job is not None:
            # Mirror what the store did in the same transaction, so the very next
            # evaluation sees the new size and the cooldown without a read.
            changes: dict[str, Any] = {"last_resize_ended_at": d.ended_at}
            if d.state is DecisionState.COMPLETED:
                changes["current_replicas"] = d.to_replicas
                changes["generation"] = max(job.generation, d.generation)
                self._note_asked(d)
            if d.state is DecisionState.COMPLETED and d.reason != pol.Reason.RECONCILE.name:
                # A correction puts back the recorded size: not a resize the goodput
                # guard or the direction rules should learn from.
                self._last_dir[d.job_id] = (d.to_replicas > d.from_replicas) - (
                    d.to_replicas < d.from_replicas
                )
                self._last_from[d.job_id] = d.from_replicas
            self.jobs[d.job_id] = dataclasses.replace(job, **changes)
            self.metrics.decision_finished(d, self.jobs[d.job_id].current_replicas)
        self._recs.pop(d.job_id, None)

    def _note_asked(self, d: DecisionRecord) -> None:
        """After a completed decision: what the actuator is asked for, if not its size."""
        if d.reason == pol.Reason.MEMBER_LOST.name:
            self._asked.setdefault(d.job_id, d.from_replicas)
        else:
            self._asked.pop(d.job_id, None)

    # -- the loop ---------------------------------------------------------------------------

    async def tick(self, some: Sequence[str] | None = None) -> None:
        """Evaluate every job (or ``some`` of them: one slice of the pass)."""
        now = self.clock.now()
        if some is None:
            # The whole fleet counted once is cheaper than job by job.
            fresh: Mapping[str, int] | None = self.engine.fresh_gpus(now)
            jobs = [j for j in self.jobs if self.acts_on(j)]
        else:
            fresh = None
            jobs = [j for j in some if j in self.jobs and self.acts_on(j)]
        running: list[tuple[str, float | None]] = []
        latest_status = self.coordinator.latest_status
        for n, job_id in enumerate(jobs, 1):
            if n % YIELD_EVERY_JOBS == 0:
                await asyncio.sleep(0)
            # One status read per job and pass (three were a tenth of the pass).
            st = latest_status(job_id)
            if st is None:
                running.append((job_id, None))
                continue
            self._measure(job_id, now, st)
            if self._may_have_lost(job_id, st):
                with self._guard(job_id):
                    await self._record_loss(job_id)
            if not st.over:
                running.append((job_id, None))
        await self.evaluate_many(running, fresh, reuse=self.reuse_answers)

    def _finished(self, job_id: str) -> bool:
        """The coordinator says every member finished its budget (or the job failed for
        good): no more resizes."""
        st = self.coordinator.latest_status(job_id)
        return st is not None and st.over

    def _may_have_lost(self, job_id: str, st: JobStatusView) -> bool:
        """Whether ``_record_loss`` may find a loss: the coordinator's generation is newer
        than the job's and smaller (checked without the guard's cost, for every job)."""
        return job_id not in self._lost_seen or (
            st.generation > self.jobs[job_id].generation
            and 0 < st.world_size < self.jobs[job_id].current_replicas
        )

    async def _record_loss(self, job_id: str) -> None:
        """A generation that formed smaller with no decision of ours in flight lost a
        member without notice: a MEMBER_LOST record, with the steps it cost, so that
        the history holds every change of world size."""
        job, st = self.jobs[job_id], self.coordinator.latest_status(job_id)
        if st is None:
            return
        seen = self._lost_seen.setdefault(job_id, st.lost_steps_total)
        if (
            job_id in self.active
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
            record = await self._persist(d, inputs)
        except DecisionInProgress:
            return
        self._lost_seen[job_id] = st.lost_steps_total
        self._track(record)
        self._publish(record, message)
        logger.warning(
            "job %s: decision %d: %s",
            job_id,
            record.id,
            message,
            extra={"job_id": job_id, "decision_id": record.id},
        )
        await self.controller.record_unplanned(
            record, generation=st.generation, lost_steps=lost, detail=message
        )

    async def reconcile(self) -> list[Drift]:
        """Compare every idle job's recorded size with the actuator's replicas and the
        coordinator's world size; correct each drift through a recorded decision
        (services/scaler/reconcile.py). Returns the drifts found.

        The parties are asked for several jobs at once (a pass over a thousand jobs is
        a thousand reads of each): the evaluation loop waits for the pass."""
        self.metrics.reconcile_passes.inc()
        idle = [
            (job_id, self.jobs[job_id])
            for job_id in self.jobs
            if self.acts_on(job_id) and job_id not in self.active and not self._finished(job_id)
        ]
        bound = asyncio.Semaphore(RECONCILE_CONCURRENCY)

        async def ask(job_id: str) -> reconcile.Observed:
            async with bound:
                return await reconcile.observe(job_id, self.actuator, self.coordinator)

        answers = await asyncio.gather(*(ask(j) for j, _ in idle), return_exceptions=True)
        found: list[Drift] = []
        for (job_id, seen), observed in zip(idle, answers, strict=True):
            with self._guard(job_id):
                if isinstance(observed, BaseException):
                    raise observed
                # A decision started, or ended, while the parties were asked: the
                # answers may be from either side of it; the next pass asks again.
                if job_id in self.active or self.jobs.get(job_id) is not seen:
                    continue
                drift = reconcile.compare(
                    job_id,
                    seen.current_replicas,
                    seen.generation,
                    observed,
                    asked_replicas=self._asked.get(job_id),
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
            record = await self._create(d, drift.inputs(), "")
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

    def _measure(self, job_id: str, now: float, status: JobStatusView | None) -> None:
        job = self.jobs[job_id]
        if status is not None and job_id not in self.active:
            ended = job.last_resize_ended_at.timestamp() if job.last_resize_ended_at else None
            self.throughput.settled(
                job_id, job.current_replicas, status.world_size, status.samples_per_s, ended, now
            )

    async def run(self) -> None:
        """Evaluate a job as soon as one of its buckets closes, every job once per
        interval, and flush finished rollup minutes; until cancelled."""
        if self._wake is None:
            self._wake = asyncio.Event()
        wake = self._wake
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
                self._loop_failed("store unavailable; not evaluating", None)
                continue
            try:
                if self.triggers:
                    await self.drain_triggers()
                if mono >= next_tick:
                    if k == 0:
                        round_start = mono
                        order = [j for j in self.jobs if self.acts_on(j)]
                        slices = max(1, min(PASS_SLICES, len(order) // YIELD_EVERY_JOBS))
                    if slices == 1:
                        await self.tick()
                    else:
                        per = -(-len(order) // slices)
                        await self.tick(order[k * per : (k + 1) * per])
                    k = (k + 1) % slices
                    next_tick = round_start + (k or slices) * self.evaluate_interval_s / slices
                    if k == 0 and self.heap is not None:
                        engine = self.engine
                        self.heap.grown(len(self.jobs) + len(engine.nodes) + engine.streams_open)
                if mono >= next_flush:
                    await self.flush_rollups()
                    next_flush = mono + self.rollup_flush_interval_s
                if mono >= next_reconcile:
                    next_reconcile = mono + self.reconcile_interval_s
                    await self.reconcile()
            except Unavailable as exc:
                # The store (or the coordinator) went away mid-pass: this pass is
                # lost, the loop is not. Ended once, it would decide nothing more
                # while the process kept serving (reliability catalog, T03).
                next_tick = mono + self.evaluate_interval_s
                self._loop_failed("evaluation pass failed", exc)

    def _require_leader(self, job_id: str) -> None:
        if self.leader is not None and not self.leader.may_act():
            raise NotLeader(f"this scaler replica does not lead: {self.leader.follower_message()}")
        shards = self.shards
        if shards is not None and not shards.owns(job_id):
            owner = shards.owner_of(job_id)
            where = (
                f"owned by {owner.holder} at {owner.address or '?'}"
                if owner is not None and not owner.held_by(shards.me)
                else "its shard has no owner yet"
            )
            raise NotOwner(
                f"job {job_id!r} (shard {shards.shard_of(job_id)}) is decided by another"
                f" scaler replica: {where}"
            )

    def _loop_failed(self, what: str, exc: BaseException | None) -> None:
        """A line at most every LOOP_LOG_EVERY_S, however often the loop fails."""
        self.metrics.loop_failures.inc()
        mono = self.clock.monotonic()
        if mono - self._loop_logged_s < LOOP_LOG_EVERY_S:
            return
        self._loop_logged_s = mono
        logger.warning("%s%s", what, f": {exc}" if exc is not None else "")

    async def drain_triggers(self) -> None:
        """Evaluate the jobs whose window slid to meet their sustain condition, and those
        with a node notice, side by side (windows of many jobs slide together)."""
        due = self.triggers.take(
            lambda j, t: self.engine.window_view(j, t, 0, 0),
            self.policies,
            self.active,
            self.clock.now(),
        )
        due = [(j, t) for j, t in due if self.acts_on(j) and not self._finished(j)]
        if due:
            await self.evaluate_many(due)

    async def flush_rollups(self, *, final: bool = False) -> int:
        """Finished minutes of every known job to SQL, then retention (history.py)."""
        replicas = {j: r.current_replicas for j, r in self.jobs.items()}
        return await self.history.flush(replicas, final=final)

    # -- watchers ----------------------------------------------------------------------------

    def subscribe(self, job_id: str) -> asyncio.Queue[Watched | None]:
        return self.feed.subscribe(job_id)

    def unsubscribe(self, q: asyncio.Queue[Watched | None]) -> None:
        self.feed.unsubscribe(q)

    def _publish(self, d: DecisionRecord, detail: str) -> None:
        if d.state is not DecisionState.PENDING:
            self.pool.fulfilled(d.job_id)  # the actuator counts its GPUs from PREPARING on
        self.feed.publish(d, detail)
        for observe in self.observers:
            try:
                observe(d, detail)
            except Exception:
                logger.exception(
                    "decision %d: an observer failed",
                    d.id,
                    extra={"job_id": d.job_id, "decision_id": d.id},
                )
