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

import enum
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tide.v1 import telemetry_pb2

from services.common.clock import Clock
from services.scaler.members import MemberRegistry
from services.scaler.partials import JobPartial, NodeNotice, Partials
from services.scaler.policy import WindowView
from services.scaler.windows import JobWindow, NodeGpus, Rollups, stagger_offset
from tidebase.errors import AlreadyExists, ConfigError, InvalidArgument
from tidebase.timeconv import field_seconds, seconds_of

logger = logging.getLogger(__name__)

_INF = math.inf
_EVENT = telemetry_pb2.NodeEvent


class Rejection(enum.Enum):
    """Why a sample, a report or a stream was refused (the metric's ``reason`` label)."""

    NON_FINITE = "non_finite"
    UTILIZATION_OUT_OF_RANGE = "utilization_out_of_range"
    MEMORY_USED_EXCEEDS_TOTAL = "memory_used_exceeds_total"
    GPU_INDEX_OUT_OF_RANGE = "gpu_index_out_of_range"
    DUPLICATE_GPU_INDEX = "duplicate_gpu_index"
    TIMESTAMP_MISSING = "timestamp_missing"
    TIMESTAMP_IN_FUTURE = "timestamp_in_future"
    TIMESTAMP_OUT_OF_ORDER = "timestamp_out_of_order"
    TIMESTAMP_TOO_OLD = "timestamp_too_old"
    TOO_MANY_GPUS = "too_many_gpus"
    MISSING_IDENTITY = "missing_identity"
    BAD_SEQUENCE = "bad_sequence"
    NODE_CHANGED = "node_changed"
    MALFORMED = "malformed"
    DUPLICATE_STREAM = "duplicate_stream"

    @property
    def scope(self) -> str:
        """What was refused: one ``sample``, a whole ``report``, or the ``stream``."""
        return _SCOPES[self]


_SCOPES: dict[Rejection, str] = {
    **dict.fromkeys(
        (
            Rejection.NON_FINITE,
            Rejection.UTILIZATION_OUT_OF_RANGE,
            Rejection.MEMORY_USED_EXCEEDS_TOTAL,
            Rejection.GPU_INDEX_OUT_OF_RANGE,
            Rejection.DUPLICATE_GPU_INDEX,
        ),
        "sample",
    ),
    **dict.fromkeys(
        (
            Rejection.TIMESTAMP_MISSING,
            Rejection.TIMESTAMP_IN_FUTURE,
            Rejection.TIMESTAMP_OUT_OF_ORDER,
            Rejection.TIMESTAMP_TOO_OLD,
        ),
        "report",
    ),
    **dict.fromkeys(
        (
            Rejection.TOO_MANY_GPUS,
            Rejection.MISSING_IDENTITY,
            Rejection.BAD_SEQUENCE,
            Rejection.NODE_CHANGED,
            Rejection.MALFORMED,
            Rejection.DUPLICATE_STREAM,
        ),
        "stream",
    ),
}


class InvalidStream(InvalidArgument):
    """The stream itself is broken (identity, sequence, impossible GPU count): it ends."""

    def __init__(self, reason: Rejection, message: str) -> None:
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason


class StreamConflict(AlreadyExists):
    """Another live stream speaks for the node under another boot id: two agents claim
    one node. Refused, counted and logged, also in insecure mode; never merged."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{Rejection.DUPLICATE_STREAM.value}: {message}")
        self.reason = Rejection.DUPLICATE_STREAM


@dataclass(frozen=True)
class IngestSettings:
    max_gpus_per_node: int = 64
    # Agent clocks run ahead of ours by at most this; a report further in the future is dropped.
    max_clock_skew_s: float = 5.0
    # A report sampled longer ago than this is dropped: an agent's buffer holds minutes,
    # never days, and an old report would become history dated in the past.
    max_report_age_s: float = 900.0
    # A GPU without a sample for this long is stale: it no longer counts as covered.
    stale_after_s: float = 10.0
    # Out-of-order sequence numbers remembered above the contiguous ack; past
    # this the missing reports are given up as lost.
    reorder_limit: int = 256
    # Asked of agents in every ack; 0 leaves the agent's own period.
    report_interval_s: float = 0.0
    # Offset each job's slot grid by a fraction of a slot (see windows.stagger_offset).
    stagger_slots: bool = True
    # A telemetry stream with no report for this long is closed (UNAVAILABLE): an
    # agent reports every few seconds, and one that holds a stream open without
    # reporting only holds a slot (reliability catalog T23). 0 keeps streams open.
    stream_idle_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not 1 <= self.max_gpus_per_node <= 4096:
            raise ConfigError(f"max_gpus_per_node={self.max_gpus_per_node!r}: must be 1..4096")
        if not (self.max_clock_skew_s >= 0 and math.isfinite(self.max_clock_skew_s)):
            raise ConfigError(f"max_clock_skew_s={self.max_clock_skew_s!r}: must be >= 0")
        if not (self.max_report_age_s > 0 and math.isfinite(self.max_report_age_s)):
            raise ConfigError(f"max_report_age_s={self.max_report_age_s!r}: must be > 0")
        if not (self.stale_after_s > 0 and math.isfinite(self.stale_after_s)):
            raise ConfigError(f"stale_after_s={self.stale_after_s!r}: must be > 0")
        if self.reorder_limit < 1:
            raise ConfigError(f"reorder_limit={self.reorder_limit!r}: must be >= 1")
        if not (self.report_interval_s >= 0 and math.isfinite(self.report_interval_s)):
            raise ConfigError(f"report_interval_s={self.report_interval_s!r}: must be >= 0")
        if not (self.stream_idle_timeout_s >= 0 and math.isfinite(self.stream_idle_timeout_s)):
            raise ConfigError(f"stream_idle_timeout_s={self.stream_idle_timeout_s!r}: must be >= 0")


class NodeState:
    """What the scaler knows of one node: sequence state of its current boot,
    its GPUs' latest samples, and any notice it announced."""

    __slots__ = (
        "acked",
        "boot_id",
        "gpus",
        "last_sampled_s",
        "max_seen",
        "name",
        "notice",
        "notice_deadline_s",
        "pending",
        "pods",
        "streams",
    )

    def __init__(self, name: str, boot_id: str, first_seq: int) -> None:
        self.name = name
        self.gpus = NodeGpus(name, 0)
        self.pods: list[str] = []
        self.notice = 0
        self.notice_deadline_s: float | None = None
        self.streams = 0
        self.reset(boot_id, first_seq)

    def reset(self, boot_id: str, first_seq: int) -> None:
        # A scaler that first hears of a boot mid-way (its own restart) takes
        # the first report as the start: it cannot know what came before.
        self.boot_id = boot_id
        self.acked = first_seq - 1
        self.max_seen = first_seq - 1
        self.pending: set[int] = set()
        self.last_sampled_s = -_INF


class StreamState:
    """Per-stream identity: a stream speaks for exactly one node."""

    __slots__ = ("node",)

    def __init__(self) -> None:
        self.node: NodeState | None = None


WindowShape = Callable[[str], tuple[float, int]]


class Ingest:
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
        # Sharded (services/scaler/leases.py): whether a job's samples go to the replica
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

    # -- streams -------------------------------------------------------------

    def open_stream(self) -> StreamState:
        self.streams_open += 1
        return StreamState()

    def close_stream(self, stream: StreamState) -> None:
        self.streams_open -= 1
        if stream.node is not None:
            stream.node.streams -= 1

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
        limit = self.settings.max_gpus_per_node
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
            if len(node.pending) > self.settings.reorder_limit:
                # The agent no longer has what is missing; stop waiting for it.
                acked = max(node.pending)
                node.pending.clear()
        node.acked = acked

        t = seconds_of(r.sampled_at)
        now = self.clock.now()
        if t <= 0.0:
            return self._drop(Rejection.TIMESTAMP_MISSING, boot, acked)
        if t > now + self.settings.max_clock_skew_s:
            return self._drop(Rejection.TIMESTAMP_IN_FUTURE, boot, acked)
        if t < now - self.settings.max_report_age_s:
            return self._drop(Rejection.TIMESTAMP_TOO_OLD, boot, acked)
        if t < node.last_sampled_s:
            return self._drop(Rejection.TIMESTAMP_OUT_OF_ORDER, boot, acked)
        node.last_sampled_s = t
        if n:
            self._samples(node, gpus, cap, t)
        if r.events:
            # After the samples: a notice in a node's first report reaches the jobs its
            # GPUs hold as of that report.
            self._events(node, r.events)
        self.reports_accepted += 1
        return boot, acked

    def _drop(self, reason: Rejection, boot: str, acked: int) -> tuple[str, int]:
        # The report is consumed (acked) but none of it reaches a window.
        self.rejected[reason] += 1
        self.reports_dropped += 1
        return boot, acked

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
        acc: dict[str | None, list[float]] = {}
        seen_mask = 0
        accepted = 0
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
            if p - p != 0.0 or c - c != 0.0:
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
            a = acc.get(job)
            if a is None:
                acc[job] = [u, 1.0, u, u]
            else:
                a[0] += u
                a[1] += 1.0
                if u < a[2]:
                    a[2] = u
                elif u > a[3]:
                    a[3] = u
            accepted += 1
        self.samples_accepted += accepted
        if not acc:
            return
        job_nodes = self.job_nodes
        forward = self.forward
        for job, (total, count, lo, hi) in acc.items():
            if job is None:
                self.samples_unattributed += int(count)
                continue
            held = job_nodes.get(job)
            if held is None:
                job_nodes[job] = {node.name: node}
            elif node.name not in held:
                held[node.name] = node
            w = self.windows.get(job)
            if w is None:
                bucket_s, buckets = self._shape(job)
                w = self.windows[job] = self._new_window(job, bucket_s, buckets)
            slot = int((t - w.offset_s) // w.slot_s)
            if forward is not None and forward(job):
                self.partials.add(job, (w.bucket_s, w.buckets), slot, t, total, int(count), lo, hi)
                continue
            w.add(slot, total, int(count))
            self.rollups.add(job, t, total, int(count), lo, hi)
            last = self._last_slot.get(job)
            if last is None or slot > last:
                self._last_slot[job] = slot
                if last is not None and self.on_slot is not None:
                    self.on_slot(job, t)

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
        for slot, (total, count) in w.slots().items():
            m = merged.get(slot)
            if m is not None:
                total, count = total - m[0], count - m[1]
            if count > 0:
                own[slot] = [total, count]
        if not own:
            return None
        return JobPartial(job_id, w.bucket_s, w.buckets, own)

    def drop_job(self, job_id: str) -> None:
        self.reshape(job_id)
        self.remote_seen.pop(job_id, None)
        self.remote_notices.pop(job_id, None)
        self.rollups.drop_job(job_id)
        self.job_nodes.pop(job_id, None)

    # -- sharding: partial aggregates between replicas ---------------------------

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
                    total, count = p.slots[slot]
                    if w.add(slot, total, int(count)) and merged is not None:
                        merged.add(slot, total, int(count))
                    last = self._last_slot.get(job)
                    if last is None or slot > last:
                        self._last_slot[job] = slot
                        if last is not None and self.on_slot is not None:
                            self.on_slot(job, w.offset_s + slot * w.slot_s)
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
