"""A WorkerSupervisor over a spawner whose workers exit when the test says (no process):
the order of a worker's exit against its lines and the next generation's start, which real
processes leave to chance (tests/trainer/test_supervisor_*.py)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path

from tide.trainer.launcher.settings import LauncherSettings
from tide.trainer.launcher.supervisor import WorkerSupervisor
from tide.trainer.messages import ToLauncher
from tide.trainer.spawner import WorkerHandle


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


async def started(
    tmp_path: Path, heard: list[object], handling_s: float = 0.0
) -> tuple[WorkerSupervisor, Spawner]:
    """A supervisor (no standby) whose generation 1 worker runs; ``heard`` gets the exits
    it reports (their codes) and the messages it passes on, in order, each message once its
    handling (``handling_s`` of waiting: a launcher's own awaits on a busy node) is done."""

    async def on_exit(worker: WorkerHandle, code: int, expected: bool) -> None:
        heard.append(code)

    async def on_message(msg: ToLauncher) -> None:
        if handling_s:
            await asyncio.sleep(handling_s)
        heard.append(msg)

    settings = LauncherSettings(
        coordinator="127.0.0.1:1", job_id="ns/j", command=("true",), prewarm=False
    )
    spawner = Spawner()
    workers = WorkerSupervisor(settings, spawner, tmp_path, lambda: False, on_exit, on_message)
    await workers.start()
    await workers.start_generation({}, generation=1, rank=0)
    return workers, spawner
