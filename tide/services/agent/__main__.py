"""``python -m tide.services.agent``: the node agent's entry point: builds the real parts and runs them."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from tide.services.common import logs
from tide.services.common.clock import SystemClock
from tide.services.common.entry import run_service
from tide.services.common.logs import with_context
from tide.services.common.metrics import register_build_info

from .agent import Agent
from .attribution import PodResourcesClient
from .errors import SourceError
from .metrics import AgentMetrics
from .servicer import start_edge
from .settings import AgentSettings
from .sources import Profile, ReplaySource, Source, SyntheticSource

logger = logging.getLogger("tide.services.agent")

DESCRIPTION = (
    "Tide node agent: samples GPUs (NVML), attributes them to pods (kubelet PodResources),"
    " watches its Node for cordon and termination taints, and streams reports to the scaler."
)


def make_source(settings: AgentSettings) -> Source:
    clock = SystemClock()
    if settings.source == "nvml":
        from .nvml import NvmlSource

        return NvmlSource()
    if settings.source == "dcgm":
        from .dcgm import DcgmExporterSource

        return DcgmExporterSource(settings.dcgm_exporter_url, settings.dcgm_timeout_s)
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
        with_context(logger, node=settings.node_name).warning(
            "node watch off, no Kubernetes config (%s); pass --no-watch-node to silence",
            exc,
        )
        return None
    return client.CoreV1Api(client.ApiClient(configuration))


async def run(settings: AgentSettings, stop: asyncio.Event | None = None) -> int:
    """Run the agent until SIGTERM/SIGINT (or ``stop``); the process's exit code."""
    # One node per agent: every line of the process (NVML, the stream, the watch) names it.
    logs.bind_process(node=settings.node_name)
    if not settings.tls_ca_file:
        logger.warning(
            "INSECURE: streaming to the scaler in plaintext, unauthenticated; never in a shared"
            " cluster (docs/security.md)"
        )
    metrics = AgentMetrics()
    register_build_info(metrics.registry, "agent")
    edge = await start_edge(settings, metrics)
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
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def not_serving_on_stop() -> None:
        await stop.wait()
        await edge.enter_shutdown()

    draining = asyncio.create_task(not_serving_on_stop(), name="health-shutdown")
    try:
        await agent.run(stop)
    except SourceError as exc:
        # One line, no traceback: this is an environment problem, not a bug.
        with_context(logger, node=settings.node_name).error("%s", exc)
        return 1
    finally:
        # Let the task above finish rather than cancel it: grpc's
        # enter_graceful_shutdown sets its "shutting down" flag before it publishes
        # NOT_SERVING, so a cancel between the two leaves health SERVING for good
        # (a second call returns at once) and probes never see the drain.
        stop.set()
        await draining
        await edge.stop(settings.grace_period_s)
    # A task that died is a failure even though the final report went out: let
    # the kubelet restart us.
    return 1 if agent.failure is not None else 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_service(
        AgentSettings,
        run,
        name="agent",
        description=DESCRIPTION,
        error_prefix="tide-agent",
        argv=argv,
    )


if __name__ == "__main__":
    sys.exit(main())
