"""``python -m services.agent``: the node agent's entry point."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from services.common import logs
from services.common.clock import SystemClock
from services.common.config import CommonSettings, load_settings
from services.common.server import RunningServer, start_server
from tidebase.errors import ConfigError

from .agent import Agent
from .attribution import PodResourcesClient
from .metrics import AgentMetrics
from .settings import AgentSettings
from .sources import Profile, ReplaySource, Source, SourceError, SyntheticSource

logger = logging.getLogger("services.agent")

DESCRIPTION = (
    "Tide node agent: samples GPUs (NVML), attributes them to pods (kubelet PodResources),"
    " watches its Node for cordon and termination taints, and streams reports to the scaler."
)


def make_source(settings: AgentSettings) -> Source:
    clock = SystemClock()
    if settings.source == "nvml":
        from .nvml import NvmlSource

        return NvmlSource()
    if settings.source == "replay":
        return ReplaySource(settings.replay_path, clock, loop=settings.replay_loop)
    return SyntheticSource(
        Profile.parse(settings.synthetic_profile),
        settings.synthetic_gpus,
        clock,
        settings.node_name,
    )


def make_kube_api(settings: AgentSettings) -> Any | None:
    """A CoreV1Api, or None (with one warning) where there is no cluster to watch."""
    if not settings.watch_node:
        return None
    from kubernetes import client, config

    try:
        if settings.kubeconfig:
            configuration = client.Configuration()
            config.load_kube_config(  # type: ignore[no-untyped-call]
                settings.kubeconfig, client_configuration=configuration
            )
        else:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
            configuration = client.Configuration.get_default_copy()
    except (config.ConfigException, OSError) as exc:
        logger.warning(
            "node %s: node watch off, no Kubernetes config (%s); pass --no-watch-node to silence",
            settings.node_name,
            exc,
        )
        return None
    return client.CoreV1Api(client.ApiClient(configuration))


async def run(settings: AgentSettings) -> int:
    metrics = AgentMetrics()
    runtime: RunningServer | None = None
    if settings.listen:
        # The agent serves no API, only what every Tide service serves: gRPC
        # health and reflection (for the kubelet's gRPC probe) and /metrics.
        runtime = await start_server(
            CommonSettings(listen=settings.listen, metrics_listen=settings.metrics_listen),
            [],
            registry=metrics.registry,
        )
        print(f"LISTENING grpc={runtime.port} metrics={runtime.metrics_port}", flush=True)
    elif settings.metrics_listen:
        from prometheus_client import start_http_server

        host, _, port = settings.metrics_listen.rpartition(":")
        start_http_server(int(port), host, registry=metrics.registry)
    pod_resources = (
        PodResourcesClient(settings.pod_resources_socket, settings.gpu_resource_name)
        if settings.pod_resources_socket
        else None
    )
    agent = Agent(
        settings,
        make_source(settings),
        pod_resources=pod_resources,
        kube_api=make_kube_api(settings),
        metrics=metrics,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await agent.run(stop)
    except SourceError as exc:
        # One line, no traceback: this is an environment problem, not a bug.
        logger.error("node %s: %s", settings.node_name, exc)
        return 1
    finally:
        if runtime is not None:
            await runtime.stop(1.0)
    # A task that died is a failure even though the final report went out: let
    # the kubelet restart us.
    return 1 if agent.failure is not None else 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = load_settings(
            AgentSettings, argv, prog="python -m services.agent", description=DESCRIPTION
        )
    except ConfigError as exc:
        print(f"tide-agent: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level, settings.log_format)
    return asyncio.run(run(settings))


if __name__ == "__main__":
    sys.exit(main())
