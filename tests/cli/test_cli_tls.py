"""The CLI against an mTLS scaler (tide.services.testing.stack): a TLS cause is named as
such, never as "unreachable", and --tls-server-name (or TIDE_TLS_SERVER_NAME) is the
port-forward's answer to a certificate that names the Service, not 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.procs import ROOT
from tide.services.testing.stack import Stack, start_stack

pytestmark = pytest.mark.component


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = await start_stack(tmp_path)
    try:
        yield s
    finally:
        await s.close()


async def tide(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TIDE_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tide.services.cli", *args,
        cwd=ROOT, env={**clean, **(env or {})},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


async def test_tls_causes_are_named_and_the_server_name_is_settable(stack: Stack) -> None:
    assert stack.ca is not None
    user = stack.ca.user("oncall", "viewer")
    creds = {
        "TIDE_TLS_CA_FILE": stack.ca.ca_file,
        "TIDE_TLS_CLIENT_CERT_FILE": user.cert_file,
        "TIDE_TLS_CLIENT_KEY_FILE": user.key_file,
    }
    scaler = ("jobs", "--scaler", stack.scaler_target)

    code, err = await tide(*scaler)
    assert code == 2 and "speaks TLS and no CA" in err and "unreachable" not in err, err

    # A port-forward: the certificate does not hold the name asked for.
    code, err = await tide(*scaler, "--tls-server-name", "tide-scaler.tide-system.svc", env=creds)
    assert code == 2 and "does not verify" in err and "--tls-server-name" in err, err

    # The name the certificate holds, as a flag and from the environment.
    code, err = await tide(*scaler, "--tls-server-name", "localhost", env=creds)
    assert code == 0, err
    code, err = await tide(*scaler, env={**creds, "TIDE_TLS_SERVER_NAME": "localhost"})
    assert code == 0, err
