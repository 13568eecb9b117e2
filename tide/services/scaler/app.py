"""The scaler process put together: store, engine, servicers, server.

``python -m tide.services.scaler`` (tide/services/scaler/__main__.py) calls :func:`serve_scaler`
with the real coordinator client and actuator; the test entry point
(``python -m tide.services.testing.scaler``) calls it with doubles. Nothing here
picks an implementation.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from prometheus_client import REGISTRY

from tide.base.errors import TideError
from tide.services.common.clock import Clock
from tide.services.common.metrics import register_build_info
from tide.services.common.readiness import Readiness
from tide.services.common.server import ServiceSpec, serve
from tide.services.common.validate import validate_request
from tide.services.scaler.actuators import Actuator
from tide.services.scaler.actuators.counted import CountedActuator
from tide.services.scaler.coordination import CoordinatorClient
from tide.services.scaler.engine.core import ScalerCore
from tide.services.scaler.kube.client import api_client
from tide.services.scaler.kube.lease import KubernetesLease
from tide.services.scaler.leases import LeaderElector, LeaseBackend, ShardLeases
from tide.services.scaler.lifecycle import FaultHook
from tide.services.scaler.metrics import IngestCollector, ScalerMetrics
from tide.services.scaler.peers import GrpcPeerLink
from tide.services.scaler.servicer import (
    RULES,
    ScalerPeersServicer,
    ScalerServicer,
    TelemetryServicer,
)
from tide.services.scaler.settings import ScalerSettings
from tide.services.scaler.sharding import Sharding
from tide.services.scaler.store import DecisionStore
from tide.services.scaler.tuning import heap_freezer, tune_process
from tide.services.store import db
from tide.services.store.leases import LeaseRecord
from tide.services.store.probe import StoreProbe
from tide.v1 import peers_pb2_grpc, scaler_pb2_grpc, telemetry_pb2_grpc

logger = logging.getLogger(__name__)

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
    tune_process()
    # Migrations are idempotent; running them at start keeps the embedded case one command.
    await asyncio.to_thread(db.upgrade, settings.db)
    engine = db.make_engine(settings.db)
    store = DecisionStore(engine, settings.owner(), clock)
    probe = StoreProbe(engine)
    readiness = Readiness()
    probe.listen(readiness.follower("store"))
    metrics = ScalerMetrics(REGISTRY)
    core = ScalerCore(
        store=store,
        actuator=CountedActuator(actuator, metrics.actuator_errors),
        coordinator=coordinator,
        clock=clock,
        defaults=settings.policy,
        ingest=settings.ingest(),
        fault=fault,
        evaluate_interval_s=settings.evaluate_interval_s,
        reconcile_interval_s=settings.reconcile_interval_s,
        rollup_flush_interval_s=settings.rollup_flush_interval_s,
        rollup_retention_days=settings.rollup_retention_days,
        metrics=metrics,
        detail_retention_days=settings.utilization_detail_retention_days,
        store_probe=probe,
        decision_retention_days=settings.decision_retention_days,
        retention_batch_rows=settings.retention_batch_rows,
        heap=heap_freezer(),
    )
    REGISTRY.register(IngestCollector(core.ingest))
    register_build_info(REGISTRY, "scaler")
    background: list[Background] = [probe.run]
    elector: LeaderElector | None = None
    attached = [task for a in attach for task in a(core)]
    sharding: Sharding | None = None
    if settings.shards:
        leases = ShardLeases(store, clock, settings.sharding(), address=settings.advertise_address)
        sharding = Sharding(
            core,
            leases,
            GrpcPeerLink(settings.credentials(), tls_server_name=settings.peer_tls_server_name),
            ship_interval_s=settings.partials_ship_interval_s,
        )
        await core.start_sharded()
        # Ready while it runs rounds: the Service sends agents and callers to every
        # replica; writes for a job owned elsewhere answer UNAVAILABLE naming the owner.
        await readiness.set_down("shards", "no shard round yet")
        background += [
            _shard_rounds(sharding, readiness),
            sharding.shipping,
            core.run,
            *attached,
        ]
    elif settings.leader_election == "off":
        await core.start()
        background += [core.run, *attached]
    else:
        elector = LeaderElector(
            _lease_backend(settings, store, clock),
            clock,
            settings.lease(),
            address=settings.advertise_address or settings.listen,
            name=settings.lease_name,
        )
        core.ownership.leader = elector
        core.controller.may_act = elector.may_act
        # Not ready until elected: the Service sends agents and callers to the leader.
        await readiness.set_down("leadership", "no leader yet")
        background += [_elect(elector, core, readiness), _lead(elector, core.run)]
        # What watches the cluster for the core (discovery, Events) acts: leader only.
        background += [_lead(elector, task) for task in attached]

    async def shutdown() -> None:
        await core.flush_rollups(final=True)
        await core.close()
        if elector is not None:
            # A planned stop (a rolling update) hands over now, not a lease later.
            await elector.release()
        if sharding is not None:
            await sharding.leave()
        for step in on_shutdown:
            await step()
        store.close()
        engine.dispose()

    await serve(
        settings,
        [
            ServiceSpec(
                telemetry_pb2_grpc.add_TelemetryServicer_to_server,
                TelemetryServicer(core.ingest),
                "tide.v1.Telemetry",
            ),
            ServiceSpec(
                scaler_pb2_grpc.add_ScalerServicer_to_server,
                ScalerServicer(core),
                "tide.v1.Scaler",
            ),
            *(
                [
                    ServiceSpec(
                        peers_pb2_grpc.add_ScalerPeersServicer_to_server,
                        ScalerPeersServicer(core),
                        "tide.v1.ScalerPeers",
                    )
                ]
                if sharding is not None
                else []
            ),
        ],
        rules=RULES,
        validate=validate_request,
        background=background,
        on_shutdown=[shutdown],
        readiness=readiness,
        on_bound=lambda port: _advertise(settings, sharding, port),
    )


def _advertise(settings: ScalerSettings, sharding: Sharding | None, port: int) -> None:
    """The address other replicas ship partials to: advertise_address, else the listen
    address with the port it bound (port 0 in tests)."""
    if sharding is not None and not settings.advertise_address:
        host = settings.listen.rpartition(":")[0]
        sharding.leases.address = f"{host}:{port}"


def _shard_rounds(sharding: Sharding, readiness: Readiness) -> Background:
    async def run() -> None:
        renew_s = sharding.leases.settings.renew_s
        while True:
            before = sharding.leases.rounds_ok
            await sharding.round()
            if sharding.leases.rounds_ok > before:
                await readiness.set_up("shards")
            else:
                await readiness.set_down("shards", "shard round failed (the store?)")
            await asyncio.sleep(renew_s)

    run.__qualname__ = "Sharding.rounds"
    return run


def _lease_backend(settings: ScalerSettings, store: DecisionStore, clock: Clock) -> LeaseBackend:
    if settings.leader_election == "kubernetes":
        api = api_client(settings.lease_kubeconfig, what="lease_kubeconfig")
        # One try must end within the renewal period, or the elector gives up on it.
        return KubernetesLease(
            api,
            settings.lease_namespace,
            store.owner_id,
            clock,
            request_timeout_s=settings.lease_renew_s,
        )
    return store


#: Exit status of a scaler replica that lost its lease: the kubelet restarts it,
#: and it comes back as a follower.
EXIT_LEADERSHIP_LOST = 3


def _elect(
    elector: LeaderElector, core: ScalerCore, readiness: Readiness
) -> Callable[[], Coroutine[Any, Any, None]]:
    async def elected(_lease: LeaseRecord) -> None:
        # Takes every job (a new owner epoch each) and resumes their open decisions.
        await core.start()
        await readiness.set_up("leadership")

    async def follow(message: str) -> None:
        await readiness.set_down("leadership", message)
        try:
            await core.follow()
        except TideError as exc:
            # The store is away: reads answer from the last view, and the probe says so.
            logger.warning("follower: jobs not refreshed from the store: %s", exc)

    def lost(why: str) -> None:
        # Nothing may act once the lease is gone, not even a graceful shutdown's
        # flush: leave at once (the store's fencing covers writes already on the way).
        logger.critical("leadership lost: %s; exiting", why)
        logging.shutdown()
        os._exit(EXIT_LEADERSHIP_LOST)

    async def run() -> None:
        await elector.run(elected, lost, follow)

    run.__qualname__ = "LeaderElector.run"
    return run


def _lead(elector: LeaderElector, task: Background) -> Background:
    async def run() -> None:
        await elector.wait_elected()
        await task()

    run.__qualname__ = getattr(task, "__qualname__", "task")
    return run
