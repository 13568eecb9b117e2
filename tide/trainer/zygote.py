"""A warm parent that has imported Paddle and forks each new worker from itself.

Starting a process and importing Paddle costs about 2 s on the project machine; forking a parent
that has already imported it takes about 20 ms there. The zygote must never import gRPC, which
is not fork-safe: the launcher (which speaks gRPC) runs it as a child process and talks to it
over its stdin/stdout with JSON lines:

- launcher → zygote: ``{"cmd": "spawn", "id": N, "argv": [...], "env": {...}, "cwd": "...",
  "log": "path or null"}``
- zygote → launcher: ``{"event": "ready"}`` once warm, ``{"event": "spawned", "id": N, "pid": P}``,
  ``{"event": "exit", "pid": P, "code": C}`` (C < 0: killed by signal -C), and
  ``{"event": "error", "id": N, "message": "..."}``.

When its stdin closes (the launcher died) the zygote kills its workers and exits; each worker
also gets SIGKILL if the zygote dies (PR_SET_PDEATHSIG), so nothing outlives the launcher.

A worker's own children (a DataLoader's worker processes) are not ours to give a death
signal, and a worker SIGKILLed in a resize (its exit grace spent) left them running, each
holding the dataset and Paddle's memory, for the rest of the pod's life. The zygote is
therefore a child subreaper (PR_SET_CHILD_SUBREAPER): a dead worker's orphans become the
zygote's children, and it kills and reaps them as soon as it reaps the worker.

Usage: ``python -m tide.trainer.zygote [--preload paddle,paddle.distributed]``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
DEFAULT_PRELOAD = "numpy,paddle,paddle.distributed"
# The socket of a Paddle template to fork from instead of importing (tide/trainer/template.py).
ENV_TEMPLATE = "TIDE_PADDLE_TEMPLATE"


def _emit(fd: int, event: dict[str, Any]) -> None:
    os.write(fd, (json.dumps(event) + "\n").encode())


def is_python_command(argv: Sequence[str]) -> bool:
    """A Python interpreter and what it runs: what a fork of an interpreter can run."""
    return bool(argv) and os.path.basename(argv[0]).startswith("python") and len(argv) >= 2


def run_child(request: dict[str, Any], close_fds: list[int], zygote_pid: int) -> NoReturn:
    """Runs in the forked child; never returns."""
    code = 1
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != zygote_pid:
            # The zygote died between the fork and the prctl: no death signal will come,
            # and this worker would run on as an orphan (CI's leak check found one).
            os._exit(1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        # stdin becomes /dev/null by dup2, never by close: a free fd 0 would be handed to the
        # next socket, and Paddle's TCP store treats a socket fd of 0 as a failure.
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        if devnull != 0:
            os.close(devnull)
        for fd in close_fds:
            if fd > 2:
                with contextlib.suppress(OSError):
                    os.close(fd)
        log = request.get("log")
        if log:
            out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.close(out)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request.get("cwd") or os.getcwd())
        argv: list[str] = list(request["argv"])
        args = argv[1:] if os.path.basename(argv[0]).startswith("python") else argv
        try:
            if args[:1] == ["-m"]:
                sys.argv = [args[1], *args[2:]]
                runpy.run_module(args[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(args)
                sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
                runpy.run_path(args[0], run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if code == 1 and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)  # as Python prints SystemExit("why")
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        exit_now(code)


def exit_now(code: int) -> NoReturn:
    """End this process (a worker or the zygote) with ``code`` once its output is flushed,
    skipping Python's teardown: it holds nothing to finalize, and tearing down Paddle's
    modules is CPU taken from the training on the same node (docs/trainer.md)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def prctl(option: int, value: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, value)


def _own_children() -> set[int]:
    """Every child of this process, adopted orphans included (any thread's list: an
    orphan is reparented to one of the subreaper's threads)."""
    found: set[int] = set()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                found.update(int(p) for p in f.read().split())
        except OSError:
            continue
    return found


def _kill_orphans(workers: set[int], orphans: set[int]) -> None:
    """SIGKILL every child that is not one of our workers: a dead worker's descendants,
    adopted here. They are reaped with the workers (``orphans``) and reported to no one."""
    for pid in _own_children() - workers - orphans:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        orphans.add(pid)


def serve(preload: list[str], stand_in: int | None = None) -> int:
    """Forks workers on request until stdin closes, or, for a zygote forked from a Paddle
    template (tide/trainer/template.py), until ``stand_in`` (a pidfd of the process the
    launcher started in its place) is readable: that process ended."""
    # Keep the protocol pipe for ourselves; anything imported modules print goes to stderr.
    events_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    started = time.monotonic()
    for name in preload:
        importlib.import_module(name)
    _emit(events_fd, {"event": "ready", "import_s": time.monotonic() - started})
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    children: set[int] = set()
    zygote_pid = os.getpid()
    orphans: set[int] = set()
    buf = b""
    stdin_fd = 0
    watched = [stdin_fd] if stand_in is None else [stdin_fd, stand_in]
    try:
        while True:
            readable, _, _ = select.select(watched, [], [], 0.02)
            if stand_in is not None and stand_in in readable:
                return 0
            while children or orphans:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    orphans.clear()
                    break
                if pid == 0:
                    break
                if pid in orphans:
                    orphans.discard(pid)
                    continue
                children.discard(pid)
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                _emit(events_fd, {"event": "exit", "pid": pid, "code": code})
                # The worker is gone, so its children are ours now (reparented before it
                # could be reaped).
                _kill_orphans(children, orphans)
            if not readable:
                continue
            chunk = os.read(stdin_fd, 65536)
            if not chunk:
                return 0
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if not line.strip():
                    continue
                request = json.loads(line)
                if request.get("cmd") != "spawn":
                    _emit(
                        events_fd, {"event": "error", "id": request.get("id"), "message": "bad cmd"}
                    )
                    continue
                pid = os.fork()
                if pid == 0:
                    run_child(request, [stdin_fd, events_fd, *watched[1:]], zygote_pid)
                children.add(pid)
                _emit(events_fd, {"event": "spawned", "id": request.get("id"), "pid": pid})
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _kill_orphans(children, orphans)


def main(argv: list[str] | None = None, stand_in: int | None = None) -> int:
    """``stand_in``: this zygote was forked from a Paddle template (tide/trainer/template.py),
    in the place of that process."""
    args_in = sys.argv[1:] if argv is None else argv
    template_path = os.environ.get(ENV_TEMPLATE)
    if stand_in is None and template_path:
        from tide.trainer import template

        code = template.stand_in(template_path, args_in)
        if code is not None:
            return code
    p = argparse.ArgumentParser(description="fork server for Paddle workers")
    p.add_argument("--preload", default=DEFAULT_PRELOAD, help="comma-separated modules to import")
    preload = preload_modules(p.parse_args(args_in).preload, "zygote")
    return 2 if preload is None else serve(preload, stand_in)


def preload_modules(spec: str, who: str) -> list[str] | None:
    """The modules of a comma-separated ``--preload``; None (said on stderr) when it names
    gRPC, which does not survive the forks that follow."""
    preload = [m for m in spec.split(",") if m]
    if any(m == "grpc" or m.startswith("grpc.") for m in preload):
        print(f"the {who} must not import grpc (not fork-safe)", file=sys.stderr)
        return None
    return preload


if __name__ == "__main__":
    # A shrink's leaving pods end their zygotes during the stayers' first step.
    exit_now(main())
