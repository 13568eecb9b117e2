"""The scaler's Prometheus metrics (docs/observability.md lists each, and its alert).

Two kinds:

- :class:`IngestCollector` reads the ingest's plain ints at scrape time:
  the telemetry hot path (tide/services/scaler/ingest.py) never touches a metric
  object per sample.
- :class:`ScalerMetrics` holds what the control loop updates as it goes: per
  job (labels bounded by the number of jobs, never one per decision, node or
  member), the decisions, the evaluation and decision latency, the actuator's
  errors. It is updated on the event loop only; the /metrics thread just reads.

Label values are snake_case (``sustained_high_utilization``, ``completed``).
Utilization and coverage are ratios 0..1, Prometheus's base unit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tide.services.common.metrics import SHORT_BUCKETS_S
from tide.services.scaler.ingest import Ingest, Rejection
from tide.services.scaler.policy import PolicySettings, WindowView
from tide.services.scaler.store import DecisionRecord, JobRecord

#: Evaluation and decision latency, seconds: an evaluation takes microseconds
#: (a no-op) to tens of milliseconds (a committed decision on a busy SQLite).
LATENCY_BUCKETS_S: Final = SHORT_BUCKETS_S

#: (reason, trigger) of the decisions the scaler makes; each job's series of these
#: exist at 0 from its adoption, so increase() sees its first decision (and the
#: TideDecisionFailed alert its first failure) instead of a series born at 1.
DECISION_KINDS: Final = (
    ("sustained_high_utilization", "policy"),
    ("sustained_low_utilization", "policy"),
    ("node_termination", "emergency"),
    ("manual", "manual"),
    ("job_started", "manual"),
    ("reconcile", "reconcile"),
)

#: What a reconcile pass compares the scaler's view with (``tide_scaler_drift_total``).
DRIFT_SOURCES: Final = ("actuator", "coordinator")
FINAL_STATES: Final = ("completed", "aborted", "failed")

#: Why partial aggregates were dropped (``tide_scaler_partials_dropped_total``).
PARTIALS_DROPPED: Final = ("no_owner", "busy", "failed", "refused")

#: What became of node notices shipped by other replicas
#: (``tide_scaler_notices_received_total``): new here, already known, not owned here.
NOTICES_RECEIVED: Final = ("applied", "duplicate", "refused")

#: Parts of the decision latency (``tide_scaler_decision_latency_stage_seconds``).
STAGES: Final = ("transport", "queue", "evaluate")


class IngestCollector(Collector):
    """Exports the ingest counters to Prometheus when scraped."""

    def __init__(self, ingest: Ingest) -> None:
        self.ingest = ingest

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        e = self.ingest
        reports = CounterMetricFamily(
            "tide_scaler_telemetry_reports",
            "Node reports by result: accepted, duplicate (a resend), dropped (refused, see"
            " tide_scaler_telemetry_reports_rejected_total).",
            labels=["result"],
        )
        reports.add_metric(["accepted"], e.reports_accepted)
        reports.add_metric(["duplicate"], e.reports_duplicate)
        reports.add_metric(["dropped"], e.reports_dropped)
        yield reports
        samples = CounterMetricFamily(
            "tide_scaler_telemetry_samples_accepted", "GPU samples that reached the node view."
        )
        samples.add_metric([], e.samples_accepted)
        yield samples
        unattributed = CounterMetricFamily(
            "tide_scaler_telemetry_samples_unattributed",
            "Accepted GPU samples of GPUs that belong to no job.",
        )
        unattributed.add_metric([], e.samples_unattributed)
        yield unattributed
        # One family per scope: a sample, a report and a stream are different things
        # to count, and summing them would mean nothing.
        for scope, what in (
            ("sample", "GPU samples refused (the rest of their report counts)"),
            ("report", "Reports acknowledged but kept out of the windows"),
            ("stream", "Telemetry streams ended with INVALID_ARGUMENT"),
        ):
            family = CounterMetricFamily(
                f"tide_scaler_telemetry_{scope}s_rejected", f"{what}, by reason.", labels=["reason"]
            )
            for reason, count in e.rejected.items():
                if reason.scope == scope:
                    family.add_metric([reason.value], count)
            yield family
        gaps = CounterMetricFamily(
            "tide_scaler_telemetry_seq_gaps", "Reports skipped in agents' sequence numbers."
        )
        gaps.add_metric([], e.seq_gaps)
        yield gaps
        streams = GaugeMetricFamily(
            "tide_scaler_telemetry_streams", "Open agent telemetry streams (agents connected)."
        )
        streams.add_metric([], e.streams_open)
        yield streams
        nodes = GaugeMetricFamily(
            "tide_scaler_telemetry_nodes",
            "Nodes the scaler has heard of, by whether their last report is fresh"
            " (newer than the staleness limit) or stale.",
            labels=["freshness"],
        )
        fresh, stale = e.node_freshness(e.clock.now())
        nodes.add_metric(["fresh"], fresh)
        nodes.add_metric(["stale"], stale)
        yield nodes


class ScalerMetrics:
    """What the control loop records; one per ScalerCore (its own registry unless given)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        job = ("job_id",)
        # Per job, the window's labelled gauges (see ``window``).
        self._utilization: dict[str, Gauge] = {}
        self._coverage: dict[str, Gauge] = {}
        self.replicas = Gauge(
            "tide_scaler_job_replicas", "Replicas the job runs with now.", job, registry=r
        )
        self.desired_replicas = Gauge(
            "tide_scaler_job_desired_replicas",
            "Replicas the job is being resized to (its active decision's target), else its"
            " current replicas.",
            job,
            registry=r,
        )
        self.min_replicas = Gauge(
            "tide_scaler_job_min_replicas", "The job's lower bound.", job, registry=r
        )
        self.max_replicas = Gauge(
            "tide_scaler_job_max_replicas", "The job's upper bound.", job, registry=r
        )
        self.paused = Gauge(
            "tide_scaler_job_autoscaling_paused",
            "1 while autoscaling of the job is paused (sum() is the paused jobs).",
            job,
            registry=r,
        )
        self.utilization = Gauge(
            "tide_scaler_job_window_utilization_ratio",
            "Mean GPU utilization over the job's sustain window at its last evaluation,"
            " 0..1; absent while the window holds no sample.",
            job,
            registry=r,
        )
        self.coverage = Gauge(
            "tide_scaler_job_window_coverage_ratio",
            "Fraction of the job's GPUs with a fresh sample at its last evaluation, 0..1.",
            job,
            registry=r,
        )
        self.scale_up = Gauge(
            "tide_scaler_job_scale_up_threshold_ratio",
            "The job's scale-up utilization threshold, 0..1.",
            job,
            registry=r,
        )
        self.scale_down = Gauge(
            "tide_scaler_job_scale_down_threshold_ratio",
            "The job's scale-down utilization threshold, 0..1.",
            job,
            registry=r,
        )
        self.min_coverage = Gauge(
            "tide_scaler_job_min_coverage_ratio",
            "Coverage below which the policy decides nothing for the job, 0..1.",
            job,
            registry=r,
        )
        self.active_since = Gauge(
            "tide_scaler_job_active_decision_created_timestamp_seconds",
            "When the job's decision that is not final yet was created (Unix time);"
            " absent when none.",
            job,
            registry=r,
        )
        self.last_pause = Gauge(
            "tide_scaler_job_last_pause_seconds",
            "Training pause of the job's last completed resize, seconds.",
            job,
            registry=r,
        )
        self.decisions = Counter(
            "tide_scaler_decisions_total",
            "Decisions that reached a final state, by job, reason, trigger and state"
            " (completed, aborted, failed).",
            ("job_id", "reason", "trigger", "state"),
            registry=r,
        )
        self.lost_steps = Counter(
            "tide_scaler_decision_lost_steps_total",
            "Steps of work lost by the job's decisions (0 on a planned resize).",
            job,
            registry=r,
        )
        self.pause = Histogram(
            "tide_scaler_resize_pause_duration_seconds",
            "Training pause of completed resizes, seconds.",
            buckets=(0.5, 1, 2, 3, 5, 8, 13, 20, 30, 60, 120),
            registry=r,
        )
        self.evaluation = Histogram(
            "tide_scaler_evaluation_duration_seconds",
            "One policy evaluation of one job, its decision's commit included.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.decision_latency = Histogram(
            "tide_scaler_decision_latency_seconds",
            "From the sample that tipped a job's window to its committed decision.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.decision_stage = Histogram(
            "tide_scaler_decision_latency_stage_seconds",
            "Parts of the decision latency: transport (sample to ingest), queue (ingest to"
            " evaluation), evaluate (evaluation to commit).",
            ("stage",),
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.actuator_errors = Counter(
            "tide_scaler_actuator_errors_total",
            "Actuator calls that raised, by operation (set_replicas, get_replicas, free_gpus).",
            ("operation",),
            registry=r,
        )
        self.loop_failures = Counter(
            "tide_scaler_evaluation_passes_lost_total",
            "Passes of the evaluation loop lost to an unavailable store or coordinator"
            " (the loop goes on; the next pass takes up what this one left).",
            registry=r,
        )
        self.drift = Counter(
            "tide_scaler_drift_total",
            "Jobs found by a reconcile pass whose actuator replicas or coordinator world size"
            " differed from the scaler's last decision, by source (actuator, coordinator);"
            " each is corrected through a recorded RECONCILE decision.",
            ("source",),
            registry=r,
        )
        self.drifting = Gauge(
            "tide_scaler_drift_jobs",
            "Jobs that drifted in the last reconcile pass.",
            registry=r,
        )
        self.reconcile_passes = Counter(
            "tide_scaler_reconcile_passes_total",
            "Reconcile passes run (at start, on taking the lead, then periodically).",
            registry=r,
        )
        # Sharded (docs/scaler.md, Scaling out): partial aggregates between replicas.
        self.partials_shipped = Counter(
            "tide_scaler_partials_shipped_total",
            "Jobs' partial aggregates shipped to the replicas that own them.",
            registry=r,
        )
        self.partials_shipped_bytes = Counter(
            "tide_scaler_partials_shipped_bytes_total",
            "Bytes of partial aggregates shipped to the replicas that own them.",
            registry=r,
        )
        self.partials_dropped = Counter(
            "tide_scaler_partials_dropped_total",
            "Jobs' partial aggregates dropped, by reason: no_owner (the job's shard has no"
            " live lease), busy (the previous shipment to that owner was still in flight),"
            " failed (the owner did not answer in time), refused (the receiver no longer"
            " owns the job).",
            ("reason",),
            registry=r,
        )
        self.partials_received = Counter(
            "tide_scaler_partials_received_total",
            "Jobs' partial aggregates from other replicas merged into this one's windows.",
            registry=r,
        )
        self.notices_shipped = Counter(
            "tide_scaler_notices_shipped_total",
            "Node notices (job, node) shipped to the jobs' owners; each active one is"
            " resent every shipment until its deadline.",
            registry=r,
        )
        self.notices_received = Counter(
            "tide_scaler_notices_received_total",
            "Node notices from other replicas, by result: applied (new here),"
            " duplicate (a resend, or already seen), refused (job not owned here).",
            ["result"],
            registry=r,
        )
        self.shards_held = Gauge(
            "tide_scaler_shards_held",
            "Shards whose lease this replica holds (sharded deployments).",
            registry=r,
        )
        for reason in PARTIALS_DROPPED:
            self.partials_dropped.labels(reason)
        for result in NOTICES_RECEIVED:
            self.notices_received.labels(result)
        for source in DRIFT_SOURCES:
            self.drift.labels(source)
        self._stages = tuple(self.decision_stage.labels(s) for s in STAGES)
        # Present at 0 from the start: an increase() alert needs a sample before the error.
        for operation in ("set_replicas", "get_replicas", "free_gpus"):
            self.actuator_errors.labels(operation)

    # -- per job ------------------------------------------------------------------------------

    def job(self, job: JobRecord, policy: PolicySettings, *, resizing: bool) -> None:
        j = job.job_id
        self.replicas.labels(j).set(job.current_replicas)
        if not resizing:
            self.desired_replicas.labels(j).set(job.current_replicas)
        self.min_replicas.labels(j).set(job.min_replicas)
        self.max_replicas.labels(j).set(job.max_replicas)
        self.paused.labels(j).set(1 if job.autoscaling_paused else 0)
        self.scale_up.labels(j).set(policy.scale_up_utilization_pct / 100.0)
        self.scale_down.labels(j).set(policy.scale_down_utilization_pct / 100.0)
        self.min_coverage.labels(j).set(policy.min_coverage)
        self.lost_steps.labels(j)
        for reason, trigger in DECISION_KINDS:
            for state in FINAL_STATES:
                self.decisions.labels(j, reason, trigger, state)

    def window(self, job_id: str, view: WindowView) -> None:
        # Called for every job on every tick: the labelled children are kept, as
        # ``labels()`` validates and locks on each call (a sixth of a tick's time).
        mean = view.mean_pct
        if math.isnan(mean):
            # No sample in the window: no value, rather than a NaN a graph draws as 0.
            if self._utilization.pop(job_id, None) is not None:
                self.utilization.remove(job_id)
        else:
            u = self._utilization.get(job_id)
            if u is None:
                u = self._utilization[job_id] = self.utilization.labels(job_id)
            u.set(mean / 100.0)
        c = self._coverage.get(job_id)
        if c is None:
            c = self._coverage[job_id] = self.coverage.labels(job_id)
        c.set(view.coverage)

    def decision_started(self, d: DecisionRecord) -> None:
        self.desired_replicas.labels(d.job_id).set(d.to_replicas)
        self.active_since.labels(d.job_id).set(d.created_at.timestamp())

    def decision_finished(self, d: DecisionRecord, current_replicas: int) -> None:
        j = d.job_id
        state = d.state.name.lower()
        self.decisions.labels(j, d.reason.lower(), d.trigger.lower(), state).inc()
        self.desired_replicas.labels(j).set(current_replicas)
        self.replicas.labels(j).set(current_replicas)
        self.active_since.remove(j)
        if d.lost_steps:
            self.lost_steps.labels(j).inc(d.lost_steps)
        if state == "completed":
            self.last_pause.labels(j).set(d.pause_s)
            self.pause.observe(d.pause_s)

    # -- latency ------------------------------------------------------------------------------

    def observe_decision(self, total_s: float, parts: tuple[float, float, float]) -> None:
        """A policy decision's latency from its tipping sample, and its three stages."""
        self.decision_latency.observe(total_s)
        for child, value in zip(self._stages, parts, strict=True):
            child.observe(max(0.0, value))


__all__ = ["STAGES", "IngestCollector", "Rejection", "ScalerMetrics"]
