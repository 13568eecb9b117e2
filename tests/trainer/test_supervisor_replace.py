"""A worker is replaced when the next generation's start is asked for, not a loop turn
later: an old worker that crashes as the RENDEZVOUS comes must not fail its successor's
start (trainer/launcher/supervisor.py ``start_generation``, ``_watch``)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from tests.support.poll import eventually
from trainer.launcher.settings import LauncherSettings
from trainer.launcher.supervisor import WorkerSupervisor
from trainer.messages import ToLauncher
from trainer.spawner import WorkerHandle

pytestmark = pytest.mark.component


class Worker:
    """A worker that exits when the test says. Its pid is the test's own, so that a socket
    the test connects is, to the kernel, this worker's connection."""

    pid = os.getpid()

    def __init__(self) -> None:
        self._done: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    @property
    def returncode(self) -> int | None:
        return self._done.result() if self._done.done() else None

    def exit(self, code: int) -> None:
        self._done.set_result(code)

    async def wait(self) -> int:
        return await asyncio.shield(self._done)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if not self._done.done():
            self._done.set_result(-sig)


class Spawner:
    def __init__(self) -> None:
        self.spawned: list[Worker] = []

    async def start(self) -> None:
        pass

    async def wait_ready(self) -> float:
        return 0.0

    async def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str, log_path: str
    ) -> WorkerHandle:
        self.spawned.append(Worker())
        return self.spawned[-1]

    async def close(self) -> None:
        pass


async def started(tmp_path: Path, heard: list[object]) -> tuple[WorkerSupervisor, Spawner]:
    """A supervisor (no standby) whose generation 1 worker runs; ``heard`` gets the exits
    it reports (their codes) and the messages it passes on, in order."""

    async def on_exit(worker: WorkerHandle, code: int, expected: bool) -> None:
        heard.append(code)

    async def on_message(msg: ToLauncher) -> None:
        heard.append(msg)

    settings = LauncherSettings(
        coordinator="127.0.0.1:1", job_id="ns/j", command=("true",), prewarm=False
    )
    spawner = Spawner()
    workers = WorkerSupervisor(settings, spawner, tmp_path, lambda: False, on_exit, on_message)
    await workers.start()
    await workers.start_generation({}, generation=1, rank=0)
    return workers, spawner


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
