"""`python -m services.coordinator --listen HOST:PORT --db URL --heartbeat-timeout-s S`

Migrates the database, reloads every job (applying the restart rules of
docs/resize-protocol.md), then serves tide.v1.Coordinator until SIGTERM.
"""

from __future__ import annotations

import logging
import sys

from prometheus_client import REGISTRY
from tide.v1 import coordinator_pb2_grpc

from services.common.clock import SystemClock
from services.common.entry import run_service
from services.common.metrics import register_build_info
from services.common.readiness import Readiness
from services.common.server import ServiceSpec, serve
from services.common.validate import validate_request
from services.coordinator.engine import Coordinator
from services.coordinator.metrics import CoordinatorMetrics
from services.coordinator.servicer import SERVICE_NAME, CoordinatorServicer, rules
from services.coordinator.settings import CoordinatorSettings
from services.coordinator.sql_store import SqlStore
from services.store import db
from services.store.probe import StoreProbe

logger = logging.getLogger(__name__)


async def _run(settings: CoordinatorSettings) -> None:
    clock = SystemClock()
    if problem := settings.tuning().lead_problem():
        logger.warning("%s", problem)
    db.upgrade(settings.db)
    engine = db.make_engine(settings.db)
    store = SqlStore(db.make_session_factory(engine), clock.now)
    coordinator = Coordinator(store, clock, settings.tuning(), CoordinatorMetrics(REGISTRY))
    register_build_info(REGISTRY, "coordinator")
    coordinator.load()
    # Health follows the store: members keep their state through an outage (their
    # calls get UNAVAILABLE), and new work goes elsewhere until it is back.
    probe = StoreProbe(engine)
    readiness = Readiness()
    probe.listen(readiness.follower("store"))

    async def close_db() -> None:
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
        background=[coordinator.run, probe.run],
        on_shutdown=[close_db],
        readiness=readiness,
    )


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
