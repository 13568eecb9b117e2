"""One trace per decision, exported over OTLP to an in-process collector: from the tipping
sample through the decision's states and the coordinator's resize phases to the
directives it sent, across the real gRPC hop between the scaler and the coordinator."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from tests.coordinator.support import JOB, close_env, make_env
from tests.scaler.support import report
from tests.scaler.test_coordinator_contract import RealWorld
from tests.support.poll import eventually
from tide.base.client import open_channel
from tide.services.common import tracing
from tide.services.coordinator.store import MemoryStore
from tide.services.scaler.coordination import GrpcCoordinatorClient
from tide.services.scaler.engine.core import ScalerCore
from tide.services.scaler.ingest import IngestSettings
from tide.services.scaler.policy import PolicySettings
from tide.services.scaler.store import DecisionState, DecisionStore
from tide.services.store import db
from tide.services.testing.actuators import InMemoryActuator
from tide.services.testing.clock import FakeClock
from tide.services.testing.coordinator import InMemoryCoordinator, follow_actuator

pytestmark = pytest.mark.component


@dataclass
class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that keeps what it is sent."""

    spans: list[trace_pb2.Span] = field(default_factory=list)

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                self.spans.extend(ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def named(self, name: str) -> list[trace_pb2.Span]:
        return [s for s in self.spans if s.name == name]


def attrs(span: trace_pb2.Span) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = getattr(v, v.WhichOneof("value"))
    return out


@pytest.fixture
async def collector() -> AsyncIterator[Collector]:
    c = Collector()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(c, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    tracing.configure("test", f"127.0.0.1:{port}")
    try:
        yield c
    finally:
        tracing.shutdown()
        await server.stop(0)


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    u = f"sqlite:///{tmp_path / 's.db'}"
    db.upgrade(u)
    yield u


async def test_a_manual_decision_is_one_trace_across_the_coordinator(
    collector: Collector, url: str
) -> None:
    env = await make_env(MemoryStore())
    async with open_channel(env.target) as channel:
        world = RealWorld(env, GrpcCoordinatorClient(channel))
        clock = FakeClock()
        store = DecisionStore(db.make_engine(url), "trace", clock)
        core = ScalerCore(
            store=store,
            actuator=InMemoryActuator(total_gpus=64),
            coordinator=world.client,
            clock=clock,
        )
        try:
            # The first generation's decision id is the coordinator's own, far from ours.
            await world.running(2, decision_id=1000)
            await core.start()
            await core.upsert_job(JOB, {"min_replicas": 2, "max_replicas": 4})
            d = await core.request_resize(JOB, 3, "trace me", "alice")
            await world.add_pods(2, 1)  # the newcomer the actuator asked for
            final = await core.controller.tasks[d.id]
            assert final is not None and final.state is DecisionState.COMPLETED
        finally:
            await core.close()
            await world.close()
            await close_env(env)
            store.engine.dispose()
    # In a thread: the exporter calls the collector served by this event loop.
    assert await asyncio.to_thread(tracing.force_flush)

    (root,) = [s for s in collector.named("tide.decision") if attrs(s)["tide.decision_id"] == d.id]
    assert attrs(root)["tide.state"] == "COMPLETED" and attrs(root)["tide.reason"] == "MANUAL"
    assert [e.name for e in root.events] == ["PREPARING", "ACTUATING", "COMPLETED"]
    trace = [s for s in collector.spans if s.trace_id == root.trace_id]
    by_name = {s.name: s for s in trace}
    # The scaler's side, children of the decision.
    assert by_name["tide.actuator.set_replicas"].parent_span_id == root.span_id
    call = by_name["tide.coordinator.Resize"]
    assert call.parent_span_id == root.span_id
    # The coordinator's side, continued from the Resize call's traceparent.
    resize = by_name["tide.coordinator.resize"]
    assert resize.parent_span_id == call.span_id
    assert attrs(resize)["tide.decision_id"] == d.id
    phases = [s.name for s in sorted(trace, key=lambda s: s.start_time_unix_nano)]
    want = ["waiting_for_members", "checkpointing", "rendezvous"]
    assert [p.removeprefix("tide.coordinator.") for p in phases if p.endswith(tuple(want))] == want
    for name in want:
        assert by_name[f"tide.coordinator.{name}"].parent_span_id == resize.span_id
    directives = [e.name for s in trace for e in s.events if e.name.startswith("directive")]
    assert "directive CHECKPOINT" in directives and "directive RENDEZVOUS" in directives
    # Nothing of this decision landed in another trace.
    others = [
        s for s in collector.spans if s.trace_id != root.trace_id and "tide.decision_id" in attrs(s)
    ]
    assert [
        attrs(s)["tide.decision_id"] for s in others if attrs(s)["tide.decision_id"] == d.id
    ] == []


async def test_a_policy_decision_starts_at_its_tipping_sample(
    collector: Collector, url: str
) -> None:
    clock = FakeClock(1_800_000_000.0)
    actuator = InMemoryActuator(total_gpus=64)
    coordinator = InMemoryCoordinator()
    follow_actuator(coordinator, actuator)
    store = DecisionStore(db.make_engine(url), "trace", clock)
    core = ScalerCore(
        store=store,
        actuator=actuator,
        coordinator=coordinator,
        clock=clock,
        defaults=PolicySettings(bucket_s=10.0, sustain_s=30.0, cooldown_s=60.0),
        ingest=IngestSettings(stagger_slots=False),
    )
    await core.start()
    try:
        await core.upsert_job("ns/a", {}, gpus_per_replica=4)
        await eventually(lambda: "uid-a-1" in core.registry.by_uid)
        st = core.ingest.open_stream()
        pods = ["uid-a-0"] * 4 + ["uid-a-1"] * 4
        for seq in range(1, 36):
            clock.advance(1.0)
            core.ingest.process(st, report("n1", seq, t=clock.now(), utils=[95.0] * 8, pods=pods))
        tipping = clock.now() - 2.0  # the sample that tipped the window, a moment ago
        await core.evaluate("ns/a", tipping_s=tipping)
        for task in list(core.controller.tasks.values()):
            await task
    finally:
        await core.close()
        store.engine.dispose()
    # In a thread: the exporter calls the collector served by this event loop.
    assert await asyncio.to_thread(tracing.force_flush)
    (root,) = collector.named("tide.decision")
    assert root.start_time_unix_nano == int(tipping * 1e9)
    assert attrs(root)["tide.reason"] == "SUSTAINED_HIGH_UTILIZATION"
    stages = {s.name: s for s in collector.spans if s.parent_span_id == root.span_id}
    assert {"tide.transport", "tide.queue", "tide.evaluate"} <= set(stages)
    assert stages["tide.transport"].start_time_unix_nano == root.start_time_unix_nano


def test_without_an_endpoint_nothing_is_recorded() -> None:
    tracing.configure("test", "")
    span = tracing.start_span("tide.decision", new_trace=True)
    assert not span.is_recording()
    span.end()
    assert tracing.inject() == []
