"""The scaler's Prometheus metrics: the ingest counters, read at scrape time.

The hot path keeps plain ints (services/scaler/ingest.py); this collector turns
them into metric families only when Prometheus asks.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.scaler.ingest import IngestEngine


class IngestCollector(Collector):
    """Exports the engine's counters to Prometheus when scraped."""

    def __init__(self, engine: IngestEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        e = self.engine
        reports = CounterMetricFamily(
            "tide_scaler_telemetry_reports", "Node reports by outcome", labels=["result"]
        )
        reports.add_metric(["accepted"], e.reports_accepted)
        reports.add_metric(["duplicate"], e.reports_duplicate)
        reports.add_metric(["dropped"], e.reports_dropped)
        yield reports
        samples = CounterMetricFamily(
            "tide_scaler_telemetry_samples_accepted", "GPU samples that reached the node view"
        )
        samples.add_metric([], e.samples_accepted)
        yield samples
        unattributed = CounterMetricFamily(
            "tide_scaler_telemetry_samples_unattributed",
            "Accepted GPU samples of GPUs that belong to no job",
        )
        unattributed.add_metric([], e.samples_unattributed)
        yield unattributed
        rejected = CounterMetricFamily(
            "tide_scaler_telemetry_rejected",
            "Samples, reports or streams refused, by reason",
            labels=["reason"],
        )
        for reason, count in e.rejected.items():
            rejected.add_metric([reason.value], count)
        yield rejected
        gaps = CounterMetricFamily(
            "tide_scaler_telemetry_seq_gaps", "Reports skipped in agents' sequence numbers"
        )
        gaps.add_metric([], e.seq_gaps)
        yield gaps
        streams = GaugeMetricFamily("tide_scaler_telemetry_streams", "Open agent streams")
        streams.add_metric([], e.streams_open)
        yield streams
