"""The job registry: every job this replica knows, as the store has it, and what the
policy remembers of each between evaluations.

Pure memory: nothing here reads or writes the store. The rooms that do (custody,
the decision driver) tell the book what the store now says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tide.base.errors import NotFound
from tide.services.scaler import policy as pol
from tide.services.scaler.goodput import ThroughputBook
from tide.services.scaler.metrics import ScalerMetrics
from tide.services.scaler.store import DecisionRecord, DecisionState, JobRecord

#: PolicySettings fields stored as job columns rather than overrides.
BOUNDS = ("min_replicas", "max_replicas")


@dataclass(frozen=True)
class Evaluation:
    """A job's last answer, and when it was given."""

    decision: pol.Decision
    at_s: float


def leaving_of(d: DecisionRecord) -> frozenset[str] | None:
    """The pods a preemption drains; None for any other decision."""
    if d.trigger != pol.Trigger.EMERGENCY.name:
        return None
    return frozenset(str(p) for p in d.inputs.get("leaving_pods", []) or [])


def _direction(d: DecisionRecord) -> int:
    return (d.to_replicas > d.from_replicas) - (d.to_replicas < d.from_replicas)


class JobBook:
    """Jobs, their effective policies, the decision each has in flight, and the memory
    the policy reads (the last resize's direction and size, recent recommendations,
    the measured throughput curve)."""

    def __init__(self, defaults: pol.PolicySettings, metrics: ScalerMetrics) -> None:
        self.defaults = defaults
        self.metrics = metrics
        self.jobs: dict[str, JobRecord] = {}
        self.policies: dict[str, pol.PolicySettings] = {}
        self.evaluations: dict[str, Evaluation] = {}
        #: The decision in flight per job.
        self.active: dict[str, int] = {}
        #: The pods each decision in flight drains, by decision id (None: not a preemption).
        self.leaving: dict[int, frozenset[str] | None] = {}
        self.throughput = ThroughputBook()
        self._recs: dict[str, list[tuple[float, int]]] = {}
        self._last_dir: dict[str, int] = {}
        self._last_from: dict[str, int] = {}
        #: Replicas the actuator is still asked for after a member was lost without
        #: notice (the last completed decision was MEMBER_LOST): its from_replicas.
        self.asked: dict[str, int] = {}

    def get(self, job_id: str) -> JobRecord:
        job = self.jobs.get(job_id)
        if job is None:
            raise NotFound(f"job {job_id!r} not found")
        return job

    def policy_of(self, job: JobRecord) -> pol.PolicySettings:
        overrides = {k: v for k, v in job.policy_overrides.items() if k not in BOUNDS}
        return self.defaults.with_overrides(
            {**overrides, "min_replicas": job.min_replicas, "max_replicas": job.max_replicas}
        )

    def merged_policy(
        self, job_id: str, overrides: Mapping[str, Any], clear: Sequence[str]
    ) -> tuple[pol.PolicySettings, dict[str, Any]]:
        """The policy ``job_id`` would have with ``overrides`` set and ``clear`` removed
        (validated in full: ConfigError names the field), and the overrides to store
        other than the bounds (which are columns)."""
        existing = self.jobs.get(job_id)
        bounds = {k: overrides[k] for k in BOUNDS if overrides.get(k) is not None}
        rest = {k: v for k, v in overrides.items() if k not in BOUNDS and v is not None}
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
        return base.with_overrides({**rest, **bounds}), rest

    def shape(self, job_id: str) -> tuple[float, int]:
        """The job's window shape: bucket length and count."""
        p = self.policies.get(job_id, self.defaults)
        return p.bucket_s, p.buckets

    def deadline_of(self, job_id: str) -> float:
        return self.policies.get(job_id, self.defaults).phase_timeout_s

    def know(self, job: JobRecord) -> bool:
        """Hold ``job`` as the store has it; returns whether its windows must be
        reshaped (its bucket or sustain window changed)."""
        old = self.policies.get(job.job_id)
        p = self.policy_of(job)
        self.jobs[job.job_id] = job
        self.policies[job.job_id] = p
        self.metrics.job(job, p, resizing=job.job_id in self.active)
        return old is not None and (old.bucket_s, old.sustain_s) != (p.bucket_s, p.sustain_s)

    def track(self, record: DecisionRecord) -> None:
        """A decision not final is the job's one in flight, with the pods it drains."""
        self.active[record.job_id] = record.id
        self.leaving[record.id] = leaving_of(record)
        self.metrics.decision_started(record)

    def restore_last(self, job_id: str, last: DecisionRecord) -> None:
        """What the job's last completed resize tells the policy and the goodput guard."""
        self._note_asked(last)
        self._last_dir[job_id] = _direction(last)
        self._last_from[job_id] = last.from_replicas
        measured = (last.inputs.get("goodput") or {}).get("throughput_by_replicas")
        if measured:
            self.throughput.restore(
                job_id,
                ((int(r), float(v)) for r, v in measured.items()),
                last.created_at.timestamp(),
            )

    def finished(self, d: DecisionRecord) -> None:
        """``d`` is final: mirror what the store did in the same transaction, so the
        very next evaluation sees the new size and the cooldown without a read."""
        if self.active.get(d.job_id) == d.id:
            del self.active[d.job_id]
        self.leaving.pop(d.id, None)
        job = self.jobs.get(d.job_id)
        if job is not None:
            changes: dict[str, Any] = {"last_resize_ended_at": d.ended_at}
            if d.state is DecisionState.COMPLETED:
                changes["current_replicas"] = d.to_replicas
                changes["generation"] = max(job.generation, d.generation)
                self._note_asked(d)
            if d.state is DecisionState.COMPLETED and d.reason != pol.Reason.RECONCILE.name:
                # A correction puts back the recorded size: not a resize the goodput
                # guard or the direction rules should learn from.
                self._last_dir[d.job_id] = _direction(d)
                self._last_from[d.job_id] = d.from_replicas
            self.jobs[d.job_id] = dataclasses.replace(job, **changes)
            self.metrics.decision_finished(d, self.jobs[d.job_id].current_replicas)
        self._recs.pop(d.job_id, None)

    def forget_recommendations(self, job_id: str) -> None:
        self._recs.pop(job_id, None)

    def history(self, job_id: str, at: float) -> pol.History:
        """What the policy remembers of the job at ``at``."""
        job = self.jobs[job_id]
        last_end = job.last_resize_ended_at.timestamp() if job.last_resize_ended_at else None
        return pol.History(
            last_end,
            self._last_dir.get(job_id, 0),
            tuple(self._recs.get(job_id, ())),
            last_from_replicas=self._last_from.get(job_id, 0),
            throughput=self.throughput.curve(job_id, at),
        )

    def recommended(self, job_id: str, at: float, replicas: int, window_s: float) -> None:
        """The policy recommended ``replicas`` at ``at``: kept for ``window_s`` (the
        scale-down stabilization window)."""
        recs = self._recs.setdefault(job_id, [])
        recs.append((at, replicas))
        horizon = at - window_s
        while recs and recs[0][0] < horizon:
            recs.pop(0)

    def _note_asked(self, d: DecisionRecord) -> None:
        """After a completed decision: what the actuator is asked for, if not its size."""
        if d.reason == pol.Reason.MEMBER_LOST.name:
            self.asked.setdefault(d.job_id, d.from_replicas)
        else:
            self.asked.pop(d.job_id, None)
