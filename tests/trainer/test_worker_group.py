"""A pod of several workers holds when all of them have (tide/trainer/launcher/group.py): each
hands its own state over before it says Held, and the pod's Held lets the coordinator go on
to what stops the old workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tide.trainer.launcher.group import WorkerGroup
from tide.trainer.launcher.settings import LauncherSettings
from tide.trainer.messages import Held, Progress, ToLauncher
from tide.trainer.spawner import WorkerHandle

pytestmark = pytest.mark.unit


def _group(tmp_path: Path, size: int, heard: list[ToLauncher]) -> WorkerGroup:
    async def on_exit(worker: WorkerHandle, code: int, expected: bool) -> None:
        raise AssertionError("no worker exits here")

    async def on_message(msg: ToLauncher) -> None:
        heard.append(msg)

    settings = LauncherSettings(
        coordinator="127.0.0.1:1", job_id="ns/j", command=("true",), prewarm=False
    )
    spawner: Any = object()
    envs = [{"TIDE_LOCAL_RANK": str(i)} for i in range(size)]
    return WorkerGroup(settings, spawner, tmp_path, envs, lambda: False, on_exit, on_message)


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
    # An answer from a worker already holding (another directive at the same step) goes on
    # at once; a later worker's own answer adds nothing.
    again = Held(step=7, directive_ids=("d2",))
    await _say(group, 0, again)
    await _say(group, 1, Held(step=7, directive_ids=("d2",)))
    assert heard == [lead, again]


async def test_a_later_workers_hold_before_the_leaders_is_counted(tmp_path: Path) -> None:
    heard: list[ToLauncher] = []
    group = _group(tmp_path, 2, heard)
    await _say(group, 1, Held(step=3))
    lead = Held(step=3)
    await _say(group, 0, lead)
    assert heard == [lead]
    # The next hold of the generation waits again: step 3 is no hold at step 9.
    nine = Held(step=9)
    await _say(group, 0, nine)
    assert heard == [lead]
    await _say(group, 1, Held(step=9))
    assert heard == [lead, nine]


async def test_only_the_leaders_other_messages_are_passed_on(tmp_path: Path) -> None:
    heard: list[ToLauncher] = []
    group = _group(tmp_path, 2, heard)
    await _say(group, 1, Progress(step=4, samples_per_s=10.0))
    await _say(group, 0, Progress(step=4, samples_per_s=5.0))
    assert heard == [Progress(step=4, samples_per_s=15.0)]
