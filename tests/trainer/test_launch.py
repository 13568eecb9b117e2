"""The launcher against a fake coordinator over a real socket, with a Paddle-free worker."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from tide.v1 import coordinator_pb2 as pb
from tide.v1 import coordinator_pb2_grpc as pb_grpc

from tests.trainer.fake_coordinator import FakeCoordinator, start_fake, wait_for
from tidebase.errors import ConfigError
from trainer.launch import Launcher, LauncherSettings, State, parse_args
from trainer.spawner import ZygoteSpawner

pytestmark = pytest.mark.component

WORKER = str(Path(__file__).with_name("fake_worker.py"))


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeCoordinator, int]]:
    coord = FakeCoordinator()
    server, port = await start_fake(coord)
    yield coord, port
    await server.stop(None)


def _launcher(port: int, tmp_path: Path, index: int = 0, **overrides: Any) -> Launcher:
    env_path = os.pathsep.join([str(Path(WORKER).parent), os.environ.get("PYTHONPATH", "")])
    os.environ["PYTHONPATH"] = env_path
    return Launcher(
        LauncherSettings(
            coordinator=f"127.0.0.1:{port}",
            job_id="ns/job",
            command=(sys.executable, WORKER),
            pod_name=f"pod-{index}",
            pod_index=index,
            state_dir=str(tmp_path / f"l{index}"),
            zygote_preload="",
            exit_grace_s=0.5,
            **overrides,
        )
    )


async def test_rendezvous_checkpoint_resume_drain(
    fake: tuple[FakeCoordinator, int], tmp_path: Path
) -> None:
    coord, port = fake
    launcher = _launcher(port, tmp_path)
    run = asyncio.create_task(launcher.run())
    await wait_for(lambda: coord.members, 10, "registration")
    (mid,) = coord.members
    member = coord.members[mid]
    assert member.register.free_port > 0 and member.register.job_id == "ns/job"
    await wait_for(lambda: member.heartbeats, 5, "a standby heartbeat")
    assert member.last is not None and member.last.phase == pb.WORKER_PHASE_IDLE

    await wait_for(lambda: launcher._standby is not None, 10, "a prewarmed worker")
    assert launcher._standby is not None
    prewarmed = launcher._standby.pid
    (rdv,) = coord.rendezvous([mid], restore_step=7)
    await wait_for(lambda: coord.ack_of(rdv), 10, "rendezvous ack")
    assert coord.ack_of(rdv).ok  # type: ignore[union-attr]
    # The rendezvous woke the worker forked ahead of time instead of starting one.
    assert launcher._worker is not None and launcher._worker.pid == prewarmed
    await wait_for(
        lambda: (
            member.last and member.last.phase == pb.WORKER_PHASE_RUNNING and member.last.step > 7
        ),
        5,
        "running past the restored step",
    )
    hb = member.last
    assert hb is not None and hb.generation == 1 and hb.first_step_at.seconds > 0
    assert hb.startup.restore_s == pytest.approx(0.02)

    target = hb.step + 5
    ckpt = coord.send(mid, kind=pb.Directive.KIND_CHECKPOINT, checkpoint_step=target)
    await wait_for(lambda: coord.ack_of(ckpt), 5, "checkpoint ack")
    ack = coord.ack_of(ckpt)
    assert ack is not None and ack.ok and ack.checkpoint_step == target
    assert ack.checkpoint_digest == "ab" * 32 and ack.held_at.seconds > 0
    await wait_for(lambda: launcher.state is State.HOLDING, 5, "holding")
    held_step = launcher.progress.step

    # A directive re-sent after a reconnect is acked again, not redone.
    member.queue.put_nowait(ckpt)
    await wait_for(
        lambda: sum(a.directive_id == ckpt.directive_id for a in member.acks) == 2, 5, "re-ack"
    )
    assert launcher.state is State.HOLDING and launcher.progress.step == held_step

    resume = coord.send(mid, kind=pb.Directive.KIND_RESUME)
    await wait_for(lambda: launcher.progress.step > held_step, 5, "training after RESUME")
    assert coord.ack_of(resume) is not None

    drain = coord.send(mid, kind=pb.Directive.KIND_DRAIN)
    assert await asyncio.wait_for(run, 10) == 0
    assert coord.ack_of(drain) is not None


async def test_worker_death_is_reported_at_once(
    fake: tuple[FakeCoordinator, int], tmp_path: Path
) -> None:
    coord, port = fake
    coord.heartbeat_interval_s = 30.0  # only an immediate report can pass this test
    launcher = _launcher(port, tmp_path)
    run = asyncio.create_task(launcher.run())
    await wait_for(lambda: coord.members, 10, "registration")
    (mid,) = coord.members
    (rdv,) = coord.rendezvous([mid])
    await wait_for(lambda: coord.ack_of(rdv), 10, "rendezvous ack")
    assert launcher._worker is not None
    os.kill(launcher._worker.pid, signal.SIGKILL)
    member = coord.members[mid]
    await wait_for(
        lambda: member.last and member.last.phase == pb.WORKER_PHASE_FAILED, 2, "FAILED heartbeat"
    )
    # The launcher stays up and rejoins with a new worker.
    (rdv2,) = coord.rendezvous([mid])
    await wait_for(lambda: coord.ack_of(rdv2), 10, "second rendezvous ack")
    assert launcher.state in (State.STARTING, State.RUNNING)
    launcher.stop()
    assert await asyncio.wait_for(run, 10) == 0


async def test_reconnects_and_reregisters_with_the_same_launcher_id(tmp_path: Path) -> None:
    coord = FakeCoordinator()
    server, port = await start_fake(coord)
    launcher = _launcher(port, tmp_path)
    run = asyncio.create_task(launcher.run())
    await wait_for(lambda: coord.members, 10, "registration")
    (mid,) = coord.members
    await server.stop(None)
    # A restarted coordinator on the same port: the launcher finds it again by itself.
    server2 = None
    for _ in range(50):
        import grpc
        from tide.v1 import coordinator_pb2_grpc as pb_grpc

        server2 = grpc.aio.server()
        pb_grpc.add_CoordinatorServicer_to_server(coord, server2)
        try:
            server2.add_insecure_port(f"127.0.0.1:{port}")
            break
        except RuntimeError:
            await asyncio.sleep(0.1)
    assert server2 is not None
    await server2.start()
    await wait_for(lambda: coord.members[mid].registrations >= 2, 15, "re-registration")
    assert list(coord.members) == [mid]
    assert coord.members[mid].register.launcher_id == launcher.s.launcher_id
    launcher.stop()
    await asyncio.wait_for(run, 10)
    await server2.stop(None)


async def _serve_on(coord: FakeCoordinator, port: int) -> grpc.aio.Server:
    """The fake again on ``port`` (as a restarted coordinator), once the old socket is gone."""
    deadline = time.monotonic() + 10
    while True:
        server = grpc.aio.server()
        pb_grpc.add_CoordinatorServicer_to_server(coord, server)
        try:
            server.add_insecure_port(f"127.0.0.1:{port}")
        except RuntimeError:
            assert time.monotonic() < deadline, f"port {port} never became free"
            await asyncio.sleep(0.05)
            continue
        await server.start()
        return server


async def test_a_coordinator_back_after_an_outage_is_reached_on_the_launchers_backoff(
    tmp_path: Path,
) -> None:
    coord = FakeCoordinator()
    server, port = await start_fake(coord)
    launcher = _launcher(port, tmp_path, backoff_max_s=0.3)
    run = asyncio.create_task(launcher.run())
    await wait_for(lambda: coord.members, 10, "registration")
    (mid,) = coord.members
    first = launcher._channel
    await server.stop(None)
    # The outage itself (not a condition to poll): long enough that gRPC's own reconnect
    # backoff (1 s, x1.6 each failure) has grown past the launcher's 0.3 s cap.
    await asyncio.sleep(6.5)
    server2 = await _serve_on(coord, port)
    back = time.monotonic()
    await wait_for(lambda: coord.members[mid].registrations >= 2, 10, "re-registration")
    took = time.monotonic() - back
    assert took < 1.5, f"re-registered {took:.2f}s after the coordinator was back"
    assert launcher._channel is not first  # a fresh channel, without gRPC's backoff
    launcher.stop()
    assert await asyncio.wait_for(run, 10) == 0
    await server2.stop(None)


async def test_unknown_member_registers_again_and_reopens_its_stream(
    fake: tuple[FakeCoordinator, int], tmp_path: Path
) -> None:
    coord, port = fake
    launcher = _launcher(port, tmp_path)
    run = asyncio.create_task(launcher.run())
    await wait_for(lambda: any(m.streams for m in coord.members.values()), 10, "a stream")
    (mid,) = coord.members
    member = coord.members[mid]
    coord.forgotten.add(mid)
    await wait_for(lambda: member.registrations >= 2 and member.streams >= 2, 10, "re-registration")
    # The reopened stream works: a directive on it is handled.
    (rdv,) = coord.rendezvous([mid])
    await wait_for(lambda: coord.ack_of(rdv), 10, "rendezvous ack on the new stream")
    launcher.stop()
    assert await asyncio.wait_for(run, 10) == 0


async def test_heartbeats_report_checkpoints_and_the_finished_budget(
    fake: tuple[FakeCoordinator, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    coord, port = fake
    coord.heartbeat_interval_s = 30.0  # only beats the launcher sends at once show up
    monkeypatch.setenv("FAKE_CKPT_EVERY", "5")
    monkeypatch.setenv("FAKE_MAX_STEPS", "12")
    launcher = _launcher(port, tmp_path)
    run = asyncio.create_task(launcher.run())
    await wait_for(lambda: coord.members, 10, "registration")
    (mid,) = coord.members
    (rdv,) = coord.rendezvous([mid])
    assert await asyncio.wait_for(run, 15) == 0  # the budget is done: the launcher exits 0
    assert coord.ack_of(rdv) is not None and coord.ack_of(rdv).ok  # type: ignore[union-attr]
    beats = coord.members[mid].heartbeats
    reported = [(hb.last_checkpoint_step, hb.last_checkpoint_digest) for hb in beats]
    # Each checkpoint is reported as soon as it is written, with its manifest digest.
    assert (5, f"{5:064x}") in reported and (10, f"{10:064x}") in reported
    assert reported.index((5, f"{5:064x}")) < reported.index((10, f"{10:064x}"))
    last = beats[-1]
    assert (last.phase, last.generation, last.step) == (pb.WORKER_PHASE_IDLE, 1, 12)
    assert last.last_checkpoint_step == 10
    assert not [hb for hb in beats if hb.phase == pb.WORKER_PHASE_FAILED]
    # Its stream ended and a duplicate beat was refused, yet it did not register again.
    assert coord.members[mid].registrations == 1 and list(coord.members) == [mid]


async def test_rendezvous_after_a_loss_reports_where_the_old_worker_stopped(
    fake: tuple[FakeCoordinator, int], tmp_path: Path
) -> None:
    coord, port = fake
    coord.heartbeat_interval_s = 30.0
    launcher = _launcher(port, tmp_path)
    run = asyncio.create_task(launcher.run())
    await wait_for(lambda: coord.members, 10, "registration")
    (mid,) = coord.members
    member = coord.members[mid]
    coord.rendezvous([mid])
    await wait_for(lambda: launcher.progress.step >= 10, 10, "step 10")
    heard = max(hb.step for hb in member.heartbeats)
    await wait_for(lambda: launcher.progress.step > heard, 10, "a step nobody heard of")
    before = len(member.heartbeats)
    # A peer died: the coordinator re-forms while this worker still trains.
    (rdv2,) = coord.rendezvous([mid])
    await wait_for(lambda: coord.ack_of(rdv2), 10, "second rendezvous ack")
    last_words = [hb for hb in member.heartbeats[before:] if hb.generation == 1]
    assert len(last_words) == 1 and last_words[0].step > heard
    launcher.stop()
    assert await asyncio.wait_for(run, 10) == 0


async def test_a_killed_zygote_is_restarted_and_the_next_rendezvous_works(
    fake: tuple[FakeCoordinator, int], tmp_path: Path
) -> None:
    coord, port = fake
    launcher = _launcher(port, tmp_path)
    run = asyncio.create_task(launcher.run())
    await wait_for(lambda: coord.members, 10, "registration")
    (mid,) = coord.members
    await wait_for(
        lambda: launcher._standby is not None and launcher._standby.pid in launcher._conns,
        10,
        "a prewarmed worker",
    )
    spawner = launcher.spawner
    assert isinstance(spawner, ZygoteSpawner) and launcher._standby is not None
    zygote, standby = spawner.pid, launcher._standby.pid
    assert zygote is not None
    os.kill(zygote, signal.SIGKILL)
    # A new zygote and a new prewarmed worker, without any directive asking for them.
    await wait_for(
        lambda: (
            launcher._standby is not None
            and launcher._standby.pid != standby
            and launcher._standby.pid in launcher._conns
        ),
        15,
        "a new prewarmed worker",
    )
    assert spawner.pid not in (None, zygote)
    (rdv,) = coord.rendezvous([mid])
    await wait_for(lambda: coord.ack_of(rdv), 10, "rendezvous ack")
    assert coord.ack_of(rdv).ok  # type: ignore[union-attr]
    launcher.stop()
    assert await asyncio.wait_for(run, 10) == 0


def test_command_line() -> None:
    s = parse_args(
        ["--coordinator", "h:1", "--job", "a/b", "--pod-index", "2", "--", "python", "t.py", "--x"]
    )
    assert s.command == ("python", "t.py", "--x") and s.pod_index == 2 and s.job_id == "a/b"
    with pytest.raises(ConfigError, match="job"):
        parse_args(["--coordinator", "h:1", "--job", "nope", "--", "python", "t.py"])
    with pytest.raises(ConfigError, match="command"):
        parse_args(["--coordinator", "h:1", "--job", "a/b"])
