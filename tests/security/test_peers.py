"""Sharded replicas' link (tide.v1.ScalerPeers, tide/services/scaler/peers.py) under mTLS: a
scaler identity ships partials, dialling the replica by address and checking the name
its certificate carries (the Service's); any other identity is refused."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tide.base.credentials import ClientCredentials
from tide.base.errors import PermissionDenied, TideError
from tide.services.common.config import CommonSettings
from tide.services.common.pki import CertificateAuthority, Issued
from tide.services.common.server import ServiceSpec, start_server
from tide.services.common.validate import validate_request
from tide.services.scaler.engine.core import ScalerCore
from tide.services.scaler.partials import JobPartial
from tide.services.scaler.peers import GrpcPeerLink
from tide.services.scaler.servicer import RULES, ScalerPeersServicer
from tide.services.scaler.store import DecisionStore
from tide.services.store import db
from tide.services.testing.actuators import InMemoryActuator
from tide.services.testing.clock import FakeClock
from tide.services.testing.coordinator import InMemoryCoordinator
from tide.v1 import peers_pb2_grpc

pytestmark = pytest.mark.component

SERVICE = "tide-scaler"


def creds(ca: CertificateAuthority, issued: Issued) -> ClientCredentials:
    return ca.credentials(issued)


async def test_only_scalers_ship_partials_checked_by_the_service_name(tmp_path: Path) -> None:
    ca = CertificateAuthority.create(tmp_path / "pki")
    # As cert-manager issues it in the chart: the Service's names, no pod IP.
    server = ca.issue("scaler-serving", hosts=(SERVICE,), server=True)
    settings = CommonSettings(
        listen="127.0.0.1:0",
        tls_cert_file=server.cert_file,
        tls_key_file=server.key_file,
        tls_client_ca_file=ca.ca_file,
    )
    url = f"sqlite:///{tmp_path / 'scaler.db'}"
    await asyncio.to_thread(db.upgrade, url)
    engine = db.make_engine(url)
    clock = FakeClock(time.time())
    core = ScalerCore(
        store=DecisionStore(engine, "r1", clock),
        actuator=InMemoryActuator(),
        coordinator=InMemoryCoordinator(),
        clock=clock,
    )
    running = await start_server(
        settings,
        [
            ServiceSpec(
                peers_pb2_grpc.add_ScalerPeersServicer_to_server,
                ScalerPeersServicer(core),
                "tide.v1.ScalerPeers",
            )
        ],
        rules=RULES,
        validate=validate_request,
        registry=CollectorRegistry(),
    )
    address = f"127.0.0.1:{running.port}"
    part = JobPartial("ns/a", 30.0, 10, seen_s={("n1", 0): clock.now(), ("n1", 1): clock.now()})
    links: list[GrpcPeerLink] = []
    try:
        scaler = GrpcPeerLink(creds(ca, ca.scaler()), tls_server_name=SERVICE)
        links.append(scaler)
        sent, refused = await scaler.ship(address, "r0", [part], timeout_s=5.0)
        assert sent > 0 and refused == 0
        assert core.ingest.fresh_gpus_of("ns/a", clock.now()) == 2
        assert core.metrics.partials_received._value.get() == 1

        # Without the name, the pod IP is not in the certificate: the handshake fails.
        unnamed = GrpcPeerLink(creds(ca, ca.scaler()))
        links.append(unnamed)
        with pytest.raises(TideError):
            await unnamed.ship(address, "r0", [part], timeout_s=2.0)
        # An agent (or a user) is not a scaler replica.
        for who in (ca.agent("node-a"), ca.user("ada", "admin")):
            other = GrpcPeerLink(creds(ca, who), tls_server_name=SERVICE)
            links.append(other)
            with pytest.raises(PermissionDenied):
                await other.ship(address, "r0", [part], timeout_s=5.0)
        assert core.metrics.partials_received._value.get() == 1
    finally:
        for link in links:
            await link.close()
        await running.stop(0)
        await core.close()
        engine.dispose()
