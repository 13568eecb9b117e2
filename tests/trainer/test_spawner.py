"""Workers forked from the zygote: exit codes, fd hygiene, and nothing outlives the launcher."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.support.poll import eventually
from tests.support.procs import gone
from tide.trainer.spawner import SubprocessSpawner, ZygoteSpawner
from tide.trainer.template import ENV_TEMPLATE, zygote_of

pytestmark = pytest.mark.integration

CHILD = """
import os, socket, sys, time
s = socket.socket()
print("fd", s.fileno(), "stdin", os.readlink("/proc/self/fd/0"), flush=True)
mode = sys.argv[1]
if mode == "exit3":
    raise SystemExit(3)
if mode == "sleep":
    time.sleep(60)
if mode == "grandchild":
    # A DataLoader's way: a worker process of the worker's own, not the zygote's.
    import subprocess
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print("grandchild", g.pid, flush=True)
    time.sleep(60)
"""


@pytest.fixture(autouse=True, params=["own import", "from the template"])
def zygote_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every case twice: a zygote that imports on its own (a pod's), and one forked from the
    session's Paddle template (tide/trainer/template.py)."""
    if request.param == "own import":
        monkeypatch.delenv(ENV_TEMPLATE, raising=False)
    elif ENV_TEMPLATE not in os.environ:
        pytest.skip("this session runs without a Paddle template (TIDE_TEST_PADDLE_TEMPLATE=0)")
    return str(request.param)


@pytest.fixture
def child(tmp_path: Path) -> Path:
    path = tmp_path / "child.py"
    path.write_text(CHILD)
    return path


async def test_zygote_children_exit_codes_and_fds(child: Path, tmp_path: Path) -> None:
    zygote = ZygoteSpawner(preload="")
    try:
        log = tmp_path / "c.log"
        w = await zygote.spawn(
            [sys.executable, str(child), "exit3"], dict(os.environ), str(tmp_path), str(log)
        )
        assert await w.wait() == 3
        # fd 0 stays taken (by /dev/null): Paddle's TCP store rejects a socket on fd 0.
        fd_line = log.read_text().split()
        assert int(fd_line[1]) > 2 and fd_line[3] == "/dev/null"
        w = await zygote.spawn(
            [sys.executable, str(child), "sleep"], dict(os.environ), str(tmp_path), ""
        )
        w.kill(signal.SIGKILL)
        assert await w.wait() == -signal.SIGKILL
    finally:
        await zygote.close()


async def test_closing_the_zygote_takes_its_workers_along(child: Path, tmp_path: Path) -> None:
    zygote = ZygoteSpawner(preload="")
    w = await zygote.spawn(
        [sys.executable, str(child), "sleep"], dict(os.environ), str(tmp_path), ""
    )
    await zygote.close()
    assert await w.wait() < 0
    await _wait_dead(w.pid)


async def _wait_dead(pid: int, timeout_s: float = 5.0) -> None:
    """Gone, or a zombie waiting for init to reap it (it no longer runs)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()  # noqa: ASYNC240 - procfs, no I/O wait
            state = stat.rsplit(")", 1)[1].split()[0]
        except OSError:
            return
        if state in ("Z", "X"):
            return
        assert asyncio.get_running_loop().time() < deadline, f"pid {pid} still {state}"
        await asyncio.sleep(0.02)


async def test_subprocess_spawner_runs_any_command(tmp_path: Path) -> None:
    spawner = SubprocessSpawner()
    w = await spawner.spawn(["sh", "-c", "exit 4"], dict(os.environ), str(tmp_path), "")
    assert await w.wait() == 4
    await spawner.close()


@pytest.mark.paddle
async def test_default_zygote_has_paddle_and_never_grpc(tmp_path: Path, zygote_kind: str) -> None:
    script = tmp_path / "probe.py"
    script.write_text("import sys\nprint('paddle' in sys.modules, 'grpc' in sys.modules)\n")
    zygote = ZygoteSpawner()
    try:
        import_s = await zygote.wait_ready()
        # The launcher's own zygote (no arguments) is forked from the template when one runs.
        assert zygote.pid is not None
        assert (zygote_of(zygote.pid) != zygote.pid) == (zygote_kind == "from the template")
        log = tmp_path / "probe.log"
        w = await zygote.spawn(
            [sys.executable, str(script)], dict(os.environ), str(tmp_path), str(log)
        )
        assert await w.wait() == 0
        # Forked after the import: the child has Paddle already, and no gRPC state to break.
        assert log.read_text().split() == ["True", "False"], import_s
    finally:
        await zygote.close()


async def test_a_dead_zygote_is_replaced_on_the_next_spawn(
    child: Path, tmp_path: Path, zygote_kind: str
) -> None:
    zygote = ZygoteSpawner(preload="")
    try:
        w = await zygote.spawn(
            [sys.executable, str(child), "sleep"], dict(os.environ), str(tmp_path), ""
        )
        first = zygote.pid
        assert first is not None
        # The pid the launcher holds is the zygote, or the stand-in of one the template forked.
        assert (zygote_of(first) != first) == (zygote_kind == "from the template")
        os.kill(first, signal.SIGKILL)
        assert await asyncio.wait_for(w.wait(), 10) < 0  # its worker went with it
        w2 = await zygote.spawn(
            [sys.executable, str(child), "exit3"], dict(os.environ), str(tmp_path), ""
        )
        assert await asyncio.wait_for(w2.wait(), 10) == 3
        assert zygote.pid not in (None, first)
    finally:
        await zygote.close()


async def test_a_killed_workers_own_children_do_not_outlive_it(child: Path, tmp_path: Path) -> None:
    zygote = ZygoteSpawner(preload="")
    try:
        log = tmp_path / "g.log"
        w = await zygote.spawn(
            [sys.executable, str(child), "grandchild"], dict(os.environ), str(tmp_path), str(log)
        )
        await eventually(
            lambda: log.exists() and "grandchild" in log.read_text(), 30, what="the grandchild"
        )
        grandchild = int(log.read_text().split("grandchild")[1].split()[0])
        assert not gone(grandchild)
        w.kill(signal.SIGKILL)  # its exit grace spent, as in a resize
        assert await w.wait() == -signal.SIGKILL
        await eventually(lambda: gone(grandchild), 10, what="the orphaned grandchild killed")
    finally:
        await zygote.close()
