"""Every Tide service on the common runtime, as a real process: it starts,
answers the gRPC health check, lists its services through reflection, serves
/metrics, and exits 0 within its grace period on SIGTERM while a stream is open."""

from __future__ import annotations

import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.support.procs import ServiceProcess, memory_scaler_args, start_service
from tide.services.testing.ports import free_port
from tide.v1 import coordinator_pb2, coordinator_pb2_grpc, telemetry_pb2, telemetry_pb2_grpc

pytestmark = pytest.mark.integration

GRACE_S = 2.0


def _telemetry_stream(ch: grpc.Channel) -> Any:
    def reports() -> Iterator[telemetry_pb2.NodeReport]:
        seq = 0
        while True:
            seq += 1
            yield telemetry_pb2.NodeReport(node_name="n1", boot_id="boot", seq=seq, gpu_capacity=1)
            time.sleep(0.05)

    stream = telemetry_pb2_grpc.TelemetryStub(ch).Stream(reports())
    return stream


def _watch_job_stream(ch: grpc.Channel) -> Any:
    stub = coordinator_pb2_grpc.CoordinatorStub(ch)
    stub.Register(
        coordinator_pb2.RegisterRequest(
            job_id="ns/job",
            pod_name="job-trainer-0",
            host="127.0.0.1",
            launcher_id="l-0",
            free_port=free_port(),
        ),
        timeout=10,
    )
    # WatchJob answers at once with the job's status, then holds the stream open.
    return stub.WatchJob(coordinator_pb2.GetJobStatusRequest(job_id="ns/job"))


def _health_watch(ch: grpc.Channel) -> Any:
    return health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))


SERVICES: dict[str, tuple[Callable[[Path], list[str]], set[str], Callable[[grpc.Channel], Any]]] = {
    "scaler": (
        # The production scaler's code with the in-memory coordinator and actuator:
        # this test is about the runtime every service shares, not about resizing.
        lambda tmp: memory_scaler_args(f"sqlite:///{tmp}/s.db"),
        {"tide.v1.Scaler", "tide.v1.Telemetry"},
        _telemetry_stream,
    ),
    "coordinator": (
        lambda tmp: ["-m", "tide.services.coordinator", "--db", f"sqlite:///{tmp}/c.db"],
        {"tide.v1.Coordinator"},
        _watch_job_stream,
    ),
    "agent": (
        lambda tmp: [
            "-m",
            "tide.services.agent",
            "--source",
            "synthetic",
            "--no-watch-node",
            "--scaler",
            f"127.0.0.1:{free_port()}",
            "--node-name",
            "n1",
            # Nothing listens at --scaler: do not wait for the final report's ack.
            "--shutdown-flush-s",
            "0",
        ],
        set(),
        _health_watch,
    ),
}


@pytest.fixture(params=sorted(SERVICES))
def service(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, ServiceProcess]]:
    name = request.param
    args = SERVICES[name][0](tmp_path)
    svc = start_service(
        [
            *args,
            *("--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"),
            *("--grace-period-s", str(GRACE_S)),
        ],
        timeout_s=60,
    )
    yield name, svc
    svc.kill()


@pytest.mark.slow
def test_service_runtime(service: tuple[str, ServiceProcess]) -> None:
    name, svc = service
    _, expected, open_stream = SERVICES[name]
    with grpc.insecure_channel(svc.target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        for svc_name in expected:
            resp = health.Check(health_pb2.HealthCheckRequest(service=svc_name), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        replies = list(
            refl.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
        )
        listed = {s.name for s in replies[0].list_services_response.service}
        assert expected | {"grpc.health.v1.Health"} <= listed

        assert svc.metrics_port
        body = urllib.request.urlopen(
            f"http://127.0.0.1:{svc.metrics_port}/metrics", timeout=10
        ).read()
        assert b"# TYPE" in body

        stream = open_stream(ch)
        next(stream)  # the stream is established and has answered once
        t0 = time.monotonic()
        svc.proc.send_signal(signal.SIGTERM)
        rc = svc.proc.wait(timeout=30)
        elapsed = time.monotonic() - t0
        stream.cancel()
    assert rc == 0, svc.proc.stderr.read() if svc.proc.stderr else ""
    # the grace period, plus interpreter teardown on a loaded 2-core machine
    assert elapsed < GRACE_S + 5.0, elapsed
