"""`python -m services.local.scaler`: the scaler with the local actuator (`tide up`, `tide demo`).

The scaler's own entry point (`python -m services.scaler`) offers the
in-memory and file actuators; this one builds the same ScalerCore with
:class:`services.local.actuator.LocalActuator`, so decisions start and stop
trainer launchers on this machine. It takes every flag of the scaler plus
``--local-state-dir`` and ``--launcher``. Once `services.scaler` offers
``--actuator local:DIR`` this module can go.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import REGISTRY
from tide.v1 import scaler_pb2_grpc, telemetry_pb2_grpc

from services.common import db, logs
from services.common.client import open_channel
from services.common.clock import SystemClock
from services.common.config import load_settings, setting
from services.common.errors import ConfigError, TideError
from services.common.server import ServiceSpec, serve
from services.local.actuator import LAUNCHER, LocalActuator, LocalActuatorSettings
from services.scaler.api import ADMIN_METHODS, ScalerServicer
from services.scaler.coordination import GrpcCoordinatorClient
from services.scaler.ingest import IngestCollector
from services.scaler.lifecycle import FaultPoint
from services.scaler.service import ScalerCore, ScalerSettings
from services.scaler.store import DecisionStore
from services.scaler.telemetry_api import TelemetryServicer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalScalerSettings(ScalerSettings):
    local_state_dir: str = setting(".tide", "where local pods keep job specs, pid files and logs")
    launcher: str = setting(
        shlex.join(LAUNCHER), "the trainer launcher command (pod flags and the job command follow)"
    )
    stop_grace_s: float = setting(10.0, "SIGTERM to SIGKILL grace when a local pod is stopped")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.coordinator:
            raise ConfigError("coordinator: local pods need the coordinator's HOST:PORT, got ''")
        self.actuator_settings()

    def actuator_settings(self) -> LocalActuatorSettings:
        return LocalActuatorSettings(
            state_dir=Path(self.local_state_dir),
            coordinator=self.coordinator,
            launcher=tuple(shlex.split(self.launcher)),
            total_gpus=self.total_gpus or None,
            stop_grace_s=self.stop_grace_s,
        )


async def run(settings: LocalScalerSettings) -> None:
    clock = SystemClock()
    await asyncio.to_thread(db.upgrade, settings.database_url)
    engine = db.make_engine(settings.database_url)
    store = DecisionStore(engine, settings.owner(), clock)
    actuator = LocalActuator(settings.actuator_settings(), clock)
    channel = open_channel(settings.coordinator)
    core = ScalerCore(
        store=store,
        actuator=actuator,
        coordinator=GrpcCoordinatorClient(channel),
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
                scaler_pb2_grpc.add_ScalerServicer_to_server, ScalerServicer(core), "tide.v1.Scaler"
            ),
        ],
        admin_methods=ADMIN_METHODS,
        background=[core.run],
        on_shutdown=[shutdown],
    )


def main(argv: list[str] | None = None) -> int:
    try:
        settings = load_settings(
            LocalScalerSettings,
            sys.argv[1:] if argv is None else argv,
            prog="python -m services.local.scaler",
            description="Tide scaler whose actuator runs trainer launchers on this machine.",
        )
    except ConfigError as exc:
        print(f"services.local.scaler: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level, settings.log_format)
    try:
        asyncio.run(run(settings))
    except TideError as exc:
        logger.error("scaler stopped: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
