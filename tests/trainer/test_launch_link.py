"""The launcher's link to the coordinator: it finds a restarted or silent coordinator
again as the same member, registers again when it is unknown, and treats refused
heartbeats as the protocol says (tide/trainer/launcher/link.py). Against the fake coordinator
over a real socket, with a Paddle-free worker."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from tests.support.poll import eventually
from tests.trainer.fake_coordinator import FakeCoordinator, start_fake
from tests.trainer.launch_rig import make_launcher
from tide.trainer.launch import Launcher, State
from tide.v1 import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.component


async def test_reconnects_and_reregisters_with_the_same_launcher_id(tmp_path: Path) -> None:
    coord = FakeCoordinator()
    server, port = await start_fake(coord)
    launcher = make_launcher(port, tmp_path)
    run = asyncio.create_task(launcher.run())
    await eventually(lambda: coord.members, 10, what="registration")
    (mid,) = coord.members
    # Its directive stream open first: the fake answers Register before the launcher opens
    # it, and a stream first opened on the restarted fake (which still knows the member)
    # needs no re-registration.
    await eventually(lambda: coord.members[mid].streams, 10, what="the directive stream")
    await server.stop(None)
    # A restarted coordinator on the same port: the launcher finds it again by itself.
    server2 = await _serve_on(coord, port)
    await eventually(lambda: coord.members[mid].registrations >= 2, 30, what="re-registration")
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
    launcher = make_launcher(port, tmp_path, backoff_max_s=0.3)
    run = asyncio.create_task(launcher.run())
    await eventually(lambda: coord.members, 10, what="registration")
    (mid,) = coord.members
    first = launcher.link.channel
    await server.stop(None)
    # The outage itself (not a condition to poll): long enough that gRPC's own reconnect
    # backoff (1 s, x1.6 each failure) has grown past the launcher's 0.3 s cap.
    await asyncio.sleep(6.5)
    server2 = await _serve_on(coord, port)
    back = time.monotonic()
    await eventually(lambda: coord.members[mid].registrations >= 2, 10, what="re-registration")
    took = time.monotonic() - back
    assert took < 1.5, f"re-registered {took:.2f}s after the coordinator was back"
    assert launcher.link.channel is not first  # a fresh channel, without gRPC's backoff
    launcher.stop()
    assert await asyncio.wait_for(run, 10) == 0
    await server2.stop(None)


async def test_a_coordinator_that_stops_answering_is_dialled_afresh_as_the_same_member(
    fake: tuple[FakeCoordinator, int], tmp_path: Path
) -> None:
    coord, port = fake
    launcher = make_launcher(port, tmp_path, rpc_timeout_s=0.5)
    run = asyncio.create_task(launcher.run())
    await eventually(lambda: any(m.streams for m in coord.members.values()), 10, what="a stream")
    (mid,) = coord.members
    first = launcher.link.channel
    coord.answering.clear()
    await eventually(lambda: launcher.link.channel is not first, 10, what="a fresh channel")
    coord.answering.set()
    # The directive stream follows onto the fresh channel, as the same member.
    await eventually(lambda: coord.members[mid].streams >= 2, 10, what="the stream reopened")
    assert list(coord.members) == [mid]
    (rdv,) = coord.rendezvous([mid])
    await eventually(lambda: coord.ack_of(rdv), 10, what="rendezvous ack on the new stream")
    launcher.stop()
    assert await asyncio.wait_for(run, 10) == 0


async def test_unknown_member_registers_again_and_reopens_its_stream(
    fake: tuple[FakeCoordinator, int], tmp_path: Path
) -> None:
    coord, port = fake
    launcher = make_launcher(port, tmp_path)
    run = asyncio.create_task(launcher.run())
    await eventually(lambda: any(m.streams for m in coord.members.values()), 10, what="a stream")
    (mid,) = coord.members
    member = coord.members[mid]
    coord.forgotten.add(mid)
    await eventually(
        lambda: member.registrations >= 2 and member.streams >= 2, 10, what="re-registration"
    )
    # The reopened stream works: a directive on it is handled.
    (rdv,) = coord.rendezvous([mid])
    await eventually(lambda: coord.ack_of(rdv), 10, what="rendezvous ack on the new stream")
    launcher.stop()
    assert await asyncio.wait_for(run, 10) == 0


async def _running_in_generation_1(
    coord: FakeCoordinator, port: int, tmp_path: Path
) -> tuple[Launcher, asyncio.Task[int], str]:
    launcher = make_launcher(port, tmp_path)
    run = asyncio.create_task(launcher.run())
    await eventually(lambda: coord.members, 10, what="registration")
    (mid,) = coord.members
    (rdv,) = coord.rendezvous([mid])
    await eventually(lambda: coord.ack_of(rdv), 10, what="rendezvous ack")
    await eventually(lambda: launcher.state is State.RUNNING, 10, what="running")
    return launcher, run, mid


async def test_a_heartbeat_refused_as_stale_waits_for_the_streams_rendezvous(
    fake: tuple[FakeCoordinator, int], tmp_path: Path
) -> None:
    coord, port = fake
    coord.reject_stale = True
    launcher, run, mid = await _running_in_generation_1(coord, port, tmp_path)
    member = coord.members[mid]
    # The job moved on (a peer was lost) and this member's RENDEZVOUS is not sent yet: its
    # heartbeats of generation 1 are fenced off with FAILED_PRECONDITION.
    coord.generation += 1
    await eventually(lambda: len(coord.refused) >= 5, 10, what="refused heartbeats")
    # Not fatal, and no re-registration storm: the worker trains on, same member, same stream.
    assert not run.done() and launcher.state is State.RUNNING
    assert (member.registrations, member.streams) == (1, 1)
    (rdv,) = coord.rendezvous([mid], new_generation=False)
    await eventually(lambda: coord.ack_of(rdv), 10, what="rendezvous ack on the same stream")
    await eventually(
        lambda: member.last is not None and member.last.generation == 2,
        5,
        what="a heartbeat of generation 2 accepted",
    )
    assert (member.registrations, member.streams) == (1, 1)
    launcher.stop()
    assert await asyncio.wait_for(run, 10) == 0


async def test_refusals_that_last_a_heartbeat_timeout_register_again_once_per_timeout(
    fake: tuple[FakeCoordinator, int], tmp_path: Path
) -> None:
    coord, port = fake
    coord.reject_stale = True
    coord.heartbeat_interval_s, coord.heartbeat_timeout_s = 0.1, 1.0
    launcher, run, mid = await _running_in_generation_1(coord, port, tmp_path)
    member = coord.members[mid]
    coord.generation += 1  # and no RENDEZVOUS ever comes
    await eventually(lambda: member.registrations >= 2, 10, what="a safety-net registration")
    refused_then = len(coord.refused)
    await eventually(lambda: len(coord.refused) >= refused_then + 10, 10, what="more refusals")
    # About one registration per second of refusals, not one per refused beat.
    assert member.registrations <= 1 + len(coord.refused) // 5
    assert not run.done()
    launcher.stop()
    assert await asyncio.wait_for(run, 10) == 0
