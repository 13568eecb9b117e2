"""`tide scale --wait` and `tide history -w` against a scaler that requires credentials
(the real scaler process over TLS, with an admin token and no --insecure: a caller
without a token is refused "no credentials"), as in the chart's scaler pod: the
WatchDecisions stream carries the same token as the unary calls, whether it came as
``--token`` or from TIDE_TOKEN_FILE (it went out bare with ``--token``, and the scaler
refused it after the resize had been requested)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from tests.support.procs import ROOT, ServiceProcess, start_memory_scaler
from tide.services.common.pki import CertificateAuthority
from tide.v1 import scaler_pb2, scaler_pb2_grpc

pytestmark = pytest.mark.integration

TOKEN = "w4tch-t0ken"
#: One job per case: each resizes its own from 2 replicas.
JOBS = ("ml/flag", "ml/env", "ml/file-flag", "ml/watched-env", "ml/watched-file-flag")


@dataclass(frozen=True)
class Secured:
    svc: ServiceProcess
    ca_file: str
    token_file: str

    def args(self) -> tuple[str, ...]:
        # The name the test CA's server certificate holds; 127.0.0.1 it does not.
        return (
            "--scaler", self.svc.target,
            "--tls-ca-file", self.ca_file,
            "--tls-server-name", "localhost",
        )  # fmt: skip


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    d = tmp_path_factory.mktemp("watch-creds")
    ca = CertificateAuthority.create(d / "pki")
    server = ca.server()
    token_file = d / "token"
    token_file.write_text(TOKEN + "\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TIDE_INSECURE", raising=False)  # tests/conftest.py sets it
        svc = start_memory_scaler(
            f"sqlite:///{d / 'tide.db'}",
            "--admin-token", TOKEN,
            "--tls-cert-file", server.cert_file,
            "--tls-key-file", server.key_file,
        )  # fmt: skip
    try:
        creds = grpc.ssl_channel_credentials(Path(ca.ca_file).read_bytes())
        options = [("grpc.ssl_target_name_override", "localhost")]
        with grpc.secure_channel(svc.target, creds, options=options) as ch:
            stub = scaler_pb2_grpc.ScalerStub(ch)
            for job in JOBS:
                stub.UpsertJob(
                    scaler_pb2.UpsertJobRequest(
                        job_id=job, policy=scaler_pb2.Policy(min_replicas=2, max_replicas=6)
                    ),
                    timeout=10,
                    metadata=(("authorization", f"Bearer {TOKEN}"),),
                )
            # The scaler asks for credentials: a bare stream is refused.
            watch = stub.WatchDecisions(scaler_pb2.WatchDecisionsRequest(), timeout=10)
            with pytest.raises(grpc.RpcError) as refused:
                next(iter(watch))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "no credentials" in str(refused.value.details())
        yield Secured(svc, ca.ca_file, str(token_file))
    finally:
        svc.terminate()


def _env(**extra: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TIDE_")}
    return {**clean, **extra}


async def _tide(*args: str, env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tide.services.cli", *args,
        cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def _run(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    proc = await _tide(*args, env=env)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.parametrize(
    ("job", "creds", "env"),
    [
        ("ml/flag", ("--token", TOKEN), {}),
        ("ml/env", (), {"TIDE_TOKEN_FILE": "<file>"}),
        ("ml/file-flag", ("--token-file", "<file>"), {}),
    ],
    ids=["--token", "TIDE_TOKEN_FILE", "--token-file"],
)
async def test_scale_wait_follows_with_the_same_token(
    secured: Secured, job: str, creds: tuple[str, ...], env: dict[str, str]
) -> None:
    args = tuple(secured.token_file if a == "<file>" else a for a in creds)
    env = {k: secured.token_file if v == "<file>" else v for k, v in env.items()}
    code, out, err = await _run(
        "scale", job, "--replicas", "3", "--reason", "watched", "--wait", "--wait-timeout", "30s",
        *secured.args(), *args, env=_env(**env),
    )  # fmt: skip
    assert "no credentials" not in err, err
    assert code == 0, err
    assert "COMPLETED" in out and f"{job} runs 3" in out, out
    assert ": COMPLETED: " in err, err  # the followed events, one line each


async def _line_with(stream: asyncio.StreamReader, *words: str) -> str:
    while True:
        line = (await asyncio.wait_for(stream.readline(), 60)).decode()
        assert line, f"the watch ended before a line with {words}"
        if all(w in line for w in words):
            return line


@pytest.mark.parametrize("how", ["TIDE_TOKEN_FILE", "--token-file"])
async def test_history_watch_follows_with_the_token_until_stopped(
    secured: Secured, how: str
) -> None:
    job = "ml/watched-env" if how == "TIDE_TOKEN_FILE" else "ml/watched-file-flag"
    env = {"TIDE_TOKEN_FILE": secured.token_file} if how == "TIDE_TOKEN_FILE" else {}
    flag = ("--token-file", secured.token_file) if how == "--token-file" else ()
    watch = await _tide("history", job, "-w", "-o", "json", *secured.args(), *flag, env=_env(**env))
    assert watch.stdout is not None and watch.stderr is not None
    try:
        # The history (a document, then the events as JSON lines) comes once the
        # stream has started: subscribed first, listed second.
        await _line_with(watch.stdout, '"decisions"')
        code, out, err = await _run(
            "scale", job, "--replicas", "3", "--reason", "seen by the watch",
            *secured.args(), "--token", TOKEN, env=_env(),
        )  # fmt: skip
        assert code == 0, err
        did = out.split()[1].rstrip(":")
        await _line_with(watch.stdout, f'"decision_id": {did},', "COMPLETED")
        assert watch.returncode is None
    finally:
        if watch.returncode is None:
            watch.send_signal(signal.SIGINT)  # Ctrl-C: the watch's way to end
        err_bytes = await asyncio.wait_for(watch.stderr.read(), 30)
        code = await asyncio.wait_for(watch.wait(), 30)
    assert "no credentials" not in err_bytes.decode(), err_bytes
    assert code == 0, err_bytes
