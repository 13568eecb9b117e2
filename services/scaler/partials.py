"""Partial aggregates: what a replica ships to the replica that owns a job.

With jobs sharded across replicas (services/scaler/shards.py), an agent streams to
any replica. The replica that receives a sample of a job it does not own folds it,
per job, into the slot of the job's window and the second of its rollup minute,
exactly as the owner would, and keeps no window of its own for the job. Each
shipment holds, per job: the slots' partial sums and counts, the seconds' sums,
counts, minimum and maximum, and the last sample time of each of the job's GPUs
that reported here (the coverage). That is a few numbers per job per slot, however
many nodes reported. The owner adds them to its window and rollups and counts the
GPUs as fresh under the same staleness rule as its own (IngestEngine.merge_partials),
so its windows are the ones a single replica would hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tide.v1 import telemetry_pb2


@dataclass
class JobPartial:
    job_id: str
    #: The window shape the slots were cut for; the owner drops slots of another shape
    #: (a policy change in flight), as it resets its own window then.
    bucket_s: float
    buckets: int
    #: slot → [sum of utilization, samples]
    slots: dict[int, list[float]] = field(default_factory=dict)
    #: epoch second → [sum, samples, min, max] (the rollups)
    seconds: dict[int, list[float]] = field(default_factory=dict)
    #: (node, GPU index) → the last sample time of each of the job's GPUs on the
    #: sender's nodes. By GPU, not a count: a node that moved to another replica is
    #: still fresh in its old one's last shipment, and must count once.
    seen_s: dict[tuple[str, int], float] = field(default_factory=dict)


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
    ) -> None:
        p = self._acc.get(job_id)
        if p is None or (p.bucket_s, p.buckets) != shape:
            p = self._acc[job_id] = JobPartial(job_id, shape[0], shape[1])
        s = p.slots.get(slot)
        if s is None:
            p.slots[slot] = [total, count]
        else:
            s[0] += total
            s[1] += count
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
