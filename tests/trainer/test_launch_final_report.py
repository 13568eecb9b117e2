"""The launcher's report that its workers finished is kept until the coordinator has
recorded it (tide/trainer/launcher/link.py, ``final_heartbeat``): through a store outage that
outlasts the heartbeat timeout it is retried, and a launcher that gives up after
``final_report_timeout_s`` says so in one line. Against the fake coordinator over a real
socket, with a Paddle-free worker."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.support.poll import eventually
from tests.trainer.fake_coordinator import FakeCoordinator, start_fake
from tests.trainer.launch_rig import make_launcher
from tide.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.component


class StoreDownOnTheEnd(FakeCoordinator):
    """Refuses the report of a finished worker (phase IDLE in the job's generation) with
    UNAVAILABLE for ``outage_s`` from the first one, as a coordinator whose store fails the
    commit of that report does."""

    def __init__(self, outage_s: float) -> None:
        super().__init__()
        self.outage_s = outage_s
        self.down_since: float | None = None
        self.refused_ends = 0

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> pb.HeartbeatResponse:
        if request.phase == pb.WORKER_PHASE_IDLE and request.generation == self.generation > 0:
            now = time.monotonic()
            self.down_since = self.down_since or now
            if now - self.down_since < self.outage_s:
                self.refused_ends += 1
                await context.abort(grpc.StatusCode.UNAVAILABLE, "store down (injected)")
        return await super().Heartbeat(request, context)


async def _finish(coord: StoreDownOnTheEnd, tmp_path: Path, **overrides: Any) -> tuple[int, str]:
    server, port = await start_fake(coord)
    try:
        launcher = make_launcher(port, tmp_path, **overrides)
        run = asyncio.create_task(launcher.run())
        await eventually(lambda: coord.members, 10, what="registration")
        (mid,) = coord.members
        coord.rendezvous([mid])
        return await asyncio.wait_for(run, 30), mid
    finally:
        await server.stop(None)


async def test_the_end_is_reported_until_recorded_through_an_outage_past_the_heartbeat_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MAX_STEPS", "12")
    # Past the fake's heartbeat timeout (3 s): the old launcher gave up after it.
    coord = StoreDownOnTheEnd(outage_s=4.5)
    code, mid = await _finish(coord, tmp_path)
    assert code == 0
    assert coord.refused_ends >= 2
    assert mid in coord.finished, "the launcher exited before its end was recorded"
    last = coord.members[mid].heartbeats[-1]
    assert (last.phase, last.generation, last.step) == (pb.WORKER_PHASE_IDLE, 1, 12)


async def test_a_launcher_that_gives_up_says_so_once_naming_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("FAKE_MAX_STEPS", "12")
    coord = StoreDownOnTheEnd(outage_s=3600.0)
    caplog.set_level(logging.INFO, logger="tide.trainer.launcher.link")
    started = time.monotonic()
    code, mid = await _finish(coord, tmp_path, final_report_timeout_s=1.0)
    assert code == 0 and mid not in coord.finished
    assert time.monotonic() - started < 20
    gave_up = [r for r in caplog.records if "exits without the coordinator" in r.getMessage()]
    assert len(gave_up) == 1 and gave_up[0].levelno == logging.WARNING
    assert "final_report_timeout_s" in gave_up[0].getMessage()


async def test_a_launcher_stopped_while_it_reports_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("FAKE_MAX_STEPS", "12")
    coord = StoreDownOnTheEnd(outage_s=3600.0)
    caplog.set_level(logging.INFO, logger="tide.trainer.launcher.link")
    server, port = await start_fake(coord)
    try:
        launcher = make_launcher(port, tmp_path)
        run = asyncio.create_task(launcher.run())
        await eventually(lambda: coord.members, 10, what="registration")
        coord.rendezvous(list(coord.members))
        await eventually(lambda: coord.refused_ends >= 1, 20, what="the end refused")
        launcher.stop()  # as on SIGTERM once finished
        assert await asyncio.wait_for(run, 15) == 0
    finally:
        await server.stop(None)
    stopped = [r for r in caplog.records if "stopped before the coordinator" in r.getMessage()]
    assert len(stopped) == 1 and stopped[0].levelno == logging.WARNING
