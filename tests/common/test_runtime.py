"""The common service runtime, over real sockets and real processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.support.procs import ROOT, ServiceProcess, start_service
from tide.v1 import scaler_pb2, scaler_pb2_grpc, telemetry_pb2, telemetry_pb2_grpc

pytestmark = pytest.mark.integration

SAMPLE = ["tests/common/sample_service.py"]


@pytest.fixture
def service() -> Iterator[ServiceProcess]:
    svc = start_service(
        [
            *SAMPLE,
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--grace-period-s",
            "2",
        ]
    )
    yield svc
    svc.kill()


def test_health_reflection_and_metrics(service: ServiceProcess) -> None:
    with grpc.insecure_channel(service.target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "tide.v1.Telemetry", "tide.v1.Scaler"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        replies = list(
            refl.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
        )
        names = {s.name for s in replies[0].list_services_response.service}
        assert {"tide.v1.Telemetry", "tide.v1.Scaler", "grpc.health.v1.Health"} <= names
    assert service.metrics_port
    body = urllib.request.urlopen(
        f"http://127.0.0.1:{service.metrics_port}/metrics", timeout=5
    ).read()
    assert b"process_cpu_seconds_total" in body or b"python_info" in body


def test_sigterm_exits_zero_within_grace_while_a_stream_is_open(service: ServiceProcess) -> None:
    with grpc.insecure_channel(service.target) as ch:
        stub = telemetry_pb2_grpc.TelemetryStub(ch)
        sent: list[telemetry_pb2.NodeReport] = []

        def reports() -> Iterator[telemetry_pb2.NodeReport]:
            seq = 0
            while True:
                seq += 1
                report = telemetry_pb2.NodeReport(node_name="n1", boot_id="b", seq=seq)
                sent.append(report)
                yield report
                time.sleep(0.05)

        stream = stub.Stream(reports())
        first = next(stream)
        assert first.acked_seq == 1
        t0 = time.monotonic()
        service.proc.send_signal(signal.SIGTERM)
        rc = service.proc.wait(timeout=15)
        elapsed = time.monotonic() - t0
        stream.cancel()
    assert rc == 0
    # grace 2 s, plus interpreter exit
    assert elapsed < 2.0 + 3.0, elapsed


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--grace-period-s", "soon"], {}, "grace_period_s (from --grace-period-s)"),
        (["--listen", "nowhere"], {}, "listen: expected HOST:PORT, got 'nowhere'"),
        (
            [],
            {"TIDE_LOG_LEVEL": "LOUD"},
            "log_level: expected DEBUG, INFO, WARNING or ERROR, got 'LOUD'",
        ),
        (["--tls-cert-file", "/nonexistent.pem", "--tls-key-file", "/k"], {}, "no such file"),
    ],
    ids=["bad-float-flag", "bad-listen", "bad-env", "missing-cert"],
)
def test_bad_configuration_stops_at_start_with_one_line(
    args: list[str], env: dict[str, str], needle: str
) -> None:
    proc = subprocess.run(
        [sys.executable, *SAMPLE, *args],
        cwd=ROOT,
        env={**__import__("os").environ, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0]


def test_bad_value_in_config_file_is_named(tmp_path: Path) -> None:
    cfg = tmp_path / "tide.yaml"
    cfg.write_text("grace_period_s: -1\n")
    proc = subprocess.run(
        [sys.executable, *SAMPLE, "--config", str(cfg)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "grace_period_s: must be >= 0, got -1.0" in proc.stderr


def test_admin_rpc_needs_the_bearer_token() -> None:
    svc = start_service([*SAMPLE, "--listen", "127.0.0.1:0", "--admin-token", "s3cret"])
    try:
        with grpc.insecure_channel(svc.target) as ch:
            stub = scaler_pb2_grpc.ScalerStub(ch)
            req = scaler_pb2.SetAutoscalingRequest(job_id="ns/a", paused=True, reason="incident")
            with pytest.raises(grpc.RpcError) as err:
                stub.SetAutoscaling(req, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                stub.SetAutoscaling(req, timeout=5, metadata=(("authorization", "Bearer wrong"),))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ok = stub.SetAutoscaling(req, timeout=5, metadata=(("authorization", "Bearer s3cret"),))
            assert ok.autoscaling_paused
            # Read-only calls need no token.
            stub.ListJobs(scaler_pb2.ListJobsRequest(), timeout=5)
    finally:
        svc.kill()


def test_mtls_refuses_a_client_without_a_certificate(tmp_path: Path) -> None:
    ca = trustme.CA()
    server_cert = ca.issue_cert("localhost", "127.0.0.1")
    client_cert = ca.issue_cert("tide-cli")
    ca_pem = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_pem))
    cert = tmp_path / "server.pem"
    key = tmp_path / "server.key"
    server_cert.cert_chain_pems[0].write_to_path(str(cert))
    server_cert.private_key_pem.write_to_path(str(key))
    svc = start_service(
        [
            *SAMPLE,
            "--listen",
            "127.0.0.1:0",
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--tls-client-ca-file",
            str(ca_pem),
        ]
    )
    try:
        opts = (("grpc.ssl_target_name_override", "localhost"),)
        anonymous = grpc.ssl_channel_credentials(root_certificates=ca_pem.read_bytes())
        with grpc.secure_channel(svc.target, anonymous, options=opts) as ch:
            with pytest.raises(grpc.RpcError) as err:
                scaler_pb2_grpc.ScalerStub(ch).ListJobs(scaler_pb2.ListJobsRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with_cert = grpc.ssl_channel_credentials(
            root_certificates=ca_pem.read_bytes(),
            private_key=client_cert.private_key_pem.bytes(),
            certificate_chain=client_cert.cert_chain_pems[0].bytes(),
        )
        with grpc.secure_channel(svc.target, with_cert, options=opts) as ch:
            scaler_pb2_grpc.ScalerStub(ch).ListJobs(scaler_pb2.ListJobsRequest(), timeout=5)
        # A plaintext client cannot talk to it at all.
        with grpc.insecure_channel(svc.target) as ch, pytest.raises(grpc.RpcError):
            scaler_pb2_grpc.ScalerStub(ch).ListJobs(scaler_pb2.ListJobsRequest(), timeout=5)
    finally:
        svc.kill()
