"""A worker that does not exit within the grace is SIGKILLed; the line says why: a
worker that got no CPU (lowered to nice 19 on a busy machine) is the machine's state
(INFO), one that ran and ignored its exit is a WARNING (tide/trainer/launcher/supervisor.py)."""

from __future__ import annotations

import asyncio
import logging
import signal
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
    caplog.set_level(logging.INFO, logger=sup.__name__)
    worker = StuckWorker()
    await supervisor(tmp_path).stop(worker)
    assert worker.signals == [signal.SIGKILL]
    (line,) = [r for r in caplog.records if "SIGKILL" in r.getMessage()]
    assert line.levelname == level
    assert f"{starved_s:.2f}s of it waiting for a CPU" in line.getMessage()
