"""The durable checkpoint's lag on its way from the worker to the coordinator (issue 25,
item 4): rank 0's CheckpointWritten carries the seconds from the snapshot to the commit,
the launcher keeps the newest one with the time it heard of it, and its heartbeats carry
both (tide/trainer/launcher/core.py, link.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.trainer.launch_rig import make_launcher
from tide.trainer.launcher.link import CoordinatorLink
from tide.trainer.launcher.model import Beat, DurableCheckpoint, State, WorkerProgress
from tide.trainer.messages import CheckpointWritten, decode_to_launcher, encode

pytestmark = pytest.mark.unit


def test_checkpoint_written_carries_its_lag() -> None:
    msg = CheckpointWritten(step=50, digest="cd", write_s=0.01, periodic=True, lag_s=3.25)
    assert decode_to_launcher(encode(msg)) == msg


async def test_the_launcher_keeps_the_newest_durable_checkpoint_with_its_lag(
    tmp_path: Path,
) -> None:
    launcher = make_launcher(1, tmp_path)  # never started: no worker, no coordinator
    assert launcher._beat().checkpoint == DurableCheckpoint()
    before = time.time()
    await launcher._on_worker_message(CheckpointWritten(step=10, digest="ab", lag_s=2.5))
    got = launcher._beat().checkpoint
    assert (got.step, got.digest, got.lag_s) == (10, "ab", 2.5)
    assert before <= got.at <= time.time()
    # An older one (a late report) or one without a digest changes nothing.
    await launcher._on_worker_message(CheckpointWritten(step=5, digest="cd", lag_s=9.0))
    await launcher._on_worker_message(CheckpointWritten(step=20, digest="", lag_s=9.0))
    assert launcher._beat().checkpoint == got


def test_heartbeats_carry_the_durable_checkpoint_and_its_lag(tmp_path: Path) -> None:
    link = CoordinatorLink(make_launcher(1, tmp_path).s, lambda: beat)
    ckpt = DurableCheckpoint(step=30, digest="ef", lag_s=4.5, at=1_700_000_123.5)
    beat = Beat(
        generation=2, state=State.RUNNING, progress=WorkerProgress(step=33), checkpoint=ckpt
    )
    req = link._heartbeat_request(beat)
    assert (req.last_checkpoint_step, req.last_checkpoint_digest) == (30, "ef")
    assert req.last_checkpoint_lag_s == 4.5
    assert req.last_checkpoint_at.seconds == 1_700_000_123
    none = link._heartbeat_request(
        Beat(generation=2, state=State.RUNNING, progress=WorkerProgress())
    )
    assert none.last_checkpoint_lag_s == 0.0 and not none.HasField("last_checkpoint_at")
