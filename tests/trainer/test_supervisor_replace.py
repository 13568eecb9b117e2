"""A worker is replaced when the next generation's start is asked for, not a loop turn
later: an old worker that crashes as the RENDEZVOUS comes must not fail its successor's
start (tide/trainer/launcher/supervisor.py ``start_generation``, ``_watch``)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from tests.support.poll import eventually
from tests.trainer.supervisor_rig import started

pytestmark = pytest.mark.component


async def test_an_old_worker_dying_as_the_next_generation_starts_is_no_ones_news(
    tmp_path: Path,
) -> None:
    heard: list[object] = []
    workers, spawner = await started(tmp_path, heard)
    (old,) = spawner.spawned
    # Its exit is handled in the next loop turn; the next generation's start is asked for in
    # this one and runs as a task, as WorkerGroup runs each local worker's.
    old.exit(-signal.SIGSEGV)
    await asyncio.gather(workers.start_generation({}, generation=2, rank=0))
    assert len(spawner.spawned) == 2
    # A turn of the loop for any report still to come.
    await asyncio.sleep(0)
    assert heard == []
    new = spawner.spawned[1]
    new.exit(-signal.SIGSEGV)
    await eventually(lambda: heard, 10, what="the new worker's exit")
    assert heard == [-signal.SIGSEGV]
    await workers.close()
