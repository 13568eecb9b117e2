"""The agent's Prometheus metrics, in a registry of its own (one per Agent)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.reports_sampled = Counter(
            "tide_agent_reports_sampled_total", "Reports built from a sample.", registry=r
        )
        self.reports_dropped = Counter(
            "tide_agent_reports_dropped_total",
            "Reports dropped unsent because the buffer was full.",
            registry=r,
        )
        self.reports_written = Counter(
            "tide_agent_reports_written_total",
            "Report writes to a stream, resends included.",
            registry=r,
        )
        self.reports_acked = Counter(
            "tide_agent_reports_acked_total", "Reports the scaler acknowledged.", registry=r
        )
        self.reports_refused = Counter(
            "tide_agent_reports_refused_total",
            "Reports the scaler acknowledged but dropped, by reason (timestamp_in_future, ...).",
            ["reason"],
            registry=r,
        )
        self.buffered = Gauge(
            "tide_agent_buffered_reports", "Reports held, sent or not, until acked.", registry=r
        )
        self.connected = Gauge(
            "tide_agent_stream_connected", "1 while a Telemetry stream is open.", registry=r
        )
        self.scaler_replicas = Gauge(
            "tide_agent_scaler_replicas",
            "Scaler replicas streamed to (--scaler-fanout; 1 without it).",
            registry=r,
        )
        self.scaler_replicas_connected = Gauge(
            "tide_agent_scaler_replicas_connected",
            "Scaler replicas whose Telemetry stream is open (--scaler-fanout).",
            registry=r,
        )
        self.disconnects = Counter(
            "tide_agent_stream_disconnects_total",
            "Telemetry streams that ended, by reason.",
            ["reason"],
            registry=r,
        )
        self.gpu_unhealthy = Gauge(
            "tide_agent_gpus_unhealthy", "GPUs with a health flag in the last sample.", registry=r
        )
        self.sample_seconds = Histogram(
            "tide_agent_sample_duration_seconds",
            "Time to read all GPUs once.",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
            registry=r,
        )
        self.samples_skipped = Counter(
            "tide_agent_samples_skipped_total",
            "Ticks skipped because the previous sample had not finished.",
            registry=r,
        )
        self.samples_failed = Counter(
            "tide_agent_samples_failed_total",
            "Ticks whose source raised; their reports carry no GPUs.",
            registry=r,
        )
        self.node_events = Counter(
            "tide_agent_node_events_total",
            "Node notices observed, by kind (cordoned, ...).",
            ["kind"],
            registry=r,
        )
        self.pod_resources_errors = Counter(
            "tide_agent_pod_resources_errors_total",
            "Failed kubelet PodResources List calls.",
            registry=r,
        )
