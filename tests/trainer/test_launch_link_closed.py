"""A call whose channel the launcher closes under it (tide/trainer/launcher/link.py ``_rpc``).

The heartbeat renews the channel when the coordinator stops answering (a store outage holds
every call) and closes the old one after a grace. grpc.aio cancels the calls still waiting
on a closing channel, and the task awaiting one gets a CancelledError nobody sent it: a
Register in flight there ended the directive stream's loop, and the member never registered
or heard a directive again. Against the fake coordinator over a real socket."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.support.poll import eventually
from tests.trainer.fake_coordinator import FakeCoordinator, start_fake
from tests.trainer.launch_rig import make_launcher
from tide.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.component


class _HeldRegister(FakeCoordinator):
    """Register waits while ``holding`` is clear (a coordinator whose store is down)."""

    def __init__(self) -> None:
        super().__init__()
        self.holding = asyncio.Event()
        self.holding.set()
        self.waiting = 0

    async def Register(self, request: pb.RegisterRequest, context: object) -> pb.RegisterResponse:
        self.waiting += 1
        try:
            await self.holding.wait()
        finally:
            self.waiting -= 1
        return await super().Register(request, context)


async def test_a_register_cut_off_by_its_channels_close_is_retried_on_the_new_channel(
    tmp_path: Path,
) -> None:
    coord = _HeldRegister()
    server, port = await start_fake(coord)
    launcher = make_launcher(port, tmp_path)
    run = asyncio.create_task(launcher.run())
    try:
        await eventually(
            lambda: any(m.streams for m in coord.members.values()), 10, what="a stream"
        )
        (mid,) = coord.members
        member = coord.members[mid]
        # The member registers again, and its Register waits unanswered.
        coord.holding.clear()
        coord.forgotten.add(mid)
        await eventually(lambda: coord.waiting, 10, what="a Register in flight")
        # What the heartbeat does when nobody answers: a fresh channel; the old one closes
        # (here at once, where the link gives it a grace as long as the call's deadline).
        old = launcher.link.channel
        assert old is not None
        launcher.link._renew_channel()
        await old.close()
        coord.holding.set()
        await eventually(
            lambda: member.registrations >= 2 and member.streams >= 2, 10, what="re-registration"
        )
        (rdv,) = coord.rendezvous([mid])
        await eventually(lambda: coord.ack_of(rdv), 10, what="rendezvous ack on the new stream")
    finally:
        launcher.stop()
        await asyncio.wait_for(run, 10)
        await server.stop(None)
