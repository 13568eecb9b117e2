"""The services as processes: no TLS and no --insecure is a one-line exit 2; health is
answerable in plaintext on its own port and nothing else is; unparseable requests are
INVALID_ARGUMENT with no traceback per request; no token in --help."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.procs import ROOT, start_service
from tide.base.client import open_channel
from tide.services.common.pki import CertificateAuthority
from tide.services.testing.ports import free_port

pytestmark = pytest.mark.integration

SECURE_ENV = {k: v for k, v in os.environ.items() if k != "TIDE_INSECURE"}


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env if env is not None else SECURE_ENV,
    )


@pytest.mark.parametrize(
    "args",
    [
        ("tide.services.coordinator", "--db", "sqlite://"),
        ("tide.services.scaler", "--coordinator", "127.0.0.1:1", "--actuator", "local:/tmp/x"),
        ("tide.services.agent", "--source", "synthetic", "--no-watch-node"),
    ],
    ids=["coordinator", "scaler", "agent"],
)
def test_no_tls_and_no_insecure_exits_2_saying_why(args: tuple[str, ...]) -> None:
    r = _run(*args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--insecure" in lines[0] and "TLS" in lines[0], r.stderr


def test_no_token_in_help() -> None:
    env = {**SECURE_ENV, "TIDE_ADMIN_TOKEN": "s3cret-admin-token", "TIDE_TOKEN_FILE": "/x"}
    for service in ("tide.services.coordinator", "tide.services.scaler", "tide.services.agent"):
        r = _run(service, "--help", env=env)
        assert r.returncode == 0 and "s3cret-admin-token" not in r.stdout + r.stderr


def test_health_is_plaintext_on_its_port_and_nothing_else_answers_without_credentials(
    tmp_path: Path,
) -> None:
    ca = CertificateAuthority.create(tmp_path / "pki")
    server = ca.server()
    health_port = free_port()
    svc = start_service(
        [
            "-m",
            "tide.services.coordinator",
            "--listen",
            "127.0.0.1:0",
            "--db",
            f"sqlite:///{tmp_path / 'c.db'}",
            "--tls-cert-file",
            server.cert_file,
            "--tls-key-file",
            server.key_file,
            "--tls-client-ca-file",
            ca.ca_file,
            "--health-listen",
            f"127.0.0.1:{health_port}",
        ],
        env=SECURE_ENV,
    )

    async def probe() -> tuple[int, grpc.StatusCode, grpc.StatusCode, int]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as ch:
            health: object = health_pb2_grpc.HealthStub(ch)
            got = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)  # type: ignore[attr-defined]
            # The health port serves health alone.
            with pytest.raises(grpc.aio.AioRpcError) as other:
                await ch.unary_unary("/tide.v1.Coordinator/GetJobStatus")(b"", timeout=10)
        async with grpc.aio.insecure_channel(svc.target) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as plain:
                await ch.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=10)
        creds = ca.credentials(ca.scaler())
        garbage = 0
        async with open_channel(svc.target, credentials=creds) as ch:
            call = ch.unary_unary("/tide.v1.Coordinator/GetJobStatus")
            for _ in range(30):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(b"\xff\xff\xff\x0f garbage", timeout=10)
                garbage += err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        return got.status, other.value.code(), plain.value.code(), garbage

    try:
        status, other, plain, garbage = asyncio.run(probe())
    finally:
        svc.terminate()
        _, stderr = svc.proc.communicate(timeout=30)
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert other is grpc.StatusCode.UNIMPLEMENTED
    assert plain is grpc.StatusCode.UNAVAILABLE
    assert garbage == 30
    # Counted, logged at most once every few seconds, never a traceback per request.
    assert stderr.count("unparseable request") <= 2, stderr
    assert "Traceback" not in stderr
