"""tide.base.tlsprobe: each credential mistake named in one line, and a server that is
merely down or fine named as nothing (so the caller keeps retrying)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tide.base.credentials import NO_CREDENTIALS, ClientCredentials
from tide.base.tlsprobe import diagnose
from tide.services.common.pki import CertificateAuthority
from tide.services.testing.stack import Stack, start_stack

pytestmark = pytest.mark.component


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = await start_stack(tmp_path)
    try:
        yield s
    finally:
        await s.close()


async def probe(target: str, creds: ClientCredentials, server_name: str = "") -> str | None:
    return await asyncio.to_thread(diagnose, target, creds, server_name=server_name)


async def test_good_credentials_and_a_closed_port_are_not_a_tls_cause(stack: Stack) -> None:
    assert stack.ca is not None
    good = stack.ca.credentials(stack.ca.scaler())
    assert await probe(stack.coordinator_target, good) is None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    assert await probe(closed, good) is None
    assert await probe(closed, NO_CREDENTIALS) is None


async def test_no_ca_for_a_tls_server(stack: Stack) -> None:
    cause = await probe(stack.coordinator_target, NO_CREDENTIALS)
    assert cause is not None
    assert "speaks TLS and no CA" in cause and "TIDE_TLS_CA_FILE" in cause


async def test_a_wrong_ca(stack: Stack, tmp_path: Path) -> None:
    other = CertificateAuthority.create(tmp_path / "other")
    cause = await probe(stack.coordinator_target, ClientCredentials(tls_ca_file=other.ca_file))
    assert cause is not None and "does not verify against" in cause, cause


async def test_a_certificate_for_other_names_suggests_the_server_name(stack: Stack) -> None:
    assert stack.ca is not None
    creds = stack.ca.credentials(stack.ca.scaler())
    cause = await probe(stack.coordinator_target, creds, server_name="tide-scaler.tide-system.svc")
    assert cause is not None and "--tls-server-name" in cause, cause
    assert await probe(stack.coordinator_target, creds, server_name="localhost") is None


async def test_a_client_certificate_from_another_ca_is_refused(
    stack: Stack, tmp_path: Path
) -> None:
    assert stack.ca is not None
    other = CertificateAuthority.create(tmp_path / "other")
    forged = other.scaler()
    creds = ClientCredentials(
        tls_ca_file=stack.ca.ca_file,
        tls_client_cert_file=forged.cert_file,
        tls_client_key_file=forged.key_file,
    )
    cause = await probe(stack.coordinator_target, creds)
    assert cause is not None and "refused this client's TLS certificate" in cause, cause


async def test_a_ca_for_a_plaintext_server(tmp_path: Path) -> None:
    s = await start_stack(tmp_path, tls=False)
    try:
        ca = CertificateAuthority.create(tmp_path / "pki")
        cause = await probe(s.coordinator_target, ClientCredentials(tls_ca_file=ca.ca_file))
        assert cause is not None and "does not speak TLS" in cause, cause
        assert await probe(s.coordinator_target, NO_CREDENTIALS) is None
    finally:
        await s.close()


async def test_no_client_certificate_for_an_mtls_server(stack: Stack) -> None:
    assert stack.ca is not None
    cause = await probe(stack.coordinator_target, ClientCredentials(tls_ca_file=stack.ca.ca_file))
    assert cause is not None and "requires a client certificate" in cause, cause
