"""A Paddle template: one process that imported Paddle once, forking runs and zygotes for callers.

Every process that imports Paddle pays for it in CPU (docs/trainer.md, "The Paddle template").
Where many such processes start on one machine, one after another (local runs, the test suite),
a template pays it once: it imports Paddle, listens on a Unix socket, and forks, for each
caller,

- a **run**: the caller's Python script, with the caller's environment, directory, arguments,
  and its stdout and stderr on the caller's files: a ``subprocess.Popen`` that skips the
  import (:func:`popen`);
- a **zygote**: the zygote a launcher starts (tide/trainer/zygote.py), serving the launcher's
  pipes in place of a process that would import Paddle again. The launcher's own child (the
  ``python -m tide.trainer.zygote`` it started) stays as the zygote's stand-in: it lives as long
  as the forked zygote, exits with its code, and the forked zygote ends (its workers with it) as
  soon as the stand-in is killed.

A caller names the template by its socket in ``TIDE_PADDLE_TEMPLATE``; without it, nothing
changes. What a forked process cannot take from the caller is what Paddle read while it was
imported, so a caller whose environment differs from the template's there (``FLAGS_*``,
``GLOG_*``, thread counts, the library path, ``PYTHONHASHSEED``) is refused and starts its own
process, as without a template. So is every caller when the template is gone.

Protocol, one request a connection: a JSON line sent with the caller's descriptors
(``SCM_RIGHTS``: stdout and stderr for a run; stdin, stdout and stderr for a zygote)::

    {"kind": "run" | "zygote", "argv": [...], "env": {...}, "cwd": "...", "watch_pid": P}

answered ``{"pid": P}`` or ``{"refused": "why"}``, then ``{"code": C}`` when that process ends
(C < 0: killed by signal -C). Like the zygote, the template never imports gRPC, which does not
survive a fork.

Usage: ``python -m tide.trainer.template --socket PATH [--preload numpy,paddle]``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import IO, Any, NoReturn

from tide.trainer import zygote

ENV_TEMPLATE = zygote.ENV_TEMPLATE
# What Paddle and the libraries under it read once, at import or load: a caller whose values
# differ would run with the template's.
_FIXED_AT_IMPORT_PREFIXES = ("FLAGS_", "GLOG_", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "CUDA_")
_FIXED_AT_IMPORT = ("LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONHASHSEED", "PYTHONOPTIMIZE")
_CONNECT_TIMEOUT_S = 10.0
# A stand-in's name (/proc/PID/comm, 15 characters at most) before its zygote's pid.
_STAND_IN = "zygote@"


def _fixed_at_import(env: Mapping[str, str]) -> dict[str, str]:
    return {
        k: v
        for k, v in env.items()
        if k.startswith(_FIXED_AT_IMPORT_PREFIXES) or k in _FIXED_AT_IMPORT
    }


def _send(conn: socket.socket, msg: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        conn.sendall((json.dumps(msg) + "\n").encode())


# ---- the template ----------------------------------------------------------------------------


class _Template:
    def __init__(
        self, listener: socket.socket, before: dict[str, str], after: dict[str, str]
    ) -> None:
        self.listener = listener
        # The values the import ran with, as it left them; and those it set for itself.
        self.import_env = after
        self.defaulted = {k: v for k, v in after.items() if k not in before}
        self.pid = os.getpid()
        self.base_path = list(sys.path)
        self.served: dict[int, socket.socket] = {}

    def serve(self) -> int:
        while True:
            readable, _, _ = select.select([self.listener], [], [], 0.05)
            self._reap()
            if readable:
                with contextlib.suppress(OSError):
                    conn, _ = self.listener.accept()
                    self._answer(conn)

    def _reap(self) -> None:
        while self.served:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.served.pop(pid, None)
            if conn is not None:
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                _send(conn, {"code": code})
                conn.close()

    def _answer(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            conn.settimeout(5.0)
            data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
            while not data.endswith(b"\n"):
                more = conn.recv(1 << 16)
                if not more:
                    raise ValueError("the request ended before its line did")
                data += more
            req = json.loads(data)
            why = self._refusal(req, fds)
        except (OSError, ValueError) as exc:
            why = f"unreadable request: {exc}"
            req = {}
        if why:
            _send(conn, {"refused": why})
            conn.close()
            for fd in fds:
                os.close(fd)
            return
        try:
            pid = os.fork()
        except OSError as exc:
            _send(conn, {"refused": f"fork failed: {exc}"})
            conn.close()
            pid = -1
        if pid == 0:
            closing = [self.listener.fileno(), conn.fileno()]
            _child(req, fds, closing + [c.fileno() for c in self.served.values()], self)
        for fd in fds:
            os.close(fd)
        if pid > 0:
            self.served[pid] = conn
            _send(conn, {"pid": pid})

    def _refusal(self, req: dict[str, Any], fds: list[int]) -> str:
        kind = req.get("kind")
        wanted = {"run": 2, "zygote": 3}.get(kind or "")
        if wanted is None:
            return f"kind must be run or zygote, got {kind!r}"
        if len(fds) != wanted:
            return f"a {kind} needs {wanted} descriptors, got {len(fds)}"
        # What the caller's own import would have ended with: its values, and where it has
        # none, what the import sets for itself (Paddle sets OMP_NUM_THREADS=1 when unset, and
        # a caller that imported Paddle passes that on).
        theirs = {**self.defaulted, **_fixed_at_import(req.get("env") or {})}
        differ = sorted(
            k
            for k in theirs.keys() | self.import_env.keys()
            if theirs.get(k) != self.import_env.get(k)
        )
        if differ:
            return f"Paddle was imported here with other values of {', '.join(differ)}"
        return ""

    def adopt_path(self, env: Mapping[str, str], first: str | None) -> None:
        """sys.path as the caller's own interpreter would have started it: ``first`` (the
        working directory for ``-m``; a script's directory is put first when it runs), the
        caller's PYTHONPATH, then the interpreter's own entries (the template's, less its own
        first entry and PYTHONPATH)."""
        ours = set(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))
        rest = [p for p in self.base_path[1:] if p not in ours]
        theirs = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [*([first] if first else []), *theirs, *rest]


def _child(req: dict[str, Any], fds: list[int], closing: list[int], tpl: _Template) -> NoReturn:
    """The forked child: becomes the caller's run or zygote; never returns."""
    code = 1
    try:
        for fd in closing:
            with contextlib.suppress(OSError):
                os.close(fd)
        zygote.prctl(zygote.PR_SET_PDEATHSIG, signal.SIGKILL)
        env: dict[str, str] = req["env"]
        cwd = req.get("cwd") or os.getcwd()
        argv: list[str] = list(req["argv"])
        if req["kind"] == "run":
            os.dup2(fds[0], 1)
            os.dup2(fds[1], 2)
            for fd in fds:
                if fd > 2:
                    os.close(fd)
            tpl.adopt_path(env, cwd if argv[1:2] == ["-m"] else None)
            zygote.run_child({"argv": argv, "env": env, "cwd": cwd, "log": None}, [], tpl.pid)
        # A zygote: the launcher's pipes become its stdio, the stand-in's end becomes its end.
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        tpl.adopt_path(env, cwd)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        watch = os.pidfd_open(int(req["watch_pid"]))
        code = zygote.main(argv, stand_in=watch)
    except BaseException:  # a forked child must never return into the template
        traceback.print_exc()
    zygote.exit_now(code)


def serve(path: str, preload: Sequence[str]) -> int:
    # Bound before the import, so that a caller who comes early waits in the backlog instead
    # of finding no socket and importing Paddle itself.
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener.bind(path)
    listener.listen(128)
    zygote.prctl(zygote.PR_SET_PDEATHSIG, signal.SIGKILL)
    # Before the import: Paddle sets some of these for itself (OMP_NUM_THREADS) while importing.
    import_env = _fixed_at_import(os.environ)
    started = time.monotonic()
    for name in preload:
        importlib.import_module(name)
    print(json.dumps({"event": "ready", "import_s": time.monotonic() - started}), flush=True)
    try:
        return _Template(listener, import_env, _fixed_at_import(os.environ)).serve()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


# ---- callers ----------------------------------------------------------------------------------


class _Refused(Exception):
    pass


def _request(
    path: str, kind: str, argv: Sequence[str], env: Mapping[str, str], cwd: str, fds: list[int]
) -> tuple[socket.socket, int]:
    """Sends one request; the connection and the forked pid, or _Refused."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # The template answers once it has imported: a caller that came early waits for it.
        conn.settimeout(_CONNECT_TIMEOUT_S)
        conn.connect(path)
        req = {
            "kind": kind,
            "argv": list(argv),
            "env": dict(env),
            "cwd": cwd,
            "watch_pid": os.getpid(),
        }
        line = (json.dumps(req) + "\n").encode()
        sent = socket.send_fds(conn, [line], fds)
        if sent < len(line):
            conn.sendall(line[sent:])
        answer = _read_line(conn)
    except OSError as exc:
        conn.close()
        raise _Refused(f"no template at {path} ({exc})") from exc
    if "pid" not in answer:
        conn.close()
        raise _Refused(str(answer.get("refused") or "the template did not answer"))
    conn.settimeout(None)
    return conn, int(answer["pid"])


def _read_line(conn: socket.socket) -> dict[str, Any]:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            return {}
        buf += chunk
    out: dict[str, Any] = json.loads(buf.split(b"\n", 1)[0])
    return out


class Run:
    """A script forked from the template: the part of ``subprocess.Popen`` callers use."""

    def __init__(self, argv: Sequence[str], conn: socket.socket, pid: int) -> None:
        self.args = list(argv)
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn

    def poll(self) -> int | None:
        if self.returncode is None:
            self._conn.setblocking(False)
            try:
                answer = _read_line(self._conn)
            except BlockingIOError:
                self._conn.setblocking(True)
                return None
            self._ended(answer)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                answer = _read_line(self._conn)
            except TimeoutError:
                self._conn.settimeout(None)
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0) from None
            self._ended(answer)
        assert self.returncode is not None
        return self.returncode

    def _ended(self, answer: dict[str, Any]) -> None:
        # No answer: the template died, and took its children with it (PR_SET_PDEATHSIG).
        self.returncode = int(answer.get("code", -signal.SIGKILL))
        self._conn.close()

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def popen(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str,
    stdout: IO[Any] | int,
    stderr: IO[Any] | int,
) -> Run | subprocess.Popen[bytes]:
    """``argv`` (a Python script, or ``python -m module``) forked from the template named in
    ``env``, or a fresh process where there is none or it refuses."""
    path = env.get(ENV_TEMPLATE)
    out = stdout if isinstance(stdout, int) else stdout.fileno()
    err = stderr if isinstance(stderr, int) else stderr.fileno()
    # A script or a module, as a zygote runs them; ``-c`` and other flags go to a fresh process.
    if path and zygote.is_python_command(argv) and (argv[1] == "-m" or argv[1][:1] != "-"):
        with contextlib.suppress(_Refused):
            conn, pid = _request(path, "run", argv, env, cwd, [out, err])
            return Run(argv, conn, pid)
    return subprocess.Popen(list(argv), env=dict(env), cwd=cwd, stdout=out, stderr=err)


def stand_in(path: str, argv: Sequence[str]) -> int | None:
    """Run in the process a launcher started as its zygote: has the template fork the zygote
    on this process's stdin, stdout and stderr, then waits for it and returns its code. None
    when there is no template or it refuses (the reason on stderr): import Paddle here."""
    try:
        conn, pid = _request(path, "zygote", argv, os.environ, os.getcwd(), [0, 1, 2])
    except _Refused as exc:
        print(f"zygote: importing Paddle here: {exc}", file=sys.stderr, flush=True)
        return None
    # Which process is the zygote, for `ps` and for :func:`zygote_of`.
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:
        comm.write(f"{_STAND_IN}{pid}")
    # The forked zygote holds the pipes now: the launcher must see their ends when it ends,
    # not when this stand-in does.
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)
    with contextlib.suppress(OSError):
        answer = _read_line(conn)
        return int(answer.get("code", 1))
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return 1


def zygote_of(pid: int) -> int:
    """The zygote that process ``pid`` stands in for, or ``pid`` itself when it is a zygote
    that imported Paddle on its own."""
    with contextlib.suppress(OSError, ValueError):
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
        if comm.startswith(_STAND_IN):
            return int(comm[len(_STAND_IN) :])
    return pid


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="fork runs and zygotes from one Paddle import")
    p.add_argument("--socket", required=True, help="the Unix socket to listen on")
    p.add_argument("--preload", default=zygote.DEFAULT_PRELOAD, help="comma-separated modules")
    args = p.parse_args(argv)
    preload = [m for m in args.preload.split(",") if m]
    if any(m == "grpc" or m.startswith("grpc.") for m in preload):
        print("the template must not import grpc (not fork-safe)", file=sys.stderr)
        return 2
    return serve(args.socket, preload)


if __name__ == "__main__":
    zygote.exit_now(main())
