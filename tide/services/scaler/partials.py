"""Partial aggregates: what a replica ships to the replica that owns a job.

With jobs sharded across replicas (tide/services/scaler/leases.py), an agent streams to
any replica. The replica that receives a sample of a job it does not own folds it,
per job, into the slot of the job's window and the second of its rollup minute,
exactly as the owner would, and keeps no window of its own for the job. Each
shipment holds, per job: the slots' partial sums and counts, the seconds' sums,
counts, minimum and maximum, and the last sample time of each of the job's GPUs
that reported here (the coverage). That is a few numbers per job per slot, however
many nodes reported. The owner adds them to its window and rollups and counts the
GPUs as fresh under the same staleness rule as its own (Ingest.merge_partials),
so its windows are the ones a single replica would hold.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from tide.services.scaler.windows import slots_per_bucket
from tide.v1 import telemetry_pb2


@dataclass
class JobPartial:
    job_id: str
    #: The window shape the slots were cut for; the owner drops slots of another shape
    #: (a policy change in flight), as it resets its own window then.
    bucket_s: float
    buckets: int
    #: slot → [sum of utilization, samples, GPM samples, SM activity sum, tensor
    #: activity sum] (SLOT_WIDTH numbers; JobWindow.slots)
    slots: dict[int, list[float]] = field(default_factory=dict)
    #: epoch second → [sum, samples, min, max] (the rollups)
    seconds: dict[int, list[float]] = field(default_factory=dict)
    #: (node, GPU index) → the last sample time of each of the job's GPUs on the
    #: sender's nodes. By GPU, not a count: a node that moved to another replica is
    #: still fresh in its old one's last shipment, and must count once.
    seen_s: dict[tuple[str, int], float] = field(default_factory=dict)


#: Numbers per slot of a partial: JobWindow.add's arguments after the slot.
SLOT_WIDTH = 5


def widened(v: list[float]) -> list[float]:
    """A slot as SLOT_WIDTH numbers (a slot of [sum, samples]: no GPM samples)."""
    return v + [0.0] * (SLOT_WIDTH - len(v)) if len(v) < SLOT_WIDTH else v


class Partials:
    """Partial aggregates gathered since the last shipment."""

    def __init__(self) -> None:
        self._acc: dict[str, JobPartial] = {}

    def add(
        self,
        job_id: str,
        shape: tuple[float, int],
        slot: int,
        t: float,
        total: float,
        count: int,
        lo: float,
        hi: float,
        gpm: float = 0.0,
        sm: float = 0.0,
        tensor: float = 0.0,
    ) -> None:
        p = self._acc.get(job_id)
        if p is None or (p.bucket_s, p.buckets) != shape:
            p = self._acc[job_id] = JobPartial(job_id, shape[0], shape[1])
        s = p.slots.get(slot)
        if s is None:
            p.slots[slot] = [total, count, gpm, sm, tensor]
        else:
            s[0] += total
            s[1] += count
            if gpm:
                s[2] += gpm
                s[3] += sm
                s[4] += tensor
        sec = int(t)
        r = p.seconds.get(sec)
        if r is None:
            p.seconds[sec] = [total, count, lo, hi]
        else:
            r[0] += total
            r[1] += count
            if lo < r[2]:
                r[2] = lo
            if hi > r[3]:
                r[3] = hi

    def take(self) -> dict[str, JobPartial]:
        out, self._acc = self._acc, {}
        return out


_UNCORDONED = telemetry_pb2.NodeEvent.KIND_UNCORDONED


@dataclass(frozen=True)
class NodeNotice:
    """A node's termination notice or cordon, for one job with pods on the node: what a
    replica that saw it on its agent stream ships to the job's owner with its partials.
    Resent every shipment while active, so an owner that gained the job's shard since
    learns it within one shipment; equal ones are one notice (applied once)."""

    job_id: str
    node: str
    #: telemetry NodeEvent.Kind: KIND_TERMINATION_NOTICE or KIND_CORDONED; KIND_UNCORDONED
    #: withdraws the node's notice (``withdrawn``).
    kind: int
    #: Unix seconds by which the node goes; None: the notice named none.
    deadline_s: float | None
    #: The job's pods on the node (uid, else name: as its GPUs were attributed).
    pods: frozenset[str]

    @property
    def withdrawn(self) -> bool:
        """The node was uncordoned: the owner drops its copy of the node's notice."""
        return self.kind == _UNCORDONED


@dataclass
class _Sent:
    bucket_s: float
    buckets: int
    #: The address the job's slots last went to; a different one now: its shard moved.
    owner: str
    #: slot → [sum, samples] shipped so far, the window's span only.
    slots: dict[int, list[float]] = field(default_factory=dict)


class Shipped:
    """The window slots this replica has already shipped, per job it forwards, so that a
    job's new owner gets them too (its window is otherwise empty after a shard moves).

    Cumulative [sum, samples] per slot, for the job's current window shape, pruned to
    the slots the window still spans: a few hundred numbers per job at most, updated
    once per shipment, never per report. Only window slots: a rollup second already
    went into the old owner's closed minutes, and replaying it would count it twice.
    """

    def __init__(self) -> None:
        self._jobs: dict[str, _Sent] = {}

    def outgoing(self, p: JobPartial, owner: str) -> JobPartial:
        """``p`` as it goes to ``owner``: with every slot shipped before (to another
        owner) added when the job's owner changed, so the new owner gets each sample this
        replica shipped within the window once. ``p``'s own slots are retained after."""
        s = self._jobs.get(p.job_id)
        if s is not None and (s.bucket_s, s.buckets) != (p.bucket_s, p.buckets):
            # The window was reshaped: its owner resets its window too.
            s = None
        if s is None:
            s = self._jobs[p.job_id] = _Sent(p.bucket_s, p.buckets, owner)
        out = p
        if s.owner != owner and s.slots:
            replayed = _summed(s.slots, p.slots)
            out = JobPartial(p.job_id, p.bucket_s, p.buckets, replayed, p.seconds, p.seen_s)
        s.owner = owner
        s.slots = _summed(s.slots, p.slots)
        _prune(s)
        return out

    def retain(self, p: JobPartial) -> None:
        """``p``'s slots, not shipped (no owner to ship to, or the owner's last shipment
        still on its way): kept without naming an owner that has them, so the job's next
        owner gets them in its replay."""
        s = self._jobs.get(p.job_id)
        if s is None or (s.bucket_s, s.buckets) != (p.bucket_s, p.buckets):
            # No owner has them: the first one shipped to gets them.
            s = self._jobs[p.job_id] = _Sent(p.bucket_s, p.buckets, "")
        s.slots = _summed(s.slots, p.slots)
        _prune(s)

    def jobs(self) -> list[str]:
        return list(self._jobs)

    def moved(self, owner_of: Callable[[str], str | None], skip: set[str]) -> list[JobPartial]:
        """Replays, for the jobs not in this shipment (``skip``) whose owner changed
        since their slots last went out: the slots alone."""
        out = []
        for job_id, s in self._jobs.items():
            if job_id in skip or not s.slots:
                continue
            owner = owner_of(job_id)
            if owner is None or owner == s.owner:
                continue
            s.owner = owner
            out.append(JobPartial(job_id, s.bucket_s, s.buckets, _summed(s.slots, {})))
        return out

    def take(self, job_id: str) -> JobPartial | None:
        """The job's retained slots, forgotten here: this replica now owns the job and
        adds them to its own window (they went to the old owner, whose window is gone)."""
        s = self._jobs.pop(job_id, None)
        if s is None or not s.slots:
            return None
        return JobPartial(job_id, s.bucket_s, s.buckets, s.slots)

    def keep(self, job_ids: Collection[str]) -> None:
        """Forget the jobs not in ``job_ids`` (deleted)."""
        for job_id in [j for j in self._jobs if j not in job_ids]:
            del self._jobs[job_id]

    def slots_of(self, job_id: str) -> dict[int, list[float]]:
        s = self._jobs.get(job_id)
        return {} if s is None else s.slots


def _summed(a: dict[int, list[float]], b: dict[int, list[float]]) -> dict[int, list[float]]:
    out = {k: widened(list(v)) for k, v in a.items()}
    for k, v in b.items():
        r = out.get(k)
        if r is None:
            out[k] = widened(list(v))
        else:
            for i, x in enumerate(v):
                r[i] += x
    return out


def _prune(s: _Sent) -> None:
    """Keep the slots the owner's ring still holds (JobWindow: the newest slot and the
    n - 1 before it); anything older can no longer count."""
    if not s.slots:
        return
    n = (s.buckets + 1) * slots_per_bucket(s.bucket_s, s.buckets) + 1
    oldest = max(s.slots) - n + 1
    for k in [k for k in s.slots if k < oldest]:
        del s.slots[k]
