"""A launcher against the fake coordinator over a real socket, with a Paddle-free worker:
the rig of tests/trainer/test_launch.py, test_launch_link.py and test_restarts.py (their
``fake`` coordinator fixture is in tests/trainer/conftest.py)."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from tests.support.poll import eventually
from tests.trainer.fake_coordinator import FakeCoordinator, FakeMember
from tide.trainer.launch import Launcher, LauncherSettings

WORKER = str(Path(__file__).with_name("fake_worker.py"))


def make_launcher(port: int, tmp_path: Path, index: int = 0, **overrides: Any) -> Launcher:
    env_path = os.pathsep.join([str(Path(WORKER).parent), os.environ.get("PYTHONPATH", "")])
    os.environ["PYTHONPATH"] = env_path
    return Launcher(
        LauncherSettings(
            coordinator=f"127.0.0.1:{port}",
            job_id="ns/job",
            command=(sys.executable, WORKER),
            pod_name=f"pod-{index}",
            pod_index=index,
            state_dir=str(tmp_path / f"l{index}"),
            zygote_preload="",
            exit_grace_s=0.5,
            **overrides,
        )
    )


async def registered(
    coord: FakeCoordinator, port: int, tmp_path: Path, **overrides: Any
) -> tuple[Launcher, asyncio.Task[int], str, FakeMember]:
    """A launcher run against ``coord`` until it has registered: it, its run task, its
    member id and the fake's view of the member."""
    launcher = make_launcher(port, tmp_path, **overrides)
    run = asyncio.create_task(launcher.run())
    await eventually(lambda: coord.members, 10, what="registration")
    (mid,) = coord.members
    return launcher, run, mid, coord.members[mid]
