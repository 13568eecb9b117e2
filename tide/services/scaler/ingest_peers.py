"""The ingest's side of sharding: where a report's samples of a job go (its window here,
or partial aggregates for the replica that owns it), what a replica ships of the jobs
owned elsewhere (those partials, the notices of their nodes) and what it merges of the
jobs it owns, as if the samples had come to it. A part of :class:`Ingest`
(tide/services/scaler/ingest.py), over its state."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from tide.services.common.clock import Clock
from tide.services.scaler.ingest_state import IngestSettings, NodeState, WindowShape
from tide.services.scaler.partials import JobPartial, NodeNotice, Partials, widened
from tide.services.scaler.windows import JobWindow, Rollups
from tide.v1 import telemetry_pb2

_INF = math.inf
_EVENT = telemetry_pb2.NodeEvent


class PeerExchange:
    """Partials and notices between replicas; :class:`Ingest` holds the state."""

    settings: IngestSettings
    clock: Clock
    _shape: WindowShape
    nodes: dict[str, NodeState]
    job_nodes: dict[str, dict[str, NodeState]]
    windows: dict[str, JobWindow]
    merged: dict[str, JobWindow]
    _last_slot: dict[str, int]
    rollups: Rollups
    forward: Callable[[str], bool] | None
    partials: Partials
    remote_seen: dict[str, dict[tuple[str, int], float]]
    noticed: dict[str, NodeState]
    on_slot: Callable[[str, float], None] | None
    on_notice: Callable[[str], None] | None
    on_forward_notice: Callable[[], None] | None
    remote_notices: dict[str, dict[str, tuple[NodeNotice, float]]]
    withdrawn: dict[str, tuple[float, dict[str, frozenset[str]]]]
    samples_unattributed: int

    def _new_window(self, job_id: str, bucket_s: float, buckets: int) -> JobWindow:
        raise NotImplementedError

    def _apply(
        self,
        node: NodeState,
        job: str | None,
        t: float,
        total: float,
        count: float,
        lo: float,
        hi: float,
        gc: float,
        sm: float,
        te: float,
    ) -> None:
        """Add a report's samples of one job (sum, count, min, max, GPM count, SM and
        tensor sums) to its window and rollups, or to its partials when it is owned
        elsewhere."""
        if job is None:
            self.samples_unattributed += int(count)
            return
        held = self.job_nodes.get(job)
        if held is None:
            self.job_nodes[job] = {node.name: node}
        elif node.name not in held:
            held[node.name] = node
        w = self.windows.get(job)
        if w is None:
            bucket_s, buckets = self._shape(job)
            w = self.windows[job] = self._new_window(job, bucket_s, buckets)
        slot = int((t - w.offset_s) // w.slot_s)
        forward = self.forward
        if forward is not None and forward(job):
            self.partials.add(
                job, (w.bucket_s, w.buckets), slot, t, total, int(count), lo, hi, gc, sm, te
            )
            return
        w.add(slot, total, int(count), int(gc), sm, te)
        self.rollups.add(job, t, total, int(count), lo, hi)
        self._note_slot(job, slot, t)

    def _note_slot(self, job: str, slot: int, t: float) -> None:
        """``slot`` of the job's window took samples (at ``t``): the first past the last
        one seen opens a new slot, the window slid, and the policy may see its condition
        hold now (``on_slot``)."""
        last = self._last_slot.get(job)
        if last is None or slot > last:
            self._last_slot[job] = slot
            if last is not None and self.on_slot is not None:
                self.on_slot(job, t)

    def own_partial(self, job_id: str) -> JobPartial | None:
        """The job's window less what other replicas shipped into it: the samples of this
        replica's own agents, as a partial (slots only), for the job's next owner when
        this replica gives the shard up (Sharding: they would be lost with the window)."""
        w = self.windows.get(job_id)
        if w is None:
            return None
        m_ring = self.merged.get(job_id)
        merged = m_ring.slots() if m_ring is not None else {}
        own: dict[int, list[float]] = {}
        for slot, v in w.slots().items():
            m = merged.get(slot)
            if m is not None:
                v = [x - y for x, y in zip(v, m, strict=True)]
            if v[1] > 0:
                own[slot] = v
        if not own:
            return None
        return JobPartial(job_id, w.bucket_s, w.buckets, own)

    def take_partials(self) -> list[JobPartial]:
        """What was gathered for jobs owned elsewhere since the last call, each with the
        coverage of the job's GPUs here (read from the job's nodes only)."""
        out = list(self.partials.take().values())
        for p in out:
            for node in self.job_nodes.get(p.job_id, {}).values():
                for i, (j, s) in enumerate(zip(node.gpus.job, node.gpus.seen_s, strict=True)):
                    if j == p.job_id:
                        p.seen_s[(node.name, i)] = s
        return out

    def merge_partials(
        self, sender: str, parts: Iterable[JobPartial], *, own: bool = False
    ) -> None:
        """Add another replica's partial aggregates of jobs owned here to their windows
        and rollups, as if its samples had come here. ``own``: this replica's own agents'
        samples, shipped to an earlier owner (``Sharding._absorb``); the others' are
        counted per slot too (``merged``), to tell them from this replica's own when it
        gives the job up (``own_partial``)."""
        horizon = self.clock.now() - self.settings.stale_after_s
        for p in parts:
            job = p.job_id
            seen = self.remote_seen.setdefault(job, {})
            for gpu, s in p.seen_s.items():
                if s > seen.get(gpu, -_INF):
                    seen[gpu] = s
            for gpu in [g for g, s in seen.items() if s < horizon]:
                del seen[gpu]  # stale already: it counts for nothing, now or later
            bucket_s, buckets = self._shape(job)
            if (p.bucket_s, p.buckets) == (bucket_s, buckets):
                w = self.windows.get(job)
                if w is None or w.bucket_s != bucket_s or w.buckets != buckets:
                    w = self.windows[job] = self._new_window(job, bucket_s, buckets)
                merged = None if own else self.merged.get(job)
                if not own and (merged is None or merged.shape != w.shape):
                    merged = self.merged[job] = JobWindow(bucket_s, buckets, w.offset_s)
                for slot in sorted(p.slots):
                    total, count, gc, sm, te = widened(p.slots[slot])
                    if w.add(slot, total, int(count), int(gc), sm, te) and merged is not None:
                        merged.add(slot, total, int(count), int(gc), sm, te)
                    self._note_slot(job, slot, w.offset_s + slot * w.slot_s)
            for sec, (total, count, lo, hi) in p.seconds.items():
                self.rollups.add(job, float(sec), total, int(count), lo, hi)

    def _forwarded_pods(self, node: NodeState) -> dict[str, set[str]]:
        """The node's pods by job, of the jobs owned elsewhere."""
        forward = self.forward
        pods: dict[str, set[str]] = {}
        if forward is None:
            return pods
        for p, j in zip(node.pods, node.gpus.job, strict=False):
            if j is not None and p and forward(j):
                pods.setdefault(j, set()).add(p)
        return pods

    def _withdraw(self, node: NodeState) -> None:
        """``node``, whose notice was shipped, is uncordoned: its owners are told at once
        and with every shipment for the staleness limit (a lost shipment costs one
        interval), instead of keeping the notice until the resends stop."""
        pods = self._forwarded_pods(node)
        if not pods:
            return
        until = self.clock.now() + self.settings.stale_after_s
        self.withdrawn[node.name] = (until, {j: frozenset(ps) for j, ps in pods.items()})
        if self.on_forward_notice is not None:
            self.on_forward_notice()

    def take_notices(self, now_s: float) -> list[NodeNotice]:
        """The active notices of nodes holding GPUs of jobs owned elsewhere, one per job
        and node: every shipment carries them all again until the notice's deadline
        passes (or the node stops reporting), so a lost shipment costs one interval and
        a job whose shard moved has its new owner told within one shipment. Then the
        withdrawals (``NodeNotice.withdrawn``) of nodes uncordoned within the staleness
        limit."""
        forward = self.forward
        if forward is None or not (self.noticed or self.withdrawn):
            return []
        horizon = now_s - self.settings.stale_after_s
        out: list[NodeNotice] = []
        for name, (until, by_job) in list(self.withdrawn.items()):
            if until < now_s:
                del self.withdrawn[name]
                continue
            out.extend(
                NodeNotice(j, name, _EVENT.KIND_UNCORDONED, None, ps) for j, ps in by_job.items()
            )
        for name, node in list(self.noticed.items()):
            deadline = node.notice_deadline_s
            if (
                not node.notice
                or (deadline is not None and deadline < now_s)
                or node.last_sampled_s < horizon
            ):
                # Over: the node went (or is going without a word more); the owner's
                # copy runs out stale_after_s after the last resend.
                del self.noticed[name]
                continue
            pods = self._forwarded_pods(node)
            out.extend(
                NodeNotice(j, name, node.notice, deadline, frozenset(ps)) for j, ps in pods.items()
            )
        return out

    def merge_notices(self, notices: Iterable[NodeNotice]) -> tuple[int, int]:
        """Notices another replica shipped for jobs owned here, applied as if this
        replica's own agent stream had carried them (the job's evaluation is woken, and
        ``terminating_pods`` counts them). Returns (applied, duplicates): a resent notice,
        or one for a node already noticed here for those pods, is applied once. A
        withdrawal (the node uncordoned) drops the copy held here."""
        now = self.clock.now()
        applied = duplicate = 0
        for n in notices:
            if n.withdrawn:
                # Uncordoned: the copy goes now (applied), or went already (duplicate).
                copies = self.remote_notices.get(n.job_id)
                if copies is not None and copies.pop(n.node, None) is not None:
                    applied += 1
                else:
                    duplicate += 1
                continue
            held = self.remote_notices.setdefault(n.job_id, {})
            last = held.get(n.node)
            held[n.node] = (n, now)
            if last is not None and last[0] == n:
                duplicate += 1
                continue
            local = self.nodes.get(n.node)
            if local is not None and local.notice and n.pods <= set(local.pods):
                duplicate += 1  # this replica's own stream carried it already
                continue
            applied += 1
            if self.on_notice is not None:
                self.on_notice(n.job_id)
        return applied, duplicate
