"""The launcher's part in restarts: it waits out the coordinator's backoff, reports how a
failed worker ended (exit cause, log tail) and what its successor restored, and keeps a
bounded number of worker logs. Against a fake coordinator, with a Paddle-free worker."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from tests.support.poll import eventually
from tests.trainer.fake_coordinator import FakeCoordinator, FakeMember
from tests.trainer.launch_rig import registered
from tide.trainer.launcher.logs import LOG_GLOB
from tide.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.component


async def _start_and_crash(coord: FakeCoordinator, mid: str, member: FakeMember) -> None:
    (rdv,) = coord.rendezvous([mid])
    await eventually(lambda: coord.ack_of(rdv), 10, what="rendezvous ack")
    assert coord.ack_of(rdv).ok  # type: ignore[union-attr]  # it restored, then died
    # This generation's crash: a beat still FAILED from the last one's may land after the
    # RENDEZVOUS, and the next RENDEZVOUS would then race this worker's exit.
    await eventually(
        lambda: any(
            hb.phase == pb.WORKER_PHASE_FAILED and hb.generation == rdv.generation
            for hb in member.heartbeats
        ),
        10,
        what=f"generation {rdv.generation}'s FAILED heartbeat",
    )


async def test_a_worker_dying_at_start_is_reported_with_its_cause_and_log_and_logs_rotate(
    fake: tuple[FakeCoordinator, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_SEGFAULT_AT_FIRST_STEP", "1")
    coord, port = fake
    launcher, run, mid, member = await registered(coord, port, tmp_path, worker_logs_kept=3)
    for _ in range(5):
        await _start_and_crash(coord, mid, member)
    failed = [hb for hb in member.heartbeats if hb.phase == pb.WORKER_PHASE_FAILED]
    ended = failed[-1].worker_exit
    assert (ended.exit_code, ended.cause) == (-11, "was killed by SIGSEGV")
    assert "Fatal Python error: Segmentation fault" in ended.log_tail
    # Five workers (and prewarmed ones) started; three logs are left.
    assert len(list((tmp_path / "l0").glob(LOG_GLOB))) <= 3
    # A heartbeat not in phase FAILED carries no exit.
    assert not any(hb.HasField("worker_exit") for hb in member.heartbeats if hb.phase != 5)
    launcher.stop()
    assert await asyncio.wait_for(run, 10) == 0


async def test_the_restart_backoff_delays_the_start_and_the_ack_says_what_was_restored(
    fake: tuple[FakeCoordinator, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker finds a checkpoint of step 9 on disk, newer than the named 7.
    monkeypatch.setenv("FAKE_RESTORE_AT_LEAST", "9")
    coord, port = fake
    launcher, run, mid, _ = await registered(coord, port, tmp_path)
    sent = time.monotonic()
    (rdv,) = coord.rendezvous([mid], restore_step=7, start_delay_s=0.6)
    await eventually(lambda: coord.ack_of(rdv), 10, what="rendezvous ack")
    assert time.monotonic() - sent >= 0.6
    ack = coord.ack_of(rdv)
    assert ack is not None and ack.ok and ack.HasField("restored_step")
    assert ack.restored_step == 9
    launcher.stop()
    assert await asyncio.wait_for(run, 10) == 0


async def test_the_old_workers_crash_during_the_backoff_is_not_the_new_generations_failure(
    fake: tuple[FakeCoordinator, int], tmp_path: Path
) -> None:
    """The old generation's worker may crash on its own as the backoff stops it (CI at
    675af8f: a crash loop's worker segfaulted 5 ms into the next generation's backoff). That
    is the old generation's end: the new one starts STARTING, not FAILED, and the
    coordinator must not read a loss without a cause in it."""
    coord, port = fake
    launcher, run, mid, member = await registered(coord, port, tmp_path)
    (first,) = coord.rendezvous([mid])
    await eventually(lambda: coord.ack_of(first), 10, what="the first generation's ack")
    old = launcher.workers.worker
    assert old is not None
    stop = launcher.workers.stop

    async def crashing_stop() -> None:
        # The old worker dies by itself just as the backoff stops it.
        old.kill(signal.SIGSEGV)
        await old.wait()
        await eventually(lambda: launcher.worker_exit is not None, 10, what="the crash seen")
        await stop()

    launcher.workers.stop = crashing_stop  # type: ignore[method-assign]
    (second,) = coord.rendezvous([mid], start_delay_s=0.3)
    await eventually(lambda: coord.ack_of(second), 10, what="the second generation's ack")
    launcher.workers.stop = stop  # type: ignore[method-assign]
    ack = coord.ack_of(second)
    assert ack is not None and ack.ok
    # A beat or two more, then none of the new generation's says FAILED.
    seen = len(member.heartbeats)
    await eventually(lambda: len(member.heartbeats) >= seen + 2, 10, what="more heartbeats")
    assert not [
        hb
        for hb in member.heartbeats
        if hb.generation == second.generation and hb.phase == pb.WORKER_PHASE_FAILED
    ]
    launcher.stop()
    assert await asyncio.wait_for(run, 10) == 0
