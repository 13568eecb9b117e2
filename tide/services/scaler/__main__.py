"""`python -m tide.services.scaler`: the scaler process (Telemetry + Scaler APIs, the control loop).

Wiring only. The coordinator and the actuator are real and named explicitly
(``--coordinator HOST:PORT``, ``--actuator local:DIR|kubernetes:in-cluster``); without them the
process exits 2 with one line saying what to pass. The in-memory parts for
tests and demos are behind ``python -m tide.services.testing.scaler``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tide.base.client import open_channel
from tide.services.common.clock import SystemClock
from tide.services.common.entry import run_service
from tide.services.scaler.actuators import Actuator, make_actuator, parse_actuator
from tide.services.scaler.app import Background, serve_scaler
from tide.services.scaler.coordination import GrpcCoordinatorClient
from tide.services.scaler.engine.core import ScalerCore
from tide.services.scaler.settings import ScalerSettings


async def run(settings: ScalerSettings) -> None:
    clock = SystemClock()
    channel = open_channel(settings.coordinator, credentials=settings.credentials())
    actuator = make_actuator(
        settings.actuator,
        coordinator=settings.coordinator,
        total_gpus=settings.total_gpus or None,
        clock=clock,
        ca_dir=settings.local_ca_dir,
        namespaces=settings.namespaces(),
    )
    await serve_scaler(
        settings,
        actuator=actuator,
        coordinator=GrpcCoordinatorClient(channel),
        clock=clock,
        on_shutdown=[channel.close],
        attach=cluster_link(settings, actuator),
    )


def cluster_link(
    settings: ScalerSettings, actuator: Actuator
) -> list[Callable[[ScalerCore], Sequence[Background]]]:
    """With the Kubernetes actuator: discovery of opted-in PaddleJobs and their Events."""
    if parse_actuator(settings.actuator)[0] != "kubernetes":
        return []
    # Imported here: a scaler in local mode never loads the kubernetes client.
    from tide.services.scaler.actuators.kubernetes import KubernetesActuator
    from tide.services.scaler.kube.link import KubeLink

    assert isinstance(actuator, KubernetesActuator)
    link = KubeLink(
        actuator, trust_configmap=settings.trust_configmap, ca_file=settings.tls_ca_file
    )
    return [link.attach]


def main(argv: list[str] | None = None) -> int:
    return run_service(
        ScalerSettings,
        run,
        name="scaler",
        description="Tide scaler: GPU telemetry in, coordinated resize decisions out.",
        argv=argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
