"""A scaler and a coordinator in this process, on real sockets, with the production
servicers, rules and guard: mTLS from a fresh CA, or plaintext (``tls=False``).

The hostile suite (tests/security, bench/security.py) runs against it. The scaler's
actuator is the in-memory one and its coordinator link is the real gRPC client,
presenting the scaler's certificate, so the scaler → coordinator link is guarded too.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from tide.base.client import open_channel
from tide.base.credentials import NO_CREDENTIALS, ClientCredentials
from tide.services.common.clock import SystemClock
from tide.services.common.config import CommonSettings
from tide.services.common.guard import TokenReviewer
from tide.services.common.pki import CertificateAuthority, Issued
from tide.services.common.server import RunningServer, ServiceSpec, start_server
from tide.services.common.validate import validate_request
from tide.services.coordinator.engine import Coordinator
from tide.services.coordinator.servicer import SERVICE_NAME, CoordinatorServicer, rules
from tide.services.coordinator.settings import Tuning
from tide.services.coordinator.store import MemoryStore
from tide.services.scaler.coordination import GrpcCoordinatorClient
from tide.services.scaler.engine.core import ScalerCore
from tide.services.scaler.ingest import IngestSettings
from tide.services.scaler.policy import PolicySettings
from tide.services.scaler.servicer import RULES, ScalerServicer, TelemetryServicer
from tide.services.scaler.store import DecisionStore
from tide.services.store import db
from tide.services.testing.actuators import InMemoryActuator
from tide.v1 import coordinator_pb2_grpc, scaler_pb2_grpc, telemetry_pb2_grpc


@dataclass
class Stack:
    ca: CertificateAuthority | None
    scaler: RunningServer
    coordinator: RunningServer
    core: ScalerCore
    coord: Coordinator
    actuator: InMemoryActuator
    _closers: list[Any] = field(default_factory=list)

    @property
    def scaler_target(self) -> str:
        return f"127.0.0.1:{self.scaler.port}"

    @property
    def coordinator_target(self) -> str:
        return f"127.0.0.1:{self.coordinator.port}"

    def credentials(self, issued: Issued | None) -> ClientCredentials:
        """Client credentials with this CA and ``issued`` (None: TLS, no certificate)."""
        if self.ca is None:
            return NO_CREDENTIALS
        if issued is None:
            return ClientCredentials(tls_ca_file=self.ca.ca_file)
        return self.ca.credentials(issued)

    def channel(self, target: str, issued: Issued | None = None) -> grpc.aio.Channel:
        return open_channel(target, credentials=self.credentials(issued), own_subchannels=True)

    async def close(self) -> None:
        for closer in reversed(self._closers):
            await closer()


async def start_stack(
    directory: Path,
    *,
    tls: bool = True,
    require_client_cert: bool = True,
    admin_token: str = "",
    reviewer: TokenReviewer | None = None,
    token_identities: tuple[str, ...] = (),
) -> Stack:
    """Both servers, with mTLS when ``tls`` (a CA under ``directory/pki``); without,
    they run as ``--insecure`` would. ``require_client_cert=False``: TLS without
    client certificates, the ServiceAccount-token setup."""
    ca = CertificateAuthority.create(directory / "pki") if tls else None
    tls_settings: dict[str, Any] = {}
    if ca is not None:
        server = ca.server()
        tls_settings = {"tls_cert_file": server.cert_file, "tls_key_file": server.key_file}
        if require_client_cert:
            tls_settings["tls_client_ca_file"] = ca.ca_file
    settings = CommonSettings(
        listen="127.0.0.1:0",
        insecure=not tls,
        admin_token=admin_token,
        token_identities=token_identities,
        **tls_settings,
    )
    closers: list[Any] = []
    registry = CollectorRegistry()

    coord = Coordinator(MemoryStore(), SystemClock(), Tuning())
    coord.load()
    coordinator = await start_server(
        settings,
        [
            ServiceSpec(
                coordinator_pb2_grpc.add_CoordinatorServicer_to_server,
                CoordinatorServicer(coord),
                SERVICE_NAME,
            )
        ],
        rules=rules(coord),
        validate=validate_request,
        reviewer=reviewer,
        registry=registry,
    )
    closers.append(lambda: coordinator.stop(0))

    url = f"sqlite:///{directory / 'scaler.db'}"
    await asyncio.to_thread(db.upgrade, url)
    engine = db.make_engine(url)
    clock = SystemClock()
    store = DecisionStore(engine, "stack", clock)
    actuator = InMemoryActuator()
    link_creds = NO_CREDENTIALS
    if ca is not None:
        link_creds = ca.credentials(ca.scaler())
    link = open_channel(f"127.0.0.1:{coordinator.port}", credentials=link_creds)
    closers.append(link.close)
    core = ScalerCore(
        store=store,
        actuator=actuator,
        coordinator=GrpcCoordinatorClient(link),
        clock=clock,
        defaults=PolicySettings(),
        ingest=IngestSettings(),
        evaluate_interval_s=0.5,
    )
    await core.start()
    loop = asyncio.create_task(core.run())

    async def close_core() -> None:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await core.close()
        store.close()
        engine.dispose()

    closers.append(close_core)
    scaler = await start_server(
        settings,
        [
            ServiceSpec(
                scaler_pb2_grpc.add_ScalerServicer_to_server, ScalerServicer(core), "tide.v1.Scaler"
            ),
            ServiceSpec(
                telemetry_pb2_grpc.add_TelemetryServicer_to_server,
                TelemetryServicer(core.ingest),
                "tide.v1.Telemetry",
            ),
        ],
        rules=RULES,
        validate=validate_request,
        reviewer=reviewer,
        registry=registry,
    )
    closers.append(lambda: scaler.stop(0))
    return Stack(ca, scaler, coordinator, core, coord, actuator, closers)
