"""The demo's synthetic node against a Telemetry server on a real socket."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from tests.support.poll import eventually
from tide.base.errors import ConfigError
from tide.services.common.config import CommonSettings
from tide.services.common.server import ServiceSpec, start_server
from tide.services.local.load import LoadSettings, SyntheticNode
from tide.v1 import telemetry_pb2, telemetry_pb2_grpc

pytestmark = pytest.mark.component


class Recorder(telemetry_pb2_grpc.TelemetryServicer):
    """Acks every report; breaks the first stream after ``break_after`` reports."""

    def __init__(self, break_after: int) -> None:
        self.reports: list[telemetry_pb2.NodeReport] = []
        self.streams = 0
        self.break_after = break_after

    async def Stream(
        self, request_iterator: AsyncIterator[telemetry_pb2.NodeReport], context: Any
    ) -> AsyncIterator[telemetry_pb2.TelemetryAck]:
        self.streams += 1
        async for r in request_iterator:
            self.reports.append(r)
            yield telemetry_pb2.TelemetryAck(boot_id=r.boot_id, acked_seq=r.seq)
            if self.streams == 1 and len(self.reports) == self.break_after:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "scaler restarting")


async def test_reports_attribute_gpus_and_survive_a_broken_stream() -> None:
    rec = Recorder(break_after=3)
    running = await start_server(
        CommonSettings(listen="127.0.0.1:0"),
        [ServiceSpec(telemetry_pb2_grpc.add_TelemetryServicer_to_server, rec, "tide.v1.Telemetry")],
    )
    owners = {0: ("ml", "resnet-trainer-0"), 1: ("ml", "resnet-trainer-1")}
    node = SyntheticNode(
        f"127.0.0.1:{running.port}",
        lambda: owners,
        LoadSettings(gpus=4, interval_s=0.02, reconnect_s=0.05),
        rng=random.Random(7),
    )
    node.level_pct = 90.0
    stop = asyncio.Event()
    task = asyncio.create_task(node.run(stop))
    try:
        await eventually(lambda: len(rec.reports) >= 8, what="reports")
        node.level_pct = 15.0
        owners[2] = ("ml", "resnet-trainer-2")
        await eventually(lambda: len(rec.reports) >= 12, what="reports after the break")
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        await running.stop(0)

    assert rec.streams == 2
    seqs = [r.seq for r in rec.reports]
    # Report 4 was in flight when the stream broke: it comes again, with its number.
    assert seqs[:3] == [1, 2, 3] and seqs[3] == 4
    assert sorted(set(seqs)) == list(range(1, max(seqs) + 1))
    assert len(seqs) - len(set(seqs)) <= 1
    assert {r.boot_id for r in rec.reports} == {node.boot_id}
    assert node.acked_seq >= 11
    first, last = rec.reports[0], rec.reports[-1]
    assert first.gpu_capacity == 4 and len(first.gpus) == 4
    assert [(g.pod.namespace, g.pod.name) for g in first.gpus] == [
        ("ml", "resnet-trainer-0"),
        ("ml", "resnet-trainer-1"),
        ("", ""),
        ("", ""),
    ]
    assert all(88.0 <= g.utilization_pct <= 92.0 for g in first.gpus[:2])
    assert all(g.utilization_pct <= 2.0 for g in first.gpus[2:])
    assert all(13.0 <= g.utilization_pct <= 17.0 for g in last.gpus[:3])
    assert last.gpus[2].pod.name == "resnet-trainer-2"
    assert all(g.memory_used_bytes <= g.memory_total_bytes for g in last.gpus)
    stamps = [r.sampled_at.ToNanoseconds() for r in rec.reports]
    assert stamps == sorted(stamps)


def test_settings_validation() -> None:
    with pytest.raises(ConfigError, match="gpus"):
        LoadSettings(gpus=0)
    with pytest.raises(ConfigError, match="interval_s"):
        LoadSettings(interval_s=0)
