"""The scaler process put together: store, engine, servicers, server.

``python -m services.scaler`` (services/scaler/__main__.py) calls :func:`serve_scaler`
with the real coordinator client and actuator; the test entry point
(``python -m services.testing.scaler``) calls it with doubles. Nothing here
picks an implementation.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from prometheus_client import REGISTRY
from tide.v1 import scaler_pb2_grpc, telemetry_pb2_grpc

from services.common.clock import Clock
from services.common.metrics import register_build_info
from services.common.server import ServiceSpec, serve
from services.scaler.actuators import Actuator
from services.scaler.actuators.counted import CountedActuator
from services.scaler.coordination import CoordinatorClient
from services.scaler.lifecycle import FaultHook
from services.scaler.metrics import IngestCollector, ScalerMetrics
from services.scaler.service import ScalerCore
from services.scaler.servicer import ADMIN_METHODS, ScalerServicer, TelemetryServicer
from services.scaler.settings import SWITCH_INTERVAL_S, ScalerSettings
from services.scaler.store import DecisionStore
from services.store import db

Background = Callable[[], Coroutine[Any, Any, None]]


async def serve_scaler(
    settings: ScalerSettings,
    *,
    actuator: Actuator,
    coordinator: CoordinatorClient,
    clock: Clock,
    fault: FaultHook | None = None,
    on_shutdown: Sequence[Callable[[], Awaitable[None]]] = (),
    attach: Sequence[Callable[[ScalerCore], Sequence[Background]]] = (),
) -> None:
    """Serve the Telemetry and Scaler APIs and run the control loop until stopped.

    ``attach``: each is handed the core and returns background tasks that run beside
    the control loop (the cluster link of the Kubernetes actuator: discovery, Events)."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # Migrations are idempotent; running them at start keeps the embedded case one command.
    await asyncio.to_thread(db.upgrade, settings.db)
    engine = db.make_engine(settings.db)
    store = DecisionStore(engine, settings.owner(), clock)
    metrics = ScalerMetrics(REGISTRY)
    core = ScalerCore(
        store=store,
        actuator=CountedActuator(actuator, metrics.actuator_errors),
        coordinator=coordinator,
        clock=clock,
        defaults=settings.policy(),
        ingest=settings.ingest(),
        fault=fault,
        evaluate_interval_s=settings.evaluate_interval_s,
        rollup_flush_interval_s=settings.rollup_flush_interval_s,
        rollup_retention_days=settings.rollup_retention_days,
        metrics=metrics,
        detail_retention_days=settings.utilization_detail_retention_days,
    )
    REGISTRY.register(IngestCollector(core.engine))
    register_build_info(REGISTRY, "scaler")
    await core.start()
    background: list[Background] = [core.run]
    for a in attach:
        background.extend(a(core))

    async def shutdown() -> None:
        await core.flush_rollups(final=True)
        await core.close()
        for step in on_shutdown:
            await step()
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
        background=background,
        on_shutdown=[shutdown],
    )
