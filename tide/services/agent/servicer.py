"""The agent's serving edge: gRPC health and reflection, and Prometheus /metrics.

The agent serves no API of its own; what it serves is what every Tide service
serves, so the kubelet's gRPC probe and Prometheus treat it like the others.
On SIGTERM health turns NOT_SERVING at once (probes and load balancers stop
sending work while the final report drains), and once the agent has stopped,
in-flight RPCs get ``grace_period_s`` before they are cancelled.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tide.base.listening import listening_line
from tide.services.common.config import CommonSettings
from tide.services.common.server import RunningServer, start_server

from .metrics import AgentMetrics
from .settings import AgentSettings

logger = logging.getLogger(__name__)


@dataclass
class Edge:
    """What the agent listens on: the gRPC health server (``--listen``), or /metrics alone."""

    server: RunningServer | None
    metrics_httpd: Any = None

    async def enter_shutdown(self) -> None:
        """Report NOT_SERVING; RPCs already in flight go on."""
        if self.server is not None:
            await self.server.health.enter_graceful_shutdown()

    async def stop(self, grace_s: float) -> None:
        if self.server is not None:
            await self.server.stop(grace_s)
        if self.metrics_httpd is not None:
            self.metrics_httpd.shutdown()
            self.metrics_httpd.server_close()


async def start_edge(settings: AgentSettings, metrics: AgentMetrics) -> Edge:
    """Serve health (and /metrics) when ``listen`` is set, else /metrics when asked.

    With ``listen`` it prints the LISTENING line, as every Tide service does."""
    if settings.listen:
        # Plain gRPC: the kubelet's gRPC probe does not speak TLS, and the agent's TLS
        # files are a client's (to the scaler), not a server certificate.
        server = await start_server(
            CommonSettings(
                listen=settings.listen,
                metrics_listen=settings.metrics_listen,
                grace_period_s=settings.grace_period_s,
            ),
            [],
            registry=metrics.registry,
        )
        print(listening_line(server.port, server.metrics_port), flush=True)
        return Edge(server)
    if settings.metrics_listen:
        from prometheus_client import start_http_server

        host, _, port = settings.metrics_listen.rpartition(":")
        httpd, _thread = start_http_server(int(port), host, registry=metrics.registry)
        return Edge(None, httpd)
    return Edge(None)
