"""The Paddle template (tide/trainer/template.py): runs and zygotes forked in callers' places,
and a caller it cannot serve faithfully refused into a process of its own."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.poll import eventually, wait_for
from tests.support.procs import gone
from tide.trainer import template
from tide.trainer.spawner import ZygoteSpawner

pytestmark = pytest.mark.integration

SCRIPT = """
import os, sys, time
print("argv", sys.argv[1:], "cwd", os.getcwd(), "x", os.environ.get("X"), flush=True)
print("on stderr", file=sys.stderr, flush=True)
if sys.argv[1] == "sleep":
    time.sleep(60)
if sys.argv[1] == "why":
    raise SystemExit("the reason it stopped")
if sys.argv[1] == "count":
    with open(sys.argv[2], "a") as f:
        f.write("ran\\n")
    raise SystemExit(0)
raise SystemExit(int(sys.argv[1]))
"""


@pytest.fixture
def tpl(tmp_path: Path) -> Iterator[str]:
    """A template of this test's own (nothing preloaded: the mechanism, not Paddle)."""
    path = str(tmp_path / "t.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tide.trainer.template", "--socket", path, "--preload", ""],
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None and b'"ready"' in proc.stdout.readline()
    yield path
    proc.kill()
    proc.wait()


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "s.py"
    path.write_text(SCRIPT)
    return path


def _run(
    tpl: str, argv: list[str], tmp_path: Path, **env: str
) -> tuple[template.Run | subprocess.Popen[bytes], Path]:
    log = tmp_path / "out.log"
    with open(log, "ab") as out:
        proc = template.popen(
            argv,
            env={**os.environ, template.ENV_TEMPLATE: tpl, **env},
            cwd=str(tmp_path),
            stdout=out,
            stderr=out,
        )
    return proc, log


def test_a_script_runs_forked_with_the_callers_arguments_environment_directory_and_files(
    tpl: str, script: Path, tmp_path: Path
) -> None:
    proc, log = _run(tpl, [sys.executable, str(script), "3"], tmp_path, X="mine")
    assert isinstance(proc, template.Run)
    assert proc.wait(30) == 3 and proc.poll() == 3
    text = log.read_text()
    assert f"argv ['3'] cwd {tmp_path} x mine" in text and "on stderr" in text


def test_a_module_runs_with_the_callers_pythonpath(tpl: str, script: Path, tmp_path: Path) -> None:
    proc, log = _run(tpl, [sys.executable, "-m", "s", "0"], tmp_path, PYTHONPATH=str(script.parent))
    assert isinstance(proc, template.Run) and proc.wait(30) == 0
    assert "argv ['0']" in log.read_text()


def test_a_run_is_killed_and_waited_for_like_a_popen(
    tpl: str, script: Path, tmp_path: Path
) -> None:
    proc, _ = _run(tpl, [sys.executable, str(script), "sleep"], tmp_path)
    assert isinstance(proc, template.Run)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0)
    proc.kill()
    # Polled until it ends, as a caller that cleans up does, then waited for once more.
    assert wait_for(lambda: proc.poll() is not None, 10, what="the killed run's end")
    assert proc.poll() == proc.wait() == -signal.SIGKILL


def test_a_run_that_exits_with_a_message_prints_it_as_python_does(
    tpl: str, script: Path, tmp_path: Path
) -> None:
    proc, log = _run(tpl, [sys.executable, str(script), "why"], tmp_path)
    assert isinstance(proc, template.Run) and proc.wait(30) == 1
    assert "the reason it stopped" in log.read_text()


def _template(tmp_path: Path, preload: str, **env: str) -> tuple[subprocess.Popen[bytes], str]:
    path = str(tmp_path / f"{preload or 'bare'}.sock")
    owner = subprocess.Popen(
        [sys.executable, "-m", "tide.trainer.template", "--socket", path, "--preload", preload],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(tmp_path), **env},
    )
    return owner, path


def test_a_caller_that_gave_up_waiting_runs_once_not_twice(
    script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller that stops waiting for a template still importing runs its own process; the
    template forks for the request later, and that fork must not run it too."""
    (tmp_path / "slowimport.py").write_text("import time\ntime.sleep(1.0)\n")
    owner, path = _template(tmp_path, "slowimport")
    try:
        wait_for(lambda: os.path.exists(path), 10, what="the template's socket")
        counted = tmp_path / "count.txt"
        monkeypatch.setattr(template, "_CONNECT_TIMEOUT_S", 0.2)
        proc, _ = _run(path, [sys.executable, str(script), "count", str(counted)], tmp_path)
        assert isinstance(proc, subprocess.Popen) and proc.wait(30) == 0
        # The template has answered both once the next request is served.
        monkeypatch.setattr(template, "_CONNECT_TIMEOUT_S", 30.0)
        later, _ = _run(path, [sys.executable, str(script), "0"], tmp_path)
        assert isinstance(later, template.Run) and later.wait(30) == 0
        children = Path(f"/proc/{owner.pid}/task/{owner.pid}/children")
        wait_for(lambda: not children.read_text().split(), 15, what="the late fork's end")
        assert counted.read_text().splitlines() == ["ran"]
    finally:
        owner.kill()
        owner.wait()


@pytest.mark.parametrize(
    "line",
    [
        b"[]\n",
        b"not json\n",
        b'{"kind": 5}\n',
        b'{"kind": "run", "argv": "python", "env": {}, "cwd": "/", "python": "p"}\n',
        b'{"kind": "run", "argv": ["python", "s.py"], "env": {"A": 1}, "cwd": "/", "python": "p"}\n',
    ],
)
def test_a_malformed_request_is_refused_and_the_template_serves_on(
    tpl: str, script: Path, tmp_path: Path, line: bytes
) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(tpl)
        conn.sendall(line)
        assert b'"refused"' in conn.recv(4096)
    proc, _ = _run(tpl, [sys.executable, str(script), "7"], tmp_path)
    assert isinstance(proc, template.Run) and proc.wait(30) == 7


@pytest.mark.parametrize(
    ("argv_tail", "env", "why"),
    [
        (["s.py", "4"], {"FLAGS_use_mkldnn": "1"}, "a value Paddle reads at import differs"),
        (["-c", "raise SystemExit(4)"], {}, "-c is not a script or a module"),
    ],
)
def test_what_the_template_cannot_run_faithfully_gets_a_process_of_its_own(
    tpl: str, script: Path, tmp_path: Path, argv_tail: list[str], env: dict[str, str], why: str
) -> None:
    proc, _ = _run(tpl, [sys.executable, *argv_tail], tmp_path, **env)
    assert isinstance(proc, subprocess.Popen), why
    assert proc.wait(30) == 4


def test_what_the_import_sets_for_itself_is_no_difference(script: Path, tmp_path: Path) -> None:
    """Paddle sets OMP_NUM_THREADS=1 when it is unset, and a process that imported Paddle passes
    that on: such a caller is served. One that asks for other threads is not."""
    (tmp_path / "likepaddle.py").write_text(
        "import os\nos.environ.setdefault('OMP_NUM_THREADS', '1')\n"
    )
    path = str(tmp_path / "p.sock")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    owner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tide.trainer.template",
            "--socket",
            path,
            "--preload",
            "likepaddle",
        ],
        stdout=subprocess.PIPE,
        env={**env, "PYTHONPATH": str(tmp_path)},
    )
    try:
        assert owner.stdout is not None and b'"ready"' in owner.stdout.readline()
        for threads, served in (("1", True), (None, True), ("4", False)):
            given = {"OMP_NUM_THREADS": threads} if threads else {}
            log = tmp_path / "out.log"
            with open(log, "ab") as out:
                proc = template.popen(
                    [sys.executable, str(script), "0"],
                    env={**env, template.ENV_TEMPLATE: path, **given},
                    cwd=str(tmp_path),
                    stdout=out,
                    stderr=out,
                )
            assert isinstance(proc, template.Run) == served, threads
            assert proc.wait(30) == 0
    finally:
        owner.kill()
        owner.wait()


def test_no_template_at_the_named_socket_means_a_process_of_its_own(
    script: Path, tmp_path: Path
) -> None:
    proc, _ = _run(str(tmp_path / "none.sock"), [sys.executable, str(script), "5"], tmp_path)
    assert isinstance(proc, subprocess.Popen) and proc.wait(30) == 5


def test_the_templates_end_ends_its_runs(tmp_path: Path, script: Path) -> None:
    path = str(tmp_path / "t.sock")
    owner = subprocess.Popen(
        [sys.executable, "-m", "tide.trainer.template", "--socket", path, "--preload", ""],
        stdout=subprocess.PIPE,
    )
    assert owner.stdout is not None and b'"ready"' in owner.stdout.readline()
    proc, _ = _run(path, [sys.executable, str(script), "sleep"], tmp_path)
    assert isinstance(proc, template.Run)
    owner.kill()
    owner.wait()
    proc.wait(10)
    # Its death signal is SIGKILL on its parent's end (PR_SET_PDEATHSIG).
    wait_for(lambda: gone(proc.pid), 10, what="the run ended with its template")


async def test_a_zygote_forked_in_the_launchers_place_ends_when_its_stand_in_is_killed(
    tpl: str, script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(template.ENV_TEMPLATE, tpl)
    spawner = ZygoteSpawner(preload="")
    try:
        w = await spawner.spawn(
            [sys.executable, str(script), "sleep"], dict(os.environ), str(tmp_path), ""
        )
        stand_in = spawner.pid
        assert stand_in is not None
        forked = template.zygote_of(stand_in)
        assert forked != stand_in
        children = Path(f"/proc/{forked}/task/{forked}/children").read_text().split()  # noqa: ASYNC240 - procfs
        assert str(w.pid) in children
        os.kill(stand_in, signal.SIGKILL)
        await eventually(lambda: gone(forked) and gone(w.pid), 10, what="the zygote and worker")
    finally:
        await spawner.close()


def test_a_zygote_killed_by_a_signal_reads_so_at_its_stand_in(tpl: str, tmp_path: Path) -> None:
    stand_in = subprocess.Popen(
        [sys.executable, "-m", "tide.trainer.zygote", "--preload", ""],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, template.ENV_TEMPLATE: tpl},
    )
    try:
        assert stand_in.stdout is not None and b'"ready"' in stand_in.stdout.readline()
        forked = template.zygote_of(stand_in.pid)
        assert forked != stand_in.pid
        os.kill(forked, signal.SIGKILL)
        assert stand_in.wait(10) == -signal.SIGKILL
    finally:
        if stand_in.poll() is None:
            stand_in.kill()
            stand_in.wait()


async def test_a_refused_zygote_imports_on_its_own(
    tpl: str, script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(template.ENV_TEMPLATE, tpl)
    monkeypatch.setenv("GLOG_v", "3")
    spawner = ZygoteSpawner(preload="")
    try:
        w = await spawner.spawn(
            [sys.executable, str(script), "6"], dict(os.environ), str(tmp_path), ""
        )
        assert await w.wait() == 6
        assert spawner.pid is not None and template.zygote_of(spawner.pid) == spawner.pid
    finally:
        await spawner.close()
