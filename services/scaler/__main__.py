"""`python -m services.scaler`: the scaler process (Telemetry + Scaler APIs, the control loop)."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

from prometheus_client import REGISTRY
from tide.v1 import scaler_pb2_grpc, telemetry_pb2_grpc

from services.common.clock import Clock, SystemClock
from services.common.entry import run_service
from services.common.server import ServiceSpec, serve
from services.scaler.actuator import Actuator, FileActuator, InMemoryActuator
from services.scaler.api import ADMIN_METHODS, ScalerServicer
from services.scaler.coordination import (
    CoordinatorClient,
    GrpcCoordinatorClient,
    InMemoryCoordinator,
)
from services.scaler.ingest import IngestCollector
from services.scaler.lifecycle import FaultPoint
from services.scaler.service import SWITCH_INTERVAL_S, ScalerCore, ScalerSettings
from services.scaler.store import DecisionStore
from services.scaler.telemetry_api import TelemetryServicer
from services.store import db
from tidebase.client import open_channel

logger = logging.getLogger("services.scaler")


def make_actuator(settings: ScalerSettings, clock: Clock) -> Actuator:
    """The actuator ``--actuator`` names (validated by ScalerSettings)."""
    total = settings.total_gpus or None
    kind, _, arg = settings.actuator.partition(":")
    if kind == "file":
        return FileActuator(Path(arg), total)
    if kind == "local":
        # Imported here: a scaler deployed with another actuator never loads local mode.
        from services.local.actuator import LocalActuator, LocalActuatorSettings

        return LocalActuator(
            LocalActuatorSettings(
                state_dir=Path(arg), coordinator=settings.coordinator, total_gpus=total
            ),
            clock,
        )
    return InMemoryActuator(total)


async def run(settings: ScalerSettings) -> None:
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    clock = SystemClock()
    # Migrations are idempotent; running them at start keeps the embedded case one command.
    await asyncio.to_thread(db.upgrade, settings.db)
    engine = db.make_engine(settings.db)
    store = DecisionStore(engine, settings.owner(), clock)
    actuator = make_actuator(settings, clock)
    coordinator: CoordinatorClient
    channel = open_channel(settings.coordinator) if settings.coordinator else None
    if channel is not None:
        coordinator = GrpcCoordinatorClient(channel)
    else:
        state = Path(settings.coordinator_state_file) if settings.coordinator_state_file else None
        mem = actuator if isinstance(actuator, InMemoryActuator) else None
        coordinator = InMemoryCoordinator(
            (lambda j: mem.replicas.get(j)) if mem is not None else None, path=state
        )
    core = ScalerCore(
        store=store,
        actuator=actuator,
        coordinator=coordinator,
        clock=clock,
        defaults=settings.policy(),
        ingest=settings.ingest(),
        fault=FaultPoint(),
        evaluate_interval_s=settings.evaluate_interval_s,
        rollup_flush_interval_s=settings.rollup_flush_interval_s,
    )
    REGISTRY.register(IngestCollector(core.engine))
    await core.start()

    async def shutdown() -> None:
        await core.flush_rollups(final=True)
        await core.close()
        if channel is not None:
            await channel.close()
        engine.dispose()

    await serve(
        settings,
        [
            ServiceSpec(
                telemetry_pb2_grpc.add_TelemetryServicer_to_server,
                TelemetryServicer(core.engine),
                "tide.v1.Telemetry",
            ),
            ServiceSpec(
                scaler_pb2_grpc.add_ScalerServicer_to_server,
                ScalerServicer(core),
                "tide.v1.Scaler",
            ),
        ],
        admin_methods=ADMIN_METHODS,
        background=[core.run],
        on_shutdown=[shutdown],
    )


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
