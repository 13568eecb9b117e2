"""Throughput by world size: what a job measured, what an added replica gives, and who
gets the free GPUs when several jobs want them.

GPU utilization says whether a GPU is busy, not whether it helps: an NCCL
all-reduce keeps a GPU "busy" while it waits for its peers, so a job that
scaled past its best size still looks busy and the utilization rule would grow
it further. The coordinator reports each job's training throughput
(samples/s); :class:`ThroughputBook` keeps it per replica count, and the pure
functions here turn it into the two rules that use it (docs/policy.md):

- the goodput guard in ``policy.decide``: a scale-up whose throughput per added
  replica falls below ``min_scale_up_efficiency`` of what each replica gave
  before is not repeated, and one that made the job slower is reverted;
- the pool rule (``pool.arbitrate``): when more jobs want to grow than there
  are free GPUs, each next replica goes to the job whose next replica adds the
  most throughput per GPU, relative to what the job's GPUs give now.

Efficiency is relative (added throughput per replica over the job's throughput
per replica) because samples of two models are not comparable: one job's
sample may be a token, another's an image.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

#: A throughput measured this long ago no longer counts (the job may have changed:
#: another phase, another batch size); the guard lets the job try that size again.
MEMORY_S = 6 * 3600.0
#: Observations after a resize ends before the rate counts: the first steps of a new
#: generation warm up (group init, first collectives, input pipeline).
SETTLE_S = 30.0
#: Weight of a new observation in the running estimate of one size.
ALPHA = 0.2


def efficiency(curve: Mapping[int, float], a: int, b: int) -> float | None:
    """Throughput per replica added going from ``a`` to ``b`` replicas, as a fraction of
    the throughput per replica at ``a``; None when either size is unmeasured.
    1.0 is linear scaling, 0 no gain, below 0 slower."""
    ta, tb = curve.get(a), curve.get(b)
    if ta is None or tb is None or ta <= 0 or a <= 0 or b == a:
        return None
    return ((tb - ta) / (b - a)) / (ta / a)


def next_replica_efficiency(curve: Mapping[int, float], current: int, at: int) -> float:
    """What replica ``at + 1`` adds, per replica, relative to the throughput per replica
    at ``current``: the measured marginal throughput. Between measured sizes the curve
    is taken as linear; past the largest measured size the last measured step's gain
    goes on; with a single size measured nothing is known, and scaling is taken as
    linear (a job that never tried a bigger size is not penalised for it)."""
    base = curve.get(current)
    sizes = sorted(s for s, v in curve.items() if v > 0)
    if base is None or base <= 0 or not sizes:
        return 1.0
    per = base / current
    lower = [s for s in sizes if s <= at]
    upper = [s for s in sizes if s > at]
    if lower and upper:
        a, b = lower[-1], upper[0]
    elif len(lower) >= 2:
        a, b = lower[-2], lower[-1]
    else:
        return 1.0
    return ((curve[b] - curve[a]) / (b - a)) / per


class PoolRule(enum.Enum):
    """How free GPUs are shared among jobs that all want to grow."""

    #: The scaler's rule: each next replica to the job whose next replica adds most.
    MARGINAL = "marginal"
    #: First come, first served (the simulator's comparison).
    FCFS = "fcfs"


@dataclass(frozen=True)
class Claim:
    """A job that wants to grow: from its current size to the size its policy asked."""

    job_id: str
    current_replicas: int
    wanted_replicas: int
    gpus_per_replica: int = 1
    throughput: tuple[tuple[int, float], ...] = ()
    #: When the job started wanting to grow (first come, first served; ties).
    since_s: float = 0.0

    @property
    def wanted_gpus(self) -> int:
        return max(0, self.wanted_replicas - self.current_replicas) * self.gpus_per_replica

    def next_efficiency(self, at: int) -> float:
        return next_replica_efficiency(dict(self.throughput), self.current_replicas, at)


def allocate(free_gpus: int, claims: Sequence[Claim], rule: PoolRule) -> dict[str, int]:
    """Replicas granted to each claim out of ``free_gpus``; every claim has an entry."""
    granted = {c.job_id: 0 for c in claims}
    free = free_gpus
    if rule is PoolRule.FCFS:
        for c in sorted(claims, key=lambda c: (c.since_s, c.job_id)):
            n = min(c.wanted_replicas - c.current_replicas, free // max(1, c.gpus_per_replica))
            if n > 0:
                granted[c.job_id] = n
                free -= n * c.gpus_per_replica
        return granted
    heap: list[tuple[float, float, str, int]] = []
    by_id = {c.job_id: c for c in claims}
    for i, c in enumerate(claims):
        if c.wanted_replicas > c.current_replicas:
            heap.append((-c.next_efficiency(c.current_replicas), c.since_s, c.job_id, i))
    heapq.heapify(heap)
    while heap:
        _, since, job_id, i = heapq.heappop(heap)
        c = by_id[job_id]
        gpr = max(1, c.gpus_per_replica)
        if gpr > free:
            continue  # a smaller replica of another job may still fit
        granted[job_id] += 1
        free -= gpr
        at = c.current_replicas + granted[job_id]
        if at < c.wanted_replicas:
            heapq.heappush(heap, (-c.next_efficiency(at), since, job_id, i))
    return granted


@dataclass
class _Estimate:
    samples_per_s: float
    at_s: float


class ThroughputBook:
    """Per job, the training throughput measured at each replica count.

    Fed from the coordinator's job status (``samples_per_s``) while the job runs
    at a steady size: no resize in progress and at least :data:`SETTLE_S` after
    the last one ended. No I/O; the scaler restores it at start from the evidence
    stored with the job's last decision."""

    def __init__(self) -> None:
        self._curves: dict[str, dict[int, _Estimate]] = {}

    def observe(self, job_id: str, replicas: int, samples_per_s: float, now_s: float) -> None:
        if replicas <= 0 or not samples_per_s > 0:
            return
        curve = self._curves.setdefault(job_id, {})
        e = curve.get(replicas)
        if e is None or now_s - e.at_s > MEMORY_S:
            curve[replicas] = _Estimate(samples_per_s, now_s)
        else:
            e.samples_per_s += ALPHA * (samples_per_s - e.samples_per_s)
            e.at_s = now_s

    def settled(
        self,
        job_id: str,
        replicas: int,
        world_size: int,
        samples_per_s: float,
        resize_ended_s: float | None,
        now_s: float,
    ) -> None:
        """A status report of a job not resizing: counted once its size has settled
        (:data:`SETTLE_S` after the last resize ended) and the coordinator's world is
        the job's replicas."""
        if resize_ended_s is not None and now_s - resize_ended_s < SETTLE_S:
            return
        if world_size == replicas:
            self.observe(job_id, replicas, samples_per_s, now_s)

    def restore(self, job_id: str, points: Iterable[tuple[int, float]], at_s: float) -> None:
        """Seed a job's curve (the evidence of its last decision), measured at ``at_s``."""
        for replicas, v in points:
            if replicas > 0 and v > 0:
                self._curves.setdefault(job_id, {})[replicas] = _Estimate(v, at_s)

    def curve(self, job_id: str, now_s: float) -> tuple[tuple[int, float], ...]:
        """(replicas, samples/s) measured within :data:`MEMORY_S`, by replicas."""
        curve = self._curves.get(job_id, {})
        return tuple(
            (r, e.samples_per_s) for r, e in sorted(curve.items()) if now_s - e.at_s <= MEMORY_S
        )

    def drop(self, job_id: str) -> None:
        self._curves.pop(job_id, None)
