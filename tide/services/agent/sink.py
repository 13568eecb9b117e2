"""Where the agent's reports go: one interface, two kinds.

The agent builds one ``ReportSink`` and hands it every report, without asking which
kind it has:

- ``SingleStream``: one buffer and one Telemetry stream to ``--scaler`` (the default);
- ``ScalerFanout`` (fanout.py): a buffer and a stream per scaler replica
  (``--scaler-fanout``).

``open_sink`` is the one place that picks between them, so the agent neither branches
on the mode nor builds a buffer and a stream that it would not use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tide.services.common.clock import Clock
from tide.v1 import telemetry_pb2

from .buffer import ReportBuffer
from .fanout import Resolver, ScalerFanout
from .metrics import AgentMetrics
from .settings import AgentSettings
from .stream import StreamConfig, TelemetryStream


class ReportSink(Protocol):
    """What the agent needs of the way out. Owned by the agent's event loop."""

    @property
    def dropped_total(self) -> int:
        """Reports dropped unsent so far (a full buffer), for ``_reports_dropped_total``."""
        ...

    def add(self, report: telemetry_pb2.NodeReport) -> None:
        """Hold a freshly built report until it is acked; never blocks (the beat calls it)."""
        ...

    async def run(self) -> None:
        """Stream what is held, reconnecting as needed, until cancelled."""
        ...

    async def finish(self, timeout_s: float) -> str:
        """Wait up to ``timeout_s`` for everything held to be acked; the agent's final log
        line: whether all was acked, what was dropped and what is left."""
        ...


class SingleStream:
    """One buffer and one Telemetry stream to ``--scaler``; the stream exports its
    counters and gauges as the agent's own."""

    def __init__(
        self,
        config: StreamConfig,
        *,
        buffer_reports: int,
        max_in_flight_reports: int,
        clock: Clock,
        metrics: AgentMetrics,
        on_interval: Callable[[float], None] | None = None,
    ) -> None:
        self._metrics = metrics
        self.buffer = ReportBuffer(buffer_reports, max_in_flight_reports)
        self.stream = TelemetryStream(
            config, self.buffer, metrics=metrics, clock=clock, on_interval=on_interval
        )
        metrics.scaler_replicas.set(1)

    @property
    def dropped_total(self) -> int:
        return self.buffer.dropped_total

    def add(self, report: telemetry_pb2.NodeReport) -> None:
        self.buffer.add(report)
        self._metrics.buffered.set(len(self.buffer))

    async def run(self) -> None:
        await self.stream.run()

    async def finish(self, timeout_s: float) -> str:
        flushed = await self.stream.flush(timeout_s)
        b = self.buffer
        return (
            f"final report {'acked' if flushed else 'NOT acked'}; {b.added_total} sampled,"
            f" {b.dropped_total} dropped, {len(b)} unacked at exit, last seq {b.last_seq}"
        )


def open_sink(
    settings: AgentSettings,
    boot_id: str,
    *,
    clock: Clock,
    metrics: AgentMetrics,
    resolver: Resolver,
    on_interval: Callable[[float], None],
) -> ReportSink:
    """The sink ``settings`` ask for: fan-out with ``scaler_fanout``, else one stream."""
    config = StreamConfig(
        target=settings.scaler,
        node_name=settings.node_name,
        boot_id=boot_id,
        ack_timeout_s=settings.ack_timeout_s,
        stream_max_age_s=settings.stream_max_age_s,
        backoff_initial_s=settings.backoff_initial_s,
        backoff_max_s=settings.backoff_max_s,
        keepalive_time_s=settings.keepalive_time_s,
        keepalive_timeout_s=settings.keepalive_timeout_s,
        credentials=settings.credentials(),
    )
    if settings.scaler_fanout:
        return ScalerFanout(
            config,
            buffer_reports=settings.buffer_reports,
            max_in_flight_reports=settings.max_in_flight_reports,
            resolve_interval_s=settings.scaler_resolve_interval_s,
            clock=clock,
            metrics=metrics,
            resolver=resolver,
            on_interval=on_interval,
        )
    return SingleStream(
        config,
        buffer_reports=settings.buffer_reports,
        max_in_flight_reports=settings.max_in_flight_reports,
        clock=clock,
        metrics=metrics,
        on_interval=on_interval,
    )
