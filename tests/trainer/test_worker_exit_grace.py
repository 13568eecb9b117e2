"""A worker that does not exit within the grace is SIGKILLed; the line says why: a
worker that got no CPU (lowered to nice 19 on a busy machine) is the machine's state
(INFO), one that ran and ignored its exit is a WARNING (tide/trainer/launcher/supervisor.py)."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tide.trainer.launcher import supervisor as sup
from tide.trainer.launcher.settings import LauncherSettings
from tide.trainer.launcher.supervisor import WorkerSupervisor

pytestmark = pytest.mark.unit

GRACE_S = 0.05


class StuckWorker:
    """Exits only when killed."""

    pid = 999_999_999  # no such process: lower_priority has nothing to renice

    def __init__(self) -> None:
        self.returncode: int | None = None
        self._gone = asyncio.Event()
        self.signals: list[int] = []

    async def wait(self) -> int:
        await self._gone.wait()
        assert self.returncode is not None
        return self.returncode

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.signals.append(sig)
        self.returncode = -sig
        self._gone.set()


async def _nothing(*_: Any) -> None:
    return None


def supervisor(tmp_path: Path) -> WorkerSupervisor:
    settings = LauncherSettings(
        coordinator="127.0.0.1:1", job_id="ns/j", command=("true",), exit_grace_s=GRACE_S
    )
    spawner: Any = object()
    return WorkerSupervisor(settings, spawner, tmp_path, lambda: False, _nothing, _nothing)


@pytest.mark.parametrize(
    ("starved_s", "level"), [(GRACE_S, "INFO"), (0.0, "WARNING")], ids=["starved", "ignored"]
)
async def test_the_sigkill_line_names_the_cause(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    starved_s: float,
    level: str,
) -> None:
    waited = iter([{1: 0.0}])
    monkeypatch.setattr(sup, "process_thread_waits_s", lambda pid: next(waited, {1: starved_s}))
    monkeypatch.setattr(sup, "_running", lambda pid: True)
    caplog.set_level(logging.INFO, logger=sup.__name__)
    worker = StuckWorker()
    await supervisor(tmp_path).stop(worker)
    assert worker.signals == [signal.SIGKILL]
    (line,) = [r for r in caplog.records if "SIGKILL" in r.getMessage()]
    assert line.levelname == level
    assert f"{starved_s:.2f}s of it waiting for a CPU" in line.getMessage()


class LateWorker(StuckWorker):
    """Ended as the grace ran out; its end is read a moment later (the zygote's report)."""

    async def wait(self) -> int:
        await asyncio.sleep(3 * GRACE_S)
        self.returncode = 0
        return 0


async def test_a_worker_that_ended_as_the_grace_ran_out_is_not_killed_nor_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its process is gone when the grace runs out (no such pid): it did not ignore its
    exit, the launcher read its end late (two CI runs logged a WARNING here)."""
    caplog.set_level(logging.INFO, logger=sup.__name__)
    worker = LateWorker()
    await supervisor(tmp_path).stop(worker)
    assert worker.signals == []
    assert [r.levelname for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert any("ended as its" in r.getMessage() for r in caplog.records)


def test_running_tells_a_live_process_from_a_zombie_and_a_gone_one() -> None:
    import os
    import subprocess
    import sys

    assert sup._running(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while sup._running(child.pid):  # a zombie until reaped below
        assert time.monotonic() < deadline
        time.sleep(0.01)
    child.wait()
    assert not sup._running(child.pid)
