"""A pod of several workers holds when all of them have (tide/trainer/launcher/group.py): each
hands its own state over before it says Held, and the pod's Held lets the coordinator go on
to what stops the old workers."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tide.trainer.launcher.group import WorkerGroup
from tide.trainer.launcher.settings import LauncherSettings
from tide.trainer.messages import Held, Progress, Resume, ToLauncher
from tide.trainer.spawner import WorkerHandle

pytestmark = pytest.mark.unit


def _group(
    tmp_path: Path,
    size: int,
    heard: list[ToLauncher],
    finish_wait_s: float = 120.0,
) -> WorkerGroup:
    async def on_exit(worker: WorkerHandle, code: int, expected: bool) -> None:
        raise AssertionError("no worker exits here")

    async def on_message(msg: ToLauncher) -> None:
        heard.append(msg)

    settings = LauncherSettings(
        coordinator="127.0.0.1:1",
        job_id="ns/j",
        command=("true",),
        prewarm=False,
        finish_wait_s=finish_wait_s,
    )
    spawner: Any = object()
    envs = [{"TIDE_LOCAL_RANK": str(i)} for i in range(size)]
    return WorkerGroup(settings, spawner, tmp_path, envs, lambda: False, on_exit, on_message)


class StubWorker:
    """A worker that runs: a pid and no exit yet."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None


async def _say(group: WorkerGroup, i: int, msg: ToLauncher) -> None:
    await group.members[i]._on_current_message(msg)


async def test_the_pods_hold_waits_for_its_last_worker(tmp_path: Path) -> None:
    heard: list[ToLauncher] = []
    group = _group(tmp_path, 3, heard)
    lead = Held(step=7, directive_ids=("d1",))
    await _say(group, 0, lead)
    await _say(group, 2, Held(step=7, directive_ids=("d1",)))
    assert heard == [], "the pod held before its worker 1 had handed its state over"
    await _say(group, 1, Held(step=7, directive_ids=("d1",)))
    assert heard == [lead]
    # A directive answered again from the hold (a pod told to leave after its ranks stopped
    # on other pods' word) is handed over or written again: the pod's answer waits for it.
    again = Held(step=7, directive_ids=("d2",))
    await _say(group, 0, again)
    await _say(group, 2, Held(step=7, directive_ids=("d2",)))
    assert heard == [lead]
    await _say(group, 1, Held(step=7, directive_ids=("d2",)))
    assert heard == [lead, again]


async def test_directives_answered_together_or_apart_count_alike(tmp_path: Path) -> None:
    heard: list[ToLauncher] = []
    group = _group(tmp_path, 2, heard)
    await _say(group, 1, Held(step=5, directive_ids=("d1", "d2")))
    first, second = Held(step=5, directive_ids=("d1",)), Held(step=5, directive_ids=("d2",))
    await _say(group, 0, first)
    await _say(group, 0, second)
    assert heard == [first, second]


async def test_a_resume_drops_the_hold_still_waiting(tmp_path: Path) -> None:
    """The barrier ended without this pod's hold (aborted): passed on after the RESUME it
    would say HOLDING of workers that train."""
    heard: list[ToLauncher] = []
    group = _group(tmp_path, 2, heard)
    await _say(group, 0, Held(step=4, directive_ids=("d1",)))
    group.send(Resume())
    await _say(group, 1, Held(step=4, directive_ids=("d1",)))
    assert heard == []


async def test_the_old_generations_late_holds_count_for_nothing_new(tmp_path: Path) -> None:
    heard: list[ToLauncher] = []
    group = _group(tmp_path, 2, heard)
    for i, m in enumerate(group.members):
        m.worker = StubWorker(100 + i)
    # A new generation's start replaces each old worker at the call (its coroutine runs
    # later): what the old workers say until the switch is the old generation's.
    starts = [m.start_generation({}, generation=2, rank=i) for i, m in enumerate(group.members)]
    late = Held(step=30)
    await _say(group, 1, Held(step=30))
    await _say(group, 0, late)
    assert heard == [late], "the old leader's answer still reaches the core, as before"
    for i, (m, start) in enumerate(zip(group.members, starts, strict=True)):
        start.close()
        m.worker = StubWorker(200 + i)  # the switch
    # The new generation restored step 20: its hold at 24 waits for its own worker 1.
    hold = Held(step=24)
    await _say(group, 0, hold)
    assert heard == [late], "the old worker 1's hold at 30 counted for the new generation"
    await _say(group, 1, Held(step=24))
    assert heard == [late, hold]


async def test_only_the_leaders_other_messages_are_passed_on(tmp_path: Path) -> None:
    heard: list[ToLauncher] = []
    group = _group(tmp_path, 2, heard)
    await _say(group, 1, Progress(step=4, samples_per_s=10.0))
    await _say(group, 0, Progress(step=4, samples_per_s=5.0))
    assert heard == [Progress(step=4, samples_per_s=15.0)]


class EndingWorker:
    """A worker that runs until the test ends it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._end: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    @property
    def returncode(self) -> int | None:
        return self._end.result() if self._end.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._end)

    def end(self, code: int) -> None:
        self._end.set_result(code)

    def kill(self, sig: int = 9) -> None:
        raise AssertionError("nothing stops a worker here")


async def _finish_first(group: WorkerGroup) -> tuple[EndingWorker, asyncio.Task[bool]]:
    """Worker 0 finished its budget and exited 0 while worker 1 still runs: the core asks
    whether the pod's other workers finished too (core.py, at the first's end)."""
    follower = EndingWorker(2)
    group.members[1].worker = follower
    waiting = asyncio.create_task(group.followers_finished())
    await asyncio.sleep(0.05)
    return follower, waiting


async def test_a_pod_ends_once_its_other_workers_have_finished_too(tmp_path: Path) -> None:
    """CI once read a follower's final file cut short: the pod had ended, and stopped it, as
    soon as its first worker finished, while the follower still wrote (its slice's final
    checkpoint could be cut short the same way)."""
    group = _group(tmp_path, 2, [])
    follower, waiting = await _finish_first(group)
    assert not waiting.done(), "the pod ended while its worker 1 still ran"
    follower.end(0)
    assert await asyncio.wait_for(waiting, 5)


async def test_a_follower_that_fails_after_the_first_finished_is_the_pods_end(
    tmp_path: Path,
) -> None:
    group = _group(tmp_path, 2, [])
    follower, waiting = await _finish_first(group)
    follower.end(3)
    assert not await asyncio.wait_for(waiting, 5), "the first's success hid its follower's failure"


async def test_a_follower_still_running_at_the_bound_is_stopped_with_the_pod(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    group = _group(tmp_path, 2, [], finish_wait_s=0.2)
    _, waiting = await _finish_first(group)
    assert await asyncio.wait_for(waiting, 5)
    assert "still run" in caplog.text
