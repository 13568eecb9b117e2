"""Scaler replicas over real sockets: a follower answers the read API from the store,
ingests telemetry into warm windows without deciding, and once it leads decides
within one evaluation, not one sustain window later (docs/reliability.md, Leader
election: every replica ingests, only the leader decides)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.scaler.support import report
from tests.support.poll import eventually_rpc
from tests.support.procs import ServiceProcess, start_service
from tide.base.grpc_options import client_options
from tide.services.testing.replicas import replica_args
from tide.v1 import scaler_pb2, scaler_pb2_grpc, telemetry_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.slow]

JOB = "ns/warm"
#: A cold window needs this long of samples before a scale-up; a warm one has them.
SUSTAIN_S = 6.0
EVALUATE_S = 0.5
T = 5.0


def replica(tmp: Path, owner: str) -> ServiceProcess:
    return start_service(
        replica_args(
            tmp,
            owner,
            f"sqlite:///{tmp / 'scaler.db'}",
            "--leader-election",
            "sql",
            "--lease-duration-s",
            "2",
            "--lease-renew-s",
            "0.5",
            "--evaluate-interval-s",
            str(EVALUATE_S),
            "--sustain-s",
            str(SUSTAIN_S),
            "--bucket-s",
            "1",
            "--cooldown-s",
            "0",
            "--min-replicas",
            "1",
            "--max-replicas",
            "4",
            "--min-scale-up-efficiency",
            "0",
        )
    )


async def feed(target: str, stop: asyncio.Event) -> None:
    """One agent's node, both GPUs of the job's two trainers busy, reporting 4 times a second."""
    pods = ["warm-trainer-0", "warm-trainer-1"]
    async with grpc.aio.insecure_channel(target, options=client_options()) as ch:
        call = telemetry_pb2_grpc.TelemetryStub(ch).Stream()
        seq = 0
        while not stop.is_set():
            seq += 1
            await call.write(report("node-a", seq, utils=[97.0, 97.0], capacity=2, pods=pods))
            await asyncio.sleep(0.25)
        call.cancel()


async def test_a_follower_reads_ingests_and_decides_at_once_when_it_leads(tmp_path: Path) -> None:
    leader = replica(tmp_path, "replica-a")
    follower: ServiceProcess | None = None
    stop = asyncio.Event()
    try:
        async with grpc.aio.insecure_channel(leader.target) as ch:
            stub: Any = scaler_pb2_grpc.ScalerStub(ch)

            async def upserted() -> bool:
                try:
                    await stub.UpsertJob(
                        scaler_pb2.UpsertJobRequest(job_id=JOB, initial_replicas=2), timeout=T
                    )
                except grpc.aio.AioRpcError:
                    return False  # not elected yet
                return True

            await eventually_rpc(upserted, 20, what="the leader to take the job")
            first = await stub.ListDecisions(scaler_pb2.ListDecisionsRequest(job_id=JOB), timeout=T)
            (start,) = first.decisions
            await eventually_rpc(
                lambda: job_idle(stub), 20, what="the job's first resize (0 -> 2) to end"
            )
        # Started after the job's first resize, so its in-memory coordinator knows the
        # two trainers (from the shared state file) whose GPUs the reports name.
        follower = replica(tmp_path, "replica-b")
        async with grpc.aio.insecure_channel(follower.target) as ch:
            stub = scaler_pb2_grpc.ScalerStub(ch)
            health: Any = health_pb2_grpc.HealthStub(ch)  # grpcio-health ships no stub types
            assert not await leads(health)
            # The read API, from the store: jobs, history, explain.
            job = await eventually_rpc(
                lambda: get_job(stub), 10, what="the follower to know the job from the store"
            )
            assert job.current_replicas == 2
            listed = await stub.ListJobs(scaler_pb2.ListJobsRequest(), timeout=T)
            assert [j.job_id for j in listed.jobs] == [JOB]
            history = await stub.ListDecisions(
                scaler_pb2.ListDecisionsRequest(job_id=JOB), timeout=T
            )
            assert [d.id for d in history.decisions] == [start.id]
            explained = await stub.GetDecision(
                scaler_pb2.GetDecisionRequest(id=start.id), timeout=T
            )
            assert explained.decision.to_replicas == 2
            # Writes and watches are the leader's: refused, naming it.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.RequestResize(
                    scaler_pb2.RequestResizeRequest(job_id=JOB, replicas=3, requested_by="t"),
                    timeout=T,
                )
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "following replica-a" in (err.value.details() or "")

            # Telemetry to the follower alone: it ingests, the leader sees none.
            feeder = asyncio.create_task(feed(follower.target, stop))
            fed_at = time.monotonic()
            await eventually_rpc(
                lambda: window_full(stub), 4 * SUSTAIN_S, what="the follower's window to fill"
            )
            assert time.monotonic() - fed_at >= SUSTAIN_S - 1.5
            # A full, hot window for a sustain and more: the follower decided nothing.
            again = await stub.ListDecisions(scaler_pb2.ListDecisionsRequest(job_id=JOB), timeout=T)
            assert [d.id for d in again.decisions] == [start.id]

            leader.kill()  # no release: the follower waits out the 2 s lease
            killed = time.monotonic()
            await eventually_rpc(lambda: leads(health), 10, what="the follower to lead")
            led_s = time.monotonic() - killed
            decided = await eventually_rpc(
                lambda: scale_up(stub, start.id), 10, what="a scale-up by the new leader"
            )
            decided_s = time.monotonic() - killed - led_s
            # Within one evaluation (and a scheduling margin) of leading: the window was
            # warm. A cold one would have waited SUSTAIN_S of new samples.
            assert decided_s < EVALUATE_S + 1.5 < SUSTAIN_S, (led_s, decided_s)
            assert decided.to_replicas > 2
            stop.set()
            await feeder
    finally:
        stop.set()
        for p in (leader, follower):
            if p is not None:
                p.kill()


async def get_job(stub: Any) -> Any:
    try:
        return await stub.GetJob(scaler_pb2.GetJobRequest(job_id=JOB), timeout=T)
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.NOT_FOUND
        return None


async def job_idle(stub: Any) -> bool:
    job = await get_job(stub)
    return job is not None and job.active_decision_id == 0 and job.current_replicas == 2


async def window_full(stub: Any) -> bool:
    """Every bucket of the sustain window hot, and every GPU of the job reporting."""
    job = await get_job(stub)
    if job is None or job.window.coverage < 0.99 or not job.window.buckets:
        return False
    return all(not b.empty and b.mean_pct > 90 for b in job.window.buckets)


async def leads(health: Any) -> bool:
    """Health SERVING: a follower is not ready, the leader is."""
    resp = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=T)
    return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


async def scale_up(stub: Any, after: int) -> scaler_pb2.Decision | None:
    page = await stub.ListDecisions(scaler_pb2.ListDecisionsRequest(job_id=JOB), timeout=T)
    return next((d for d in page.decisions if d.id > after), None)
