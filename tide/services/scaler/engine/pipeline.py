"""The evaluation pipeline: stage (the policy's answer for each job, no I/O),
arbitrate (the pool shares free GPUs among the jobs that want them), commit (the
resizes written in one transaction and handed to the decision driver).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tide.base.errors import TideError
from tide.services.common import logs
from tide.services.common.clock import Clock
from tide.services.scaler import policy as pol
from tide.services.scaler.actuators import Actuator
from tide.services.scaler.convert import decision_inputs
from tide.services.scaler.engine.decisions import DecisionDriver
from tide.services.scaler.engine.jobs import Evaluation, JobBook
from tide.services.scaler.engine.ownership import Ownership
from tide.services.scaler.errors import DecisionInProgress, StaleEpoch
from tide.services.scaler.ingest import Ingest
from tide.services.scaler.members import CoordinatorMemberRegistry
from tide.services.scaler.metrics import ScalerMetrics
from tide.services.scaler.pool import PoolClaims
from tide.services.scaler.preemption import plan_notice
from tide.services.scaler.store import DecisionRecord
from tide.services.scaler.triggers import Triggers
from tide.services.scaler.tuning import YIELD_EVERY_JOBS

logger = logging.getLogger(__name__)


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


class Pipeline:
    def __init__(
        self,
        *,
        clock: Clock,
        actuator: Actuator,
        book: JobBook,
        ownership: Ownership,
        ingest: Ingest,
        members: CoordinatorMemberRegistry,
        pool: PoolClaims,
        triggers: Triggers,
        driver: DecisionDriver,
        metrics: ScalerMetrics,
    ) -> None:
        self.clock = clock
        self.actuator = actuator
        self.book = book
        self.ownership = ownership
        self.ingest = ingest
        self.members = members
        self.pool = pool
        self.triggers = triggers
        self.driver = driver
        self.metrics = metrics
        # One evaluation (or batch) at a time: a batch decides for all its jobs before
        # any commits, and a job is never evaluated twice at once.
        self.lock = asyncio.Lock()
        #: Per job, the inputs of its last evaluation and the answer, until the time
        #: the policy says that answer may change (``policy.answer_holds_until``).
        self._memo: dict[str, tuple[tuple[Any, ...], pol.Decision, float]] = {}
        #: Evaluations of the pass over every job answered from ``_memo`` (a plain int;
        #: bench.scale and the tests read it).
        self.reused = 0
        #: Whether the pass answers unchanged jobs from ``_memo`` (bench.tick turns it
        #: off to measure the pass that decides every job).
        self.reuse_answers = True

    # -- the job as the policy sees it --------------------------------------------------

    def doomed(self, job_id: str) -> tuple[set[str], str, float | None]:
        """Pods of the job that must go: on nodes with a notice (one such node, the
        earliest deadline), and those whose launcher asked to leave (SIGTERM)."""
        pods, node, deadline = self.ingest.terminating_pods(job_id)
        leaving = [
            m
            for m in self.members.members(job_id)
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
        job = self.book.get(job_id)
        pods, node, deadline = self.doomed(job_id)
        in_flight = self.book.active.get(job_id, 0)
        return pol.JobState(
            job_id=job_id,
            current_replicas=job.current_replicas,
            gpus_per_replica=job.gpus_per_replica,
            paused=job.autoscaling_paused,
            resize_in_progress=job_id in self.book.active,
            free_gpus=free_gpus,
            terminating_replicas=len(pods),
            terminating_node=node,
            terminating_deadline_s=deadline,
            terminating_pods=frozenset(pods),
            in_flight_decision=in_flight,
            in_flight_leaving=self.book.leaving.get(in_flight),
        )

    def window_of(
        self, job_id: str, now: float, fresh: Mapping[str, int] | None = None
    ) -> pol.WindowView:
        job = self.book.get(job_id)
        # Alone (a trigger's evaluation), only the job's own nodes are read; the tick,
        # which evaluates every job, counts the whole fleet once and passes it in.
        n = self.ingest.fresh_gpus_of(job_id, now) if fresh is None else fresh.get(job_id, 0)
        expected = job.current_replicas * job.gpus_per_replica
        return self.ingest.window_view(job_id, now, expected, n)

    # -- evaluating ------------------------------------------------------------------------

    async def evaluate(
        self, job_id: str, *, tipping_s: float | None = None, fresh: Mapping[str, int] | None = None
    ) -> pol.Decision:
        """Evaluate one job now (its errors raised to the caller)."""
        async with self.lock:
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
        async with self.lock:
            raw = await self.actuator.free_gpus()
            staged: list[tuple[_Staged, float]] = []
            for n, (job_id, tipping_s) in enumerate(items, 1):
                if n % YIELD_EVERY_JOBS == 0:
                    await asyncio.sleep(0)
                with self.guard(job_id):
                    t0 = time.perf_counter()
                    st = self._stage(job_id, tipping_s, fresh, raw, reuse=reuse)
                    if st.reused:
                        # Nothing to share or commit: the last answer, at this time.
                        self.book.evaluations[job_id] = Evaluation(st.decision, st.now)
                    else:
                        staged.append((st, time.perf_counter() - t0))
            await self._commit_batch(staged)

    async def manual(
        self, job_id: str, replicas: int, reason: str, requested_by: str
    ) -> DecisionRecord:
        """A resize asked by an operator (``policy.manual``), written and carried out."""
        job = self.book.get(job_id)
        p = self.book.policies[job_id]
        free = await self.actuator.free_gpus()
        d = pol.manual(self.job_state(job_id, free), p, replicas, reason)
        now = self.clock.now()
        view = self.window_of(job_id, now)
        inputs = decision_inputs(job.current_replicas, p, view, free, d, now)
        try:
            return await self.driver.create(d, inputs, requested_by)
        except DecisionInProgress as exc:
            raise DecisionInProgress(str(exc)) from None

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
        last evaluation and the policy said that answer holds until later than now,
        the answer is that one again (``decide`` is pure), and nothing is decided,
        published or shared."""
        free = self.pool.free(raw_free)
        self.book.get(job_id)  # NotFound for a job the book does not hold
        p = self.book.policies[job_id]
        now = self.clock.now()
        seen = self.triggers.seen_at.pop(job_id, now) if tipping_s is not None else now
        # An agent clock slightly ahead must not hide the slot it just opened.
        at = max(now, tipping_s) if tipping_s is not None else now
        state = self.job_state(job_id, free)
        view = self.window_of(job_id, at, fresh)
        hist = self.book.history(job_id, at)
        key = pol.inputs_key(state, view, p, hist)
        memo = self._memo.get(job_id)
        reused = reuse and memo is not None and memo[0] == key and at < memo[2]
        if reused:
            assert memo is not None
            d = memo[1]
            self.reused += 1
        else:
            d = pol.decide(state, view, p, hist, at)
            self.metrics.window(job_id, view)
            until = pol.answer_holds_until(d, state, view, p, hist, at)
            if until > at:
                self._memo[job_id] = (key, d, until)
            else:
                self._memo.pop(job_id, None)
        if d.recommendation is not None:
            self.book.recommended(job_id, at, d.recommendation, p.scale_down_stabilization_s)
        if not reused:
            # A reused answer neither wants GPUs nor held a claim (answer_holds_until).
            self.pool.note(d, state, hist.throughput, at)
        return _Staged(d, state, view, p, hist, raw_free, at, now, seen, tipping_s, reused=reused)

    async def _commit(self, st: _Staged) -> pol.Decision:
        """The pool step, then a resize is committed (PENDING) and handed to the driver."""
        d, inputs = self._prepare(st)
        if inputs is None:
            return d
        try:
            record = await self.driver.persist(d, inputs, "")
        except DecisionInProgress:
            self.pool.fulfilled(d.job_id)
            return d
        except BaseException:
            self.pool.fulfilled(d.job_id)
            raise
        self._created(st, d, record)
        return d

    def _prepare(self, st: _Staged) -> tuple[pol.Decision, dict[str, Any] | None]:
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
        if not self.ownership.acts_on(job_id):
            return d, None  # its shard went while the batch was staged: the new owner decides
        self.book.evaluations[job_id] = Evaluation(d, st.now)
        if d.supersedes:
            self.driver.supersede(job_id, d.supersedes, d.message)
            return d, None
        if not d.resize:
            return d, None
        job = self.book.get(job_id)
        inputs = decision_inputs(
            job.current_replicas, st.policy, st.view, state.free_gpus, d, st.at
        )
        if d.trigger is pol.Trigger.EMERGENCY:
            inputs.update(self._notice_inputs(job_id, st.policy))
        if d.direction > 0:
            self.pool.promise(job_id, (d.to_replicas - d.from_replicas) * job.gpus_per_replica)
        return d, inputs

    def _notice_inputs(self, job_id: str, p: pol.PolicySettings) -> dict[str, Any]:
        """What a preemption records of the pods it drains and the notice's plan."""
        pods, node, deadline = self.doomed(job_id)
        plan = plan_notice(
            p.phase_timeout_s,
            deadline,
            self.clock.now(),
            self.driver.controller.checkpoint_s.get(job_id),
        )
        return {
            "leaving_pods": sorted(pods),
            # Their names too, for the actuator: a pod named by uid that is gone before
            # the replicas drop (its launcher left on SIGTERM) is found by name only.
            "leaving_pod_names": sorted(
                m.pod_name
                for m in self.members.members(job_id)
                if m.pod_name in pods or (m.pod_uid and m.pod_uid in pods)
            ),
            "node_name": node,
            "node_deadline_s": deadline,
            "barrier_deadline_s": plan.barrier_deadline_s,
            "notice_plan": {"reason": plan.reason.name, "message": plan.message},
        }

    def _created(self, st: _Staged, d: pol.Decision, record: DecisionRecord) -> None:
        """A decision of the policy is written: the driver takes it from here."""
        self.driver.launch(record, d.message, started_s=st.tipping_s)
        job_id = d.job_id
        if st.tipping_s is not None:
            done = self.clock.now()
            self.metrics.observe_decision(
                done - st.tipping_s, (st.seen - st.tipping_s, st.now - st.seen, done - st.now)
            )
            self.driver.trace_evaluation(
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
        driver. Jobs that tip together (a bucket boundary, a burst of reports) are one
        write instead of one each. Should the batch fail as a whole, each decision is
        written alone, so one job's error ends only that job's evaluation."""
        writes: list[tuple[_Staged, pol.Decision, dict[str, Any], float]] = []
        for n, (st, spent) in enumerate(staged, 1):
            if n % YIELD_EVERY_JOBS == 0:
                await asyncio.sleep(0)
            with self.guard(st.job_id):
                t0 = time.perf_counter()
                d, inputs = self._prepare(st)
                if inputs is None:
                    self.metrics.evaluation.observe(spent + time.perf_counter() - t0)
                else:
                    writes.append((st, d, inputs, spent + time.perf_counter() - t0))
        if not writes:
            return
        t0 = time.perf_counter()
        results: Sequence[DecisionRecord | TideError | None]
        try:
            results = await self.driver.persist_many([(d, i) for _, d, i, _ in writes])
        except Exception as exc:
            # Any error, not only the store's: a job's shard dropped since it was
            # staged (no epoch) must not end the loop; alone, each write is guarded.
            logger.warning("a batch of %d decisions failed, writing each: %s", len(writes), exc)
            results = [None] * len(writes)
        shared = (time.perf_counter() - t0) / len(writes)
        for (st, d, inputs, spent), result in zip(writes, results, strict=True):
            with self.guard(st.job_id):
                t1 = time.perf_counter()
                try:
                    if result is None:
                        result = await self.driver.persist(d, inputs, "")
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

    @contextlib.contextmanager
    def guard(self, job_id: str) -> Iterator[None]:
        """One job's evaluation failing is logged; a fenced job is no longer evaluated."""
        try:
            with logs.bound(job_id=job_id):
                yield
        except StaleEpoch as exc:
            self.ownership.fence(job_id, exc)
        except TideError as exc:
            logger.warning("job %s: evaluation failed: %s", job_id, exc, extra={"job_id": job_id})
        except Exception:
            logger.exception("job %s: evaluation failed", job_id, extra={"job_id": job_id})
