"""The real `python -m tide.services.coordinator` on SQLite, SIGKILLed mid-resize and
restarted: fake launchers reconnect and the job ends in one generation."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from tests.coordinator.fakes import TIMEOUT_S, FakeLauncher, ResizeWatch
from tests.support.poll import eventually
from tests.support.procs import ROOT, ServiceProcess, start_service
from tide.services.common.clock import SystemClock
from tide.v1 import coordinator_pb2 as pb
from tide.v1 import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

JOB = "ns/proc"
K = pb.Directive.Kind
P = pb.ResizePhase
HEARTBEAT_S = 0.3


class LiveLauncher:
    """A FakeLauncher with a heartbeat loop that re-registers after the coordinator
    comes back, as the real launcher does."""

    def __init__(self, target: str, index: int) -> None:
        self.fl = FakeLauncher(target, SystemClock(), JOB, index)
        self.task: asyncio.Task[None] | None = None
        self.reconnects = 0

    async def start(self) -> None:
        await self.fl.join()
        self.task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                if self.fl.stream_ended():
                    # The stream broke (coordinator gone): re-register, same launcher_id.
                    await self.fl.register()
                    await self.fl.connect()
                    self.reconnects += 1
                await self.fl.heartbeat()
            except grpc.aio.AioRpcError:
                await self.fl.disconnect()

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self.fl.close()


def _start(db: Path, port: int = 0) -> ServiceProcess:
    return start_service(
        [
            "-m",
            "tide.services.coordinator",
            "--listen",
            f"127.0.0.1:{port}",
            "--db",
            f"sqlite:///{db}",
            "--heartbeat-timeout-s",
            "10",
            "--heartbeat-interval-s",
            "1",
            "--tick-interval-s",
            "0.2",
            "--log-level",
            "WARNING",
        ]
    )


async def _status(stub: pb_grpc.CoordinatorStub) -> pb.JobStatus | None:
    try:
        st: pb.JobStatus = await stub.GetJobStatus(
            pb.GetJobStatusRequest(job_id=JOB), timeout=TIMEOUT_S
        )
        return st
    except grpc.aio.AioRpcError:
        return None


async def _wait_status(
    stub: pb_grpc.CoordinatorStub, pred: object, timeout_s: float = 20.0
) -> pb.JobStatus:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = await _status(stub)
        if st is not None and pred(st):  # type: ignore[operator]
            return st
        await asyncio.sleep(0.05)
    raise AssertionError(f"job status never matched; last: {await _status(stub)}")


@pytest.mark.slow
@pytest.mark.parametrize("kill_in", ["barrier", "rendezvous"])
async def test_sigkill_mid_resize_ends_in_one_generation(tmp_path: Path, kill_in: str) -> None:
    db = tmp_path / "coord.db"
    svc = _start(db)
    port = svc.port
    launchers: list[LiveLauncher] = []
    channel = grpc.aio.insecure_channel(svc.target)
    stub = pb_grpc.CoordinatorStub(channel)
    try:
        launchers = [LiveLauncher(svc.target, i) for i in range(3)]
        for ll in launchers:
            await ll.start()
        first = ResizeWatch(stub, JOB, 1, 2)
        assert (await first.final(20.0)).phase == P.RESIZE_PHASE_COMPLETED
        old, newcomer = launchers[:2], launchers[2]

        if kill_in == "barrier":
            old[1].fl.answer_checkpoint = False
        else:
            for ll in launchers:
                ll.fl.answer_rendezvous = False
        ResizeWatch(stub, JOB, 2, 3, deadline_s=60.0)
        if kill_in == "barrier":
            await eventually(lambda: K.KIND_CHECKPOINT in old[1].fl.kinds(), 20.0, what="barrier")
        else:
            await eventually(
                lambda: (
                    all(K.KIND_RENDEZVOUS in ll.fl.kinds()[-1:] for ll in launchers)
                    and newcomer.fl.kinds() == [K.KIND_RENDEZVOUS]
                ),
                20.0,
                what="rendezvous sent",
            )

        svc.proc.send_signal(signal.SIGKILL)
        svc.proc.wait(timeout=10)
        for ll in launchers:
            ll.fl.answer_checkpoint = True
            ll.fl.answer_rendezvous = True
        svc = _start(db, port)  # same port: launchers reconnect to the address they know

        final = await ResizeWatch(stub, JOB, 2, 3).final(30.0)
        want_gen, want_world = (1, 2) if kill_in == "barrier" else (2, 3)
        assert final.phase == (
            P.RESIZE_PHASE_ABORTED if kill_in == "barrier" else P.RESIZE_PHASE_COMPLETED
        ), final
        st = await _wait_status(
            stub,
            lambda s: (
                s.generation == want_gen
                and s.world_size == want_world
                and not s.HasField("active_resize")
            ),
        )
        # One generation: every active member and its launcher agree on it.
        active = [m for m in st.members if m.state == pb.MEMBER_STATE_ACTIVE]
        assert sorted(m.rank for m in active) == list(range(want_world))
        in_job = [ll for ll in launchers if ll.fl.rank is not None]
        await eventually(
            lambda: {ll.fl.generation for ll in in_job} == {want_gen}, 10.0, what="launchers agree"
        )
        await eventually(
            lambda: all(ll.reconnects >= 1 for ll in launchers), 10.0, what="reconnects"
        )
        if kill_in == "barrier":
            await eventually(
                lambda: all(K.KIND_RESUME in ll.fl.kinds() for ll in old), 10.0, what="RESUME"
            )
            assert [ll.fl.worker_starts for ll in old] == [1, 1]
            assert newcomer.fl.generation == 0
    finally:
        for ll in launchers:
            await ll.stop()
        await channel.close()
        svc.kill()


def test_a_second_coordinator_on_a_busy_port_stops_before_touching_the_store(
    tmp_path: Path,
) -> None:
    # Issue 30: it used to migrate the schema and load every job, then die with a traceback.
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    db_file = tmp_path / "never.db"
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "tide.services.coordinator",
                "--listen",
                f"127.0.0.1:{port}",
                "--db",
                f"sqlite:///{db_file}",
                "--insecure",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
    finally:
        busy.close()
    assert out.returncode == 1, out.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "Traceback" not in out.stderr
    assert not db_file.exists()  # nothing migrated
