"""`python -m tide.services.coordinator --listen HOST:PORT --db URL --heartbeat-timeout-s S`

Migrates the database, reloads every job (applying the restart rules of
docs/resize-protocol.md), then serves tide.v1.Coordinator until SIGTERM.

With ``--leader-election sql`` several replicas share the store: the one holding
the lease row loads the jobs and serves; the others stand by (health
NOT_SERVING naming the leader, every call UNAVAILABLE) and take over once the
lease runs out. Every write is fenced by the lease's epoch, and a leader that
loses the lease exits with status 3 (docs/coordinator.md, "Standby replicas").
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from prometheus_client import REGISTRY

from tide.base.errors import TideError
from tide.services.common.clock import SystemClock
from tide.services.common.entry import run_service
from tide.services.common.metrics import register_build_info
from tide.services.common.readiness import Readiness
from tide.services.common.server import ServiceSpec, check_port_free, serve
from tide.services.common.validate import validate_request
from tide.services.coordinator.engine import Coordinator
from tide.services.coordinator.metrics import CoordinatorMetrics
from tide.services.coordinator.servicer import SERVICE_NAME, CoordinatorServicer, rules
from tide.services.coordinator.settings import CoordinatorSettings
from tide.services.coordinator.sql_store import SqlStore
from tide.services.store import db
from tide.services.store.leader import LeaderElector
from tide.services.store.leases import Fence, LeaseRecord, SqlLease
from tide.services.store.probe import StoreProbe
from tide.v1 import coordinator_pb2_grpc

logger = logging.getLogger(__name__)

#: Exit status of a replica that lost its lease: the kubelet restarts it, and it
#: comes back as a standby (the scaler's is the same).
EXIT_LEADERSHIP_LOST = 3


def _lost(why: str) -> None:
    # Nothing may act once the lease is gone, not even a graceful shutdown: leave at
    # once (the fenced writes cover what is already on the way).
    logger.critical("leadership lost: %s; exiting", why)
    logging.shutdown()
    os._exit(EXIT_LEADERSHIP_LOST)


async def _run(settings: CoordinatorSettings) -> None:
    clock = SystemClock()
    if problem := settings.tuning().lead_problem():
        logger.warning("%s", problem)
    # Before the schema and the jobs: a second coordinator on a busy port stops here.
    check_port_free(settings.listen)
    db.upgrade(settings.db)
    engine = db.make_engine(settings.db)
    factory = db.make_session_factory(engine)
    store = SqlStore(factory, clock.now, on_fenced=_lost)
    coordinator = Coordinator(store, clock, settings.tuning(), CoordinatorMetrics(REGISTRY))
    register_build_info(REGISTRY, "coordinator")
    # Health follows the store: members keep their state through an outage (their
    # calls get UNAVAILABLE), and new work goes elsewhere until it is back.
    probe = StoreProbe(engine)
    readiness = Readiness()
    probe.listen(readiness.follower("store"))
    background: list[Callable[[], Coroutine[Any, Any, None]]] = [probe.run]
    elector: LeaderElector | None = None
    if settings.leader_election == "off":
        await coordinator.call(coordinator.load)
        background.append(coordinator.run)
    else:
        elector = LeaderElector(
            SqlLease(factory, settings.owner(), lambda: db.utc_from_epoch(clock.now())),
            clock,
            settings.lease(),
            address=settings.advertise_address or settings.listen,
            name=settings.lease_name,
        )
        coordinator.standby = "no leader yet"
        coordinator.may_act = elector.may_act
        # Not ready until elected: a Service (or a client's health check) sends
        # launchers and the scaler to the leader only.
        await readiness.set_down("leadership", coordinator.standby)
        background.append(_elect(elector, coordinator, store, readiness))

    async def close_db() -> None:
        if elector is not None:
            # A planned stop (a rolling update) hands over now, not a lease later.
            await elector.release()
        coordinator.close()
        engine.dispose()

    await serve(
        settings,
        [
            ServiceSpec(
                coordinator_pb2_grpc.add_CoordinatorServicer_to_server,
                CoordinatorServicer(coordinator),
                SERVICE_NAME,
            )
        ],
        rules=rules(coordinator),
        validate=validate_request,
        background=background,
        on_shutdown=[close_db],
        readiness=readiness,
    )


def _elect(
    elector: LeaderElector, coordinator: Coordinator, store: SqlStore, readiness: Readiness
) -> Callable[[], Coroutine[Any, Any, None]]:
    async def elected(lease: LeaseRecord) -> None:
        # The fence first: the restart rules that load applies already write.
        store.fence = Fence(lease.name, lease.holder, lease.epoch)
        try:
            await coordinator.call(coordinator.take_over)
        except TideError as exc:
            # Holding the lease without the jobs would keep every standby out: leave,
            # and the lease runs out for one that can read the store.
            _lost(f"elected, but the jobs could not be loaded: {exc}")
        await readiness.set_up("leadership")

    async def follow(message: str) -> None:
        coordinator.standby = message
        await readiness.set_down("leadership", message)

    async def run() -> None:
        await elector.run(elected, _lost, follow)

    async def lead() -> None:
        await asyncio.gather(run(), _after(elector, coordinator))

    lead.__qualname__ = "LeaderElector.run"
    return lead


async def _after(elector: LeaderElector, coordinator: Coordinator) -> None:
    await elector.wait_elected()
    await coordinator.run()


def main(argv: list[str] | None = None) -> int:
    return run_service(
        CoordinatorSettings,
        _run,
        name="coordinator",
        description="Tide coordinator: membership, checkpoint barriers, rendezvous.",
        argv=argv,
    )


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
