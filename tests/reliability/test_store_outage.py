"""Reliability catalog T03/T04: PostgreSQL stopped hard under the services, then
restarted (docs/reliability.md).

Each test runs its own PostgreSQL (tests/support/pgserver.py) so that stopping
it touches nothing else. What must hold:
- health (readiness) turns NOT_SERVING within 2 s, liveness stays SERVING;
- write RPCs answer UNAVAILABLE, not a traceback or "bad usage";
- nothing is decided while the store is down, and the scaler decides again by
  itself, no restart, within 5 s of the store's return: the evaluation loop lives;
- decisions acknowledged before the outage are all there after it;
- the coordinator keeps its members: their calls get UNAVAILABLE, not NOT_FOUND,
  so no launcher registers again as a new member.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.coordinator.fakes import FakeLauncher
from tests.support.pgserver import PrivatePostgres, private_postgres
from tests.support.poll import eventually, wait_for
from tests.support.procs import ROOT, ServiceProcess, start_service
from tide.services.common.clock import SystemClock
from tide.services.common.readiness import LIVENESS
from tide.v1 import common_pb2, scaler_pb2, scaler_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.postgres, pytest.mark.slow]

JOB = "ns/out"
T = 10.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def pg() -> Iterator[PrivatePostgres]:
    with private_postgres() as server:
        yield server


def health(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(  # type: ignore[attr-defined]
                health_pb2.HealthCheckRequest(service=service), timeout=2.0
            )
        except grpc.RpcError:
            return -1
        return int(resp.status)


def metric(proc: ServiceProcess, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def hot_agent(target: str, pods: list[str]) -> subprocess.Popen[str]:
    """A node whose GPUs (the job's pods) report 95 %: the policy wants a grow."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.scaler.agent_proc", target, "node-a", "95", "0.1", *pods],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "STREAMING"
    return proc


def test_scaler_rides_out_a_postgres_outage(pg: PrivatePostgres) -> None:
    scaler = start_service(
        [
            "-m",
            "tide.services.testing.scaler",
            "--coordinator",
            "memory",
            "--actuator",
            "memory",
            "--db",
            pg.url,
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--log-level",
            "WARNING",
        ]
    )
    ch = grpc.insecure_channel(scaler.target)
    stub = scaler_pb2_grpc.ScalerStub(ch)
    agent: subprocess.Popen[str] | None = None
    try:
        stub.UpsertJob(
            scaler_pb2.UpsertJobRequest(
                job_id=JOB,
                initial_replicas=2,
                policy=scaler_pb2.Policy(
                    min_replicas=1, max_replicas=4, bucket_s=1.0, sustain_s=2.0, cooldown_s=0.0
                ),
            ),
            timeout=T,
        )

        def settled() -> scaler_pb2.Job | None:
            job = stub.GetJob(scaler_pb2.GetJobRequest(job_id=JOB), timeout=T)
            return job if job.active_decision_id == 0 and job.current_replicas > 0 else None

        wait_for(settled, timeout_s=30, what="the job's start")
        acked = [d.id for d in stub.ListDecisions(scaler_pb2.ListDecisionsRequest()).decisions]
        assert acked

        t_stop = time.monotonic()
        pg.stop_hard()
        wait_for(lambda: health(scaler.target) == NOT_SERVING, timeout_s=5, what="NOT_SERVING")
        detected_s = time.monotonic() - t_stop
        assert detected_s < 2.0
        assert health(scaler.target, LIVENESS) == SERVING

        with pytest.raises(grpc.RpcError) as err:
            stub.RequestResize(
                scaler_pb2.RequestResizeRequest(
                    job_id=JOB, replicas=3, reason="during the outage", requested_by="t"
                ),
                timeout=T,
            )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value

        # Load that tips the window while nothing can be recorded: the loop skips
        # its passes (counted) and decides nothing.
        agent = hot_agent(scaler.target, ["uid-out-0", "uid-out-1"])
        lost = "tide_scaler_evaluation_passes_lost_total"
        wait_for(lambda: metric(scaler, lost) >= 5, timeout_s=15, what="skipped passes")
        assert health(scaler.target, LIVENESS) == SERVING, "the evaluation loop died"

        t_start = time.monotonic()
        pg.start()
        wait_for(lambda: health(scaler.target) == SERVING, timeout_s=10, what="SERVING again")
        recovered_s = time.monotonic() - t_start
        assert recovered_s < 5.0
        # The figures docs/reliability.md quotes (pytest -s shows them).
        print(f"T03 not_serving_after_s={detected_s:.2f} serving_after_restart_s={recovered_s:.2f}")

        def grown() -> scaler_pb2.Decision | None:
            page = stub.ListDecisions(scaler_pb2.ListDecisionsRequest(job_id=JOB), timeout=T)
            return next(
                (
                    d
                    for d in page.decisions
                    if d.trigger == common_pb2.DECISION_TRIGGER_POLICY
                    and d.state == common_pb2.DECISION_STATE_COMPLETED
                ),
                None,
            )

        # The same loop decides on its own after the outage: a grow from telemetry.
        d = wait_for(grown, timeout_s=20, what="a decision from telemetry after the outage")
        assert d.to_replicas > d.from_replicas
        after = {x.id for x in stub.ListDecisions(scaler_pb2.ListDecisionsRequest()).decisions}
        assert set(acked) <= after
        assert health(scaler.target, LIVENESS) == SERVING
    finally:
        if agent is not None:
            agent.kill()
            agent.wait(timeout=10)
        ch.close()
        scaler.kill()


async def test_coordinator_keeps_its_members_through_a_postgres_outage(
    pg: PrivatePostgres,
) -> None:
    coord = start_service(
        [
            "-m",
            "tide.services.coordinator",
            "--listen",
            "127.0.0.1:0",
            "--db",
            pg.url,
            "--heartbeat-timeout-s",
            "30",
            "--tick-interval-s",
            "0.2",
            "--log-level",
            "WARNING",
        ]
    )
    first = FakeLauncher(coord.target, SystemClock(), JOB, 0)
    second = FakeLauncher(coord.target, SystemClock(), JOB, 1)
    try:
        await first.join()
        member = first.member_id
        await first.heartbeat()

        pg.stop_hard()
        await eventually(lambda: health(coord.target) == NOT_SERVING, timeout_s=5)
        # A change that must be written fails, and leaves the job to be reloaded...
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await second.register()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        # ...which cannot happen while the store is down: the member's calls are
        # UNAVAILABLE (retry), never NOT_FOUND (register again as someone new).
        for _ in range(3):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await first.heartbeat()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value

        pg.start()
        await eventually(lambda: health(coord.target) == SERVING, timeout_s=10)

        async def beats() -> bool:
            try:
                await first.heartbeat()
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                return False
            return True

        deadline = time.monotonic() + 10
        while not await beats():
            assert time.monotonic() < deadline, "heartbeats did not come back"
            await asyncio.sleep(0.1)
        assert first.member_id == member
    finally:
        await first.close()
        await second.close()
        coord.kill()
