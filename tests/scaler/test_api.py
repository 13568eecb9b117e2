"""The Scaler API and the Telemetry stream of one scaler, over real sockets."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format

from tests.support.poll import eventually
from tests.support.procs import ROOT
from tide.base.grpc_options import client_options
from tide.base.timeconv import datetime_of, ts_from_datetime
from tide.services.common.clock import SystemClock
from tide.services.common.config import CommonSettings
from tide.services.common.server import RunningServer, ServiceSpec, start_server
from tide.services.scaler.engine.core import ScalerCore
from tide.services.scaler.ingest import IngestSettings
from tide.services.scaler.policy import PolicySettings, Reason
from tide.services.scaler.servicer import RULES, ScalerServicer, TelemetryServicer
from tide.services.scaler.store import DecisionStore
from tide.services.store import db
from tide.services.testing.actuators import InMemoryActuator
from tide.services.testing.coordinator import InMemoryCoordinator, follow_actuator
from tide.v1 import common_pb2, scaler_pb2, scaler_pb2_grpc, telemetry_pb2_grpc

pytestmark = pytest.mark.integration

T = 10.0  # deadline of every call in these tests
S = common_pb2


@dataclass
class Live:
    core: ScalerCore
    server: RunningServer
    stub: scaler_pb2_grpc.ScalerStub
    actuator: InMemoryActuator

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"


@pytest.fixture
async def live(tmp_path: Path) -> AsyncIterator[Live]:
    url = f"sqlite:///{tmp_path / 's.db'}"
    db.upgrade(url)
    clock = SystemClock()
    actuator = InMemoryActuator()
    coordinator = InMemoryCoordinator(step_s=0.02)
    follow_actuator(coordinator, actuator)
    store = DecisionStore(db.make_engine(url), "api-test", clock)
    core = ScalerCore(
        store=store,
        actuator=actuator,
        coordinator=coordinator,
        clock=clock,
        defaults=PolicySettings(
            bucket_s=1.0,
            sustain_s=3.0,
            cooldown_s=0.0,
            scale_down_stabilization_s=0.0,
            min_coverage=0.5,
        ),
        ingest=IngestSettings(stale_after_s=1.5),
        evaluate_interval_s=0.2,
    )
    await core.start()
    loop_task = asyncio.create_task(core.run())
    server = await start_server(
        CommonSettings(listen="127.0.0.1:0"),
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
    )
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=client_options())
    try:
        yield Live(core, server, scaler_pb2_grpc.ScalerStub(channel), actuator)
    finally:
        await channel.close()
        await server.stop(0)
        loop_task.cancel()
        await asyncio.gather(loop_task, return_exceptions=True)
        await core.close()
        store.engine.dispose()


async def test_jobs_decisions_history_and_watch(live: Live) -> None:
    stub = live.stub
    job = await stub.UpsertJob(
        scaler_pb2.UpsertJobRequest(
            job_id="ns/a",
            gpus_per_replica=2,
            policy=scaler_pb2.Policy(max_replicas=6, cooldown_s=5.0),
        ),
        timeout=T,
    )
    assert (job.current_replicas, job.policy.max_replicas, job.policy.cooldown_s) == (2, 6, 5.0)
    assert job.policy.scale_up_utilization_pct == 80.0
    watch = stub.WatchDecisions(scaler_pb2.WatchDecisionsRequest(job_id="ns/a"), timeout=T)
    await watch.initial_metadata()
    d = await stub.RequestResize(
        scaler_pb2.RequestResizeRequest(
            job_id="ns/a", replicas=4, reason="test", requested_by="me"
        ),
        timeout=T,
    )
    assert (d.from_replicas, d.to_replicas, d.reason) == (2, 4, S.DECISION_REASON_MANUAL)
    states = []
    async for ev in watch:
        states.append(ev.state)
        if ev.state == S.DECISION_STATE_COMPLETED:
            assert ev.decision.generation == 2
            break
    watch.cancel()
    assert states == [
        S.DECISION_STATE_PENDING,
        S.DECISION_STATE_PREPARING,
        S.DECISION_STATE_ACTUATING,
        S.DECISION_STATE_COMPLETED,
    ]
    detail = await stub.GetDecision(scaler_pb2.GetDecisionRequest(id=d.id), timeout=T)
    assert [e.state for e in detail.events] == states
    assert detail.inputs.current_replicas == 2
    assert detail.inputs.policy.max_replicas == 6
    page = await stub.ListDecisions(scaler_pb2.ListDecisionsRequest(job_id="ns/a"), timeout=T)
    assert [x.id for x in page.decisions] == [d.id]
    got = await stub.GetJob(scaler_pb2.GetJobRequest(job_id="ns/a"), timeout=T)
    assert got.current_replicas == 4
    assert got.HasField("last_resize_at")
    # No telemetry: every bucket is marked empty and the window has no mean; the JSON a
    # grpcurl user sees says so, with no NaN in it.
    assert len(got.window.buckets) == 3
    assert all(b.empty and not b.HasField("mean_pct") for b in got.window.buckets)
    assert not got.window.HasField("mean_pct")
    text = json_format.MessageToJson(got)
    assert "NaN" not in text and '"empty": true' in text
    jobs = await stub.ListJobs(scaler_pb2.ListJobsRequest(), timeout=T)
    assert [j.job_id for j in jobs.jobs] == ["ns/a"]
    paused = await stub.SetAutoscaling(
        scaler_pb2.SetAutoscalingRequest(job_id="ns/a", paused=True, reason="x"), timeout=T
    )
    assert paused.autoscaling_paused


@pytest.mark.parametrize(
    ("call", "code"),
    [
        (lambda s: s.GetJob(scaler_pb2.GetJobRequest(job_id="ns/none"), timeout=T), "NOT_FOUND"),
        (lambda s: s.GetDecision(scaler_pb2.GetDecisionRequest(id=99), timeout=T), "NOT_FOUND"),
        (
            lambda s: s.UpsertJob(
                scaler_pb2.UpsertJobRequest(
                    job_id="ns/b", policy=scaler_pb2.Policy(scale_up_utilization_pct=150)
                ),
                timeout=T,
            ),
            "INVALID_ARGUMENT",
        ),
        (
            lambda s: s.UpsertJob(scaler_pb2.UpsertJobRequest(job_id="no-namespace"), timeout=T),
            "INVALID_ARGUMENT",
        ),
        (
            lambda s: s.ListDecisions(scaler_pb2.ListDecisionsRequest(page_token="zz"), timeout=T),
            "INVALID_ARGUMENT",
        ),
    ],
)
async def test_errors_map_to_status_codes(live: Live, call: object, code: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(live.stub)  # type: ignore[operator]
    assert err.value.code().name == code
    assert err.value.details()


def agent(live: Live, node: str, util: float, pods: list[str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.scaler.agent_proc",
            live.target,
            node,
            str(util),
            "0.1",
            *pods,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "STREAMING"
    return proc


@pytest.mark.slow
async def test_killed_agent_goes_stale_and_blocks_scale_down(live: Live) -> None:
    stub = live.stub
    # Recorded as running at 2 (no initial_replicas: nothing to start), then allowed down to 1.
    for min_replicas in (2, 1):
        await stub.UpsertJob(
            scaler_pb2.UpsertJobRequest(
                job_id="ns/a",
                gpus_per_replica=4,
                policy=scaler_pb2.Policy(min_replicas=min_replicas, sustain_s=4.0),
            ),
            timeout=T,
        )
    a_pods = ["uid-a-0"] * 4
    b_pods = ["uid-a-1"] * 4
    agent_a = agent(live, "node-a", 10.0, a_pods)
    agent_b = agent(live, "node-b", 10.0, b_pods)
    try:
        core = live.core

        def fresh(n: int) -> bool:
            # What GetJob's window reports, read in-process.
            return core.pipeline.window_of("ns/a", core.clock.now()).gpus_fresh == n

        await eventually(lambda: fresh(8), timeout_s=15)
        agent_b.kill()
        agent_b.wait(timeout=10)
        # Stale within the limit (1.5 s) plus one evaluation interval.
        loop = asyncio.get_running_loop()
        t_kill = loop.time()
        await eventually(lambda: fresh(4), timeout_s=5)
        assert loop.time() - t_kill < 1.5 + 1.0

        def blocked() -> bool:
            ev = core.evaluations.get("ns/a")
            return (
                ev is not None
                and ev.decision.reason is Reason.INSUFFICIENT_COVERAGE
                and "partial data never scales down" in ev.decision.message
            )

        # Every bucket is low, yet with half the GPUs silent nothing shrinks.
        await eventually(blocked, timeout_s=10)
        page = await stub.ListDecisions(scaler_pb2.ListDecisionsRequest(), timeout=T)
        assert list(page.decisions) == []
        # The control: with the node back, the same load does scale down.
        decisions = core.feed.subscribe("ns/a")
        agent_b = agent(live, "node-b", 10.0, b_pods)
        reasons: list[str] = []

        def shrunk() -> bool:
            while not decisions.empty():
                w = decisions.get_nowait()
                if w is not None:
                    reasons.append(w.decision.reason)
            return Reason.SUSTAINED_LOW_UTILIZATION.name in reasons

        await eventually(shrunk, timeout_s=15)
        page = await stub.ListDecisions(scaler_pb2.ListDecisionsRequest(), timeout=T)
        assert any(d.reason == S.DECISION_REASON_SUSTAINED_LOW_UTILIZATION for d in page.decisions)
    finally:
        for p in (agent_a, agent_b):
            p.kill()
            p.wait(timeout=10)


async def test_list_utilization_over_a_range(live: Live) -> None:
    from datetime import UTC, datetime, timedelta

    from google.protobuf.timestamp_pb2 import Timestamp

    from tide.services.scaler.store import RollupRecord

    stub = live.stub
    await stub.UpsertJob(scaler_pb2.UpsertJobRequest(job_id="ns/a"), timeout=T)
    now = datetime.now(tz=UTC).replace(second=0, microsecond=0)
    ages_h = (30.0, 2.0, 1.0, 1 / 60)
    await live.core.store.write_rollups(
        [
            RollupRecord("ns/a", now - timedelta(hours=h), 50.0 + i, 40.0, 60.0 + i, 10 + i, 2)
            for i, h in enumerate(ages_h)
        ]
    )

    def ts(dt: datetime) -> Timestamp:
        t = ts_from_datetime(dt)
        assert t is not None
        return t

    async def means(**kw: Timestamp) -> list[float]:
        req = scaler_pb2.ListUtilizationRequest(job_id="ns/a", **kw)
        resp = await stub.ListUtilization(req, timeout=T)
        return [p.mean_pct for p in resp.points]

    # Unset range: the last 24 hours, oldest first, every field carried.
    assert await means() == [51.0, 52.0, 53.0]
    resp = await stub.ListUtilization(
        scaler_pb2.ListUtilizationRequest(job_id="ns/a", since=ts(now - timedelta(hours=2))),
        timeout=T,
    )
    first = resp.points[0]
    assert datetime_of(first.minute) == now - timedelta(hours=2)
    assert (first.min_pct, first.max_pct, first.samples, first.replicas) == (40.0, 61.0, 11, 2)
    # Any range, far from decisions too; since inclusive, until exclusive.
    assert await means(since=ts(now - timedelta(hours=31))) == [50.0, 51.0, 52.0, 53.0]
    assert await means(since=ts(now - timedelta(hours=2)), until=ts(now - timedelta(hours=1))) == [
        51.0
    ]
    assert await means(until=ts(now - timedelta(hours=29))) == [50.0]

    async def code(req: scaler_pb2.ListUtilizationRequest) -> grpc.StatusCode:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListUtilization(req, timeout=T)
        return err.value.code()

    assert await code(scaler_pb2.ListUtilizationRequest(job_id="ns/none")) == (
        grpc.StatusCode.NOT_FOUND
    )
    backwards = scaler_pb2.ListUtilizationRequest(job_id="ns/a", since=ts(now), until=ts(now))
    assert await code(backwards) == grpc.StatusCode.INVALID_ARGUMENT
    too_long = scaler_pb2.ListUtilizationRequest(
        job_id="ns/a", since=ts(now - timedelta(days=8)), until=ts(now)
    )
    assert await code(too_long) == grpc.StatusCode.INVALID_ARGUMENT
    # With seconds: a day per call, and each minute's detail where it is stored.
    too_long.since.CopyFrom(ts(now - timedelta(days=2)))
    too_long.seconds = True
    assert await code(too_long) == grpc.StatusCode.INVALID_ARGUMENT
    counts = [0] * 60
    counts[7] = 3
    sums = [0.0] * 60
    sums[7] = 270.0
    minute = now - timedelta(minutes=5)
    await live.core.store.write_rollups(
        [RollupRecord("ns/a", minute, 90.0, 90.0, 90.0, 3, 2, tuple(sums), tuple(counts))]
    )
    resp = await stub.ListUtilization(
        scaler_pb2.ListUtilizationRequest(
            job_id="ns/a", since=ts(minute - timedelta(hours=2)), seconds=True
        ),
        timeout=T,
    )
    detail = {datetime_of(p.minute): p for p in resp.points if p.second_samples}
    assert list(detail) == [minute]
    assert detail[minute].second_mean_pct[7] == 90.0
    assert list(detail[minute].second_samples) == counts
    assert all(not p.second_mean_pct for p in resp.points if datetime_of(p.minute) != minute)
