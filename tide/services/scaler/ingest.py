"""Telemetry ingestion: sequence tracking, validation, attribution, aggregation.

The hot path is :meth:`Ingest.process`, called once per NodeReport. It
creates no object per GPU sample: each sample is validated with a few float
comparisons (NaN fails every comparison, so one range check catches NaN and
inf too), attributed with one dict lookup, and folded into per-report sums
per job; only then do the job windows, rollups and node arrays get one update
per job (protobuf field access already costs about 3 µs per sample, most of
the ingest's time, docs/scaler.md "Measured": nothing else may cost per sample).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import cast

from tide.base.timeconv import field_seconds
from tide.services.common.clock import Clock
from tide.services.scaler.ingest_peers import PeerExchange
from tide.services.scaler.ingest_state import (
    IngestSettings,
    InvalidStream,
    NodeState,
    Rejection,
    StreamConflict,
    StreamState,
    WindowShape,
    fold,
)
from tide.services.scaler.members import MemberRegistry
from tide.services.scaler.partials import NodeNotice, Partials
from tide.services.scaler.policy import WindowView
from tide.services.scaler.windows import JobWindow, Rollups, stagger_offset
from tide.v1 import telemetry_pb2

logger = logging.getLogger(__name__)

__all__ = [
    "Ingest",
    "IngestSettings",
    "InvalidStream",
    "NodeState",
    "Rejection",
    "StreamConflict",
    "StreamState",
    "WindowShape",
]

_INF = math.inf
_EVENT = telemetry_pb2.NodeEvent


_NO_JOB = object()  # no sample folded yet (None is the unattributed samples' job)


class Ingest(PeerExchange):
    """Turns reports into windows; see the module docstring for the cost model."""

    def __init__(
        self,
        settings: IngestSettings,
        registry: MemberRegistry,
        clock: Clock,
        window_shape: WindowShape | None = None,
        on_slot: Callable[[str, float], None] | None = None,
        on_notice: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.clock = clock
        self._shape = window_shape or (lambda _job: (30.0, 10))
        # A sample opened a new slot of the job's window (the window slid): the
        # policy may see its condition hold now.
        self.on_slot = on_slot
        # A node holding the job's pods announced termination or cordon.
        self.on_notice = on_notice
        self.nodes: dict[str, NodeState] = {}
        # Per job, the nodes that reported one of its GPUs: what an evaluation of the
        # job reads (freshness, terminating pods) instead of every node of the fleet.
        # Added to once per report and job, never per sample; a node whose GPUs all
        # went to other jobs is dropped by the next read that finds none.
        self.job_nodes: dict[str, dict[str, NodeState]] = {}
        self.windows: dict[str, JobWindow] = {}
        # Per job owned here, what other replicas shipped into its window (merge_partials),
        # in a ring of the window's shape: told apart from this replica's own samples
        # when it gives the job up (own_partial).
        self.merged: dict[str, JobWindow] = {}
        self._last_slot: dict[str, int] = {}
        self.rollups = Rollups()
        # Sharded (tide/services/scaler/leases.py): whether a job's samples go to the replica
        # that owns it, as partial aggregates, instead of into a window here.
        self.forward: Callable[[str], bool] | None = None
        self.partials = Partials()
        # Coverage shipped by other replicas: job → (node, GPU index) → last sample time.
        self.remote_seen: dict[str, dict[tuple[str, int], float]] = {}
        # Nodes whose notice is active here (shipped to the owners of their jobs every
        # shipment until the deadline): a shipment reads these, not every node.
        self.noticed: dict[str, NodeState] = {}
        # A notice landed on a node holding GPUs of a job owned elsewhere: ship now.
        self.on_forward_notice: Callable[[], None] | None = None
        # Notices shipped by other replicas: job → node → (notice, last received). Kept
        # while resent; one not resent for stale_after_s is over (uncordoned, or past
        # its deadline), as a GPU not reported for that long no longer counts.
        self.remote_notices: dict[str, dict[str, tuple[NodeNotice, float]]] = {}
        # Nodes uncordoned here whose notice was shipped: node → (resent until, the
        # job's pods by job owned elsewhere). The owners drop their copy at once.
        self.withdrawn: dict[str, tuple[float, dict[str, frozenset[str]]]] = {}
        # Plain ints on the hot path; exported by metrics.IngestCollector at scrape time.
        self.reports_accepted = 0
        self.reports_duplicate = 0
        self.reports_dropped = 0
        self.samples_accepted = 0
        self.samples_unattributed = 0
        self.seq_gaps = 0
        self.rejected: dict[Rejection, int] = dict.fromkeys(Rejection, 0)
        self.streams_open = 0
        # Per stream, reports dropped for their timestamp since its last ack, by cause:
        # (reports, the last one's sampled_at less our clock, its seq). The stream's
        # next ack names them (take_refused); empty while every report is taken.
        self.refused: dict[StreamState, dict[Rejection, tuple[int, float, int]]] = {}

    # -- streams -------------------------------------------------------------

    def open_stream(self) -> StreamState:
        self.streams_open += 1
        return StreamState()

    def close_stream(self, stream: StreamState) -> None:
        self.streams_open -= 1
        self.refused.pop(stream, None)
        if stream.node is not None:
            stream.node.streams -= 1

    def take_refused(self, stream: StreamState) -> dict[Rejection, tuple[int, float, int]] | None:
        """The stream's refusals since its previous ack, forgotten once taken."""
        return self.refused.pop(stream, None)

    def malformed(self, stream: StreamState, detail: str) -> InvalidStream:
        """A message that did not even parse as a NodeReport."""
        node = stream.node.name if stream.node is not None else "?"
        return self._reject_stream(
            Rejection.MALFORMED, f"node {node}: a message is not a NodeReport ({detail})"
        )

    def _reject_stream(self, reason: Rejection, message: str) -> InvalidStream:
        self.rejected[reason] += 1
        return InvalidStream(reason, message)

    # -- the hot path --------------------------------------------------------

    def process(self, stream: StreamState, r: telemetry_pb2.NodeReport) -> tuple[str, int]:
        """Apply one report; returns the (boot_id, acked_seq) to acknowledge.
        Raises InvalidStream when the stream must end."""
        name = r.node_name
        boot = r.boot_id
        seq = r.seq
        if not name or not boot:
            raise self._reject_stream(
                Rejection.MISSING_IDENTITY, "node_name and boot_id are required"
            )
        if seq == 0:
            raise self._reject_stream(Rejection.BAD_SEQUENCE, f"node {name}: seq starts at 1")
        # Checked before the sequence number is taken, so a resent impossible
        # report is refused again instead of being acknowledged as a duplicate.
        gpus = r.gpus
        n = len(gpus)
        cap = r.gpu_capacity
        settings = self.settings
        limit = settings.max_gpus_per_node
        if cap > limit:
            raise self._reject_stream(
                Rejection.TOO_MANY_GPUS,
                f"node {name}: gpu_capacity {cap} exceeds the maximum of {limit} per node",
            )
        if cap == 0:
            cap = limit
        if n > cap:
            raise self._reject_stream(
                Rejection.TOO_MANY_GPUS,
                f"node {name}: report {seq} has {n} GPU samples for a capacity of {cap}",
            )

        node = stream.node
        if node is None:
            node = self.nodes.get(name)
            if node is None:
                node = self.nodes[name] = NodeState(name, boot, seq)
            elif node.streams > 0 and node.boot_id != boot:
                # The same boot id is the same agent reconnecting before its old stream
                # ended; another boot id while one is live is a second claimant.
                self.rejected[Rejection.DUPLICATE_STREAM] += 1
                logger.warning(
                    "node %s: a second stream with boot id %s while the stream of boot id %s"
                    " is live; refused",
                    name,
                    boot,
                    node.boot_id,
                    extra={"node": name},
                )
                raise StreamConflict(
                    f"node {name} already has a live stream (another boot id); refused"
                )
            stream.node = node
            node.streams += 1
        elif node.name != name:
            raise self._reject_stream(
                Rejection.NODE_CHANGED, f"stream of node {node.name} sent a report for {name}"
            )
        if node.boot_id != boot:
            logger.info(
                "node %s: new boot id %s (was %s)", name, boot, node.boot_id, extra={"node": name}
            )
            node.reset(boot, seq)

        # Sequence: a number at or below the ack, or already held, is a replay.
        acked = node.acked
        if seq <= acked or seq in node.pending:
            self.reports_duplicate += 1
            return boot, acked
        if seq > node.max_seen + 1:
            self.seq_gaps += seq - node.max_seen - 1
        if seq > node.max_seen:
            node.max_seen = seq
        if seq == acked + 1:
            acked = seq
            pending = node.pending
            if pending:
                while acked + 1 in pending:
                    acked += 1
                    pending.discard(acked)
        else:
            node.pending.add(seq)
            if len(node.pending) > settings.reorder_limit:
                # The agent no longer has what is missing; stop waiting for it.
                acked = max(node.pending)
                node.pending.clear()
        node.acked = acked

        # tide.base.timeconv.seconds_of, inline (a call per report).
        ts = r.sampled_at
        t = ts.seconds + ts.nanos / 1e9
        now = self.clock.now()
        if t <= 0.0:
            self._drop(Rejection.TIMESTAMP_MISSING, stream, seq, 0.0)
            return boot, acked
        if t > now + settings.max_clock_skew_s:
            self._drop(Rejection.TIMESTAMP_IN_FUTURE, stream, seq, t - now)
            return boot, acked
        if t < now - settings.max_report_age_s:
            self._drop(Rejection.TIMESTAMP_TOO_OLD, stream, seq, t - now)
            return boot, acked
        if t < node.last_sampled_s:
            self._drop(Rejection.TIMESTAMP_OUT_OF_ORDER, stream, seq, t - now)
            return boot, acked
        node.last_sampled_s = t
        if n:
            self._samples(node, gpus, cap, t)
        if r.events:
            # After the samples: a notice in a node's first report reaches the jobs its
            # GPUs hold as of that report.
            self._events(node, r.events)
        self.reports_accepted += 1
        return boot, acked

    def _drop(self, reason: Rejection, stream: StreamState, seq: int, skew_s: float) -> None:
        # The report is consumed (acked) but none of it reaches a window; the ack that
        # covers it tells the agent why (tide/services/scaler/telemetry.py).
        self.rejected[reason] += 1
        self.reports_dropped += 1
        per = self.refused.get(stream)
        if per is None:
            per = self.refused[stream] = {}
        before = per.get(reason)
        per[reason] = (1 if before is None else before[0] + 1, skew_s, seq)

    def _samples(
        self, node: NodeState, gpus: Iterable[telemetry_pb2.GpuSample], cap: int, t: float
    ) -> None:
        ng = node.gpus
        if len(ng.util) < cap:
            ng.grow(cap)
            node.pods.extend([""] * (cap - len(node.pods)))
        util_arr = ng.util
        seen_arr = ng.seen_s
        job_arr = ng.job
        pod_arr = node.pods
        by_uid = self.registry.by_uid
        by_name = self.registry.by_name
        rejected = self.rejected
        # Runs of one job before the current one, only when a report's GPUs hold more
        # than one job: a node's GPUs mostly hold one, and then the report builds no
        # dict, list or tuple (each a tracked object the collector has to walk).
        acc: dict[str | None, list[float]] | None = None
        cur: object = _NO_JOB
        tot = cnt = lo = hi = ngc = sms = tes = 0.0
        seen_mask = 0
        for g in gpus:
            u = g.utilization_pct
            if not (0.0 <= u <= 100.0):
                rejected[
                    Rejection.NON_FINITE if u - u != 0.0 else Rejection.UTILIZATION_OUT_OF_RANGE
                ] += 1
                continue
            if g.memory_used_bytes > g.memory_total_bytes:
                rejected[Rejection.MEMORY_USED_EXCEEDS_TOTAL] += 1
                continue
            p = g.power_w
            c = g.temperature_c
            # NaN or inf in either gives NaN: one comparison for both.
            if (p - p) + (c - c) != 0.0:
                rejected[Rejection.NON_FINITE] += 1
                continue
            i = g.index
            if i >= cap:
                rejected[Rejection.GPU_INDEX_OUT_OF_RANGE] += 1
                continue
            bit = 1 << i
            if seen_mask & bit:
                rejected[Rejection.DUPLICATE_GPU_INDEX] += 1
                continue
            seen_mask |= bit
            pod = g.pod
            uid = pod.uid
            job = by_uid.get(uid) if uid else None
            if job is None:
                pname = pod.name
                if pname:
                    job = by_name.get(f"{pod.namespace}/{pname}") or by_name.get(pname)
                    pod_arr[i] = pname
                else:
                    pod_arr[i] = uid
            else:
                pod_arr[i] = uid
            util_arr[i] = u
            seen_arr[i] = t
            job_arr[i] = job
            # Folded into the running sums of the job of the samples before it: local
            # floats, not a list in a dict per sample.
            if job is not cur:
                if cur is not _NO_JOB:
                    if acc is None:
                        acc = {}
                    fold(acc, cur, (tot, cnt, lo, hi, ngc, sms, tes))
                cur = job
                tot = cnt = ngc = sms = tes = 0.0
                lo = hi = u
            tot += u
            cnt += 1.0
            if u < lo:
                lo = u
            elif u > hi:
                hi = u
            # GPM activity, when the agent measured it. Unset reads NaN (explicit
            # presence, default nan: tide.v1.GpuSample), which fails the range check
            # as out-of-range values do: not measured, never 0, without a presence
            # check or a sub-message object per sample (docs/scaler.md "Measured").
            sm = g.sm_active_pct
            if 0.0 <= sm <= 100.0:
                te = g.tensor_active_pct
                if 0.0 <= te <= 100.0:
                    ngc += 1.0
                    sms += sm
                    tes += te
        if cur is _NO_JOB:
            return
        if acc is None:
            # Every accepted sample of the report is one job's (the common case).
            self.samples_accepted += int(cnt)
            self._apply(node, cast("str | None", cur), t, tot, cnt, lo, hi, ngc, sms, tes)
            return
        fold(acc, cur, (tot, cnt, lo, hi, ngc, sms, tes))
        self.samples_accepted += int(sum(a[1] for a in acc.values()))
        for job, (total, count, lo, hi, gc, sm, te) in acc.items():
            self._apply(node, job, t, total, count, lo, hi, gc, sm, te)

    def _events(self, node: NodeState, events: Iterable[telemetry_pb2.NodeEvent]) -> None:
        for ev in events:
            kind = ev.kind
            if kind in (_EVENT.KIND_TERMINATION_NOTICE, _EVENT.KIND_CORDONED):
                deadline = field_seconds(ev, "deadline")
                if node.notice != _EVENT.KIND_TERMINATION_NOTICE:
                    node.notice = kind
                node.notice_deadline_s = deadline or node.notice_deadline_s
                self.noticed[node.name] = node
                self.withdrawn.pop(node.name, None)
                logger.warning(
                    "node %s: %s (%s); its jobs shrink off it",
                    node.name,
                    _EVENT.Kind.Name(kind),
                    ev.detail,
                    extra={"node": node.name},
                )
                jobs = {j for j in node.gpus.job if j is not None}
                if self.on_notice is not None:
                    for j in jobs:
                        self.on_notice(j)
                forward = self.forward
                if (
                    self.on_forward_notice is not None
                    and forward is not None
                    and any(forward(j) for j in jobs)
                ):
                    self.on_forward_notice()
            elif kind == _EVENT.KIND_UNCORDONED:
                if self.noticed.get(node.name) is node and node.notice:
                    self._withdraw(node)
                node.notice = 0
                node.notice_deadline_s = None
                self.noticed.pop(node.name, None)
                logger.info("node %s: uncordoned", node.name, extra={"node": node.name})
            elif kind == _EVENT.KIND_AGENT_SHUTDOWN:
                logger.info(
                    "node %s: agent shutting down; its samples stop",
                    node.name,
                    extra={"node": node.name},
                )

    # -- what the policy loop reads -------------------------------------------

    def _new_window(self, job_id: str, bucket_s: float, buckets: int) -> JobWindow:
        w = JobWindow(bucket_s, buckets)
        if self.settings.stagger_slots:
            w.offset_s = stagger_offset(job_id, w.slot_s)
        return w

    def reshape(self, job_id: str) -> None:
        """Forget a job's window (its bucket width or sustain changed)."""
        self.windows.pop(job_id, None)
        self._last_slot.pop(job_id, None)
        self.merged.pop(job_id, None)

    def drop_job(self, job_id: str) -> None:
        self.reshape(job_id)
        self.remote_seen.pop(job_id, None)
        self.remote_notices.pop(job_id, None)
        self.rollups.drop_job(job_id)
        self.job_nodes.pop(job_id, None)

    def fresh_gpus(self, now_s: float) -> dict[str, int]:
        """Per job, GPUs with a sample newer than the staleness limit."""
        horizon = now_s - self.settings.stale_after_s
        out: dict[str, int] = {}
        for node in self.nodes.values():
            g = node.gpus
            if node.last_sampled_s < horizon:
                continue
            for job, seen in zip(g.job, g.seen_s, strict=True):
                if job is not None and seen >= horizon:
                    out[job] = out.get(job, 0) + 1
        for job_id in self.remote_seen:
            out[job_id] = self.fresh_gpus_of(job_id, now_s)
        return out

    def fresh_gpus_of(self, job_id: str, now_s: float) -> int:
        """The job's GPUs with a sample newer than the staleness limit: ``fresh_gpus``
        for one job, reading only the nodes that hold its GPUs (O(the job's GPUs))."""
        horizon = now_s - self.settings.stale_after_s
        remote = self.remote_seen.get(job_id)
        if remote:
            # Shipped by other replicas: each GPU once, at its latest sample anywhere.
            latest = dict(remote)
            for node in self.job_nodes.get(job_id, {}).values():
                for i, (j, s) in enumerate(zip(node.gpus.job, node.gpus.seen_s, strict=True)):
                    if j == job_id and s > latest.get((node.name, i), -_INF):
                        latest[(node.name, i)] = s
            return sum(1 for s in latest.values() if s >= horizon)
        fresh = 0
        nodes = self.job_nodes.get(job_id)
        if not nodes:
            return 0
        gone: list[str] = []
        for name, node in nodes.items():
            held = False
            if node.last_sampled_s < horizon:
                held = job_id in node.gpus.job
            else:
                for job, seen in zip(node.gpus.job, node.gpus.seen_s, strict=True):
                    if job == job_id:
                        held = True
                        if seen >= horizon:
                            fresh += 1
            if not held:
                gone.append(name)
        for name in gone:
            del nodes[name]
        return fresh

    def node_freshness(self, now_s: float) -> tuple[int, int]:
        """(nodes whose last report is fresh, nodes whose last report is stale). Read by
        the /metrics thread: ``list`` copies the values in one step under the GIL."""
        horizon = now_s - self.settings.stale_after_s
        last = [n.last_sampled_s for n in list(self.nodes.values())]
        fresh = sum(1 for t in last if t >= horizon)
        return fresh, len(last) - fresh

    def terminating(self, job_id: str) -> tuple[int, str, float | None]:
        """(replicas of the job on noticed nodes, one such node, earliest deadline)."""
        pods, node_name, deadline = self.terminating_pods(job_id)
        return len(pods), node_name, deadline

    def terminating_pods(self, job_id: str) -> tuple[set[str], str, float | None]:
        """Pods of the job (still registered as its members) on nodes that announced
        cordon or termination, one such node, and the earliest deadline."""
        by_uid = self.registry.by_uid
        by_name = self.registry.by_name
        pods: set[str] = set()
        node_name = ""
        deadline: float | None = None
        # Only the nodes holding the job's GPUs: a pod counts only where its GPU does.
        for node in list(self.job_nodes.get(job_id, {}).values()):
            if not node.notice:
                continue
            mine = {
                p
                for p, j in zip(node.pods, node.gpus.job, strict=False)
                if j == job_id and p and (by_uid.get(p) == job_id or by_name.get(p) == job_id)
            }
            if mine:
                pods |= mine
                node_name = node_name or node.name
                d = node.notice_deadline_s
                if d is not None and (deadline is None or d < deadline):
                    deadline = d
        remote = self.remote_notices.get(job_id)
        if remote:
            # Shipped by the replicas the nodes' agents stream to; a pod noticed both
            # here and there is one pod (a set).
            horizon = self.clock.now() - self.settings.stale_after_s
            for name, (n, received) in list(remote.items()):
                if received < horizon:
                    del remote[name]
                    continue
                mine = {p for p in n.pods if by_uid.get(p) == job_id or by_name.get(p) == job_id}
                if mine:
                    pods |= mine
                    node_name = node_name or name
                    d = n.deadline_s
                    if d is not None and (deadline is None or d < deadline):
                        deadline = d
        return pods, node_name, deadline

    def window_view(self, job_id: str, now_s: float, gpus_expected: int, fresh: int) -> WindowView:
        bucket_s, buckets = self._shape(job_id)
        w = self.windows.get(job_id)
        if w is None or w.bucket_s != bucket_s or w.buckets != buckets:
            w = self.windows[job_id] = self._new_window(job_id, bucket_s, buckets)
        return w.view(now_s, buckets, gpus_expected, fresh)

    def node_view(self) -> list[tuple[str, int, float, str | None, float]]:
        """Every GPU the scaler knows: (node, index, utilization, job or None, last seen)."""
        rows = []
        for node in self.nodes.values():
            g = node.gpus
            for i, (u, j, s) in enumerate(zip(g.util, g.job, g.seen_s, strict=True)):
                if s > -_INF:
                    rows.append((node.name, i, u, j, s))
        return rows
