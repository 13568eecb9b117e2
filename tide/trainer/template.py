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

    {"kind": "run" | "zygote", "argv": [...], "env": {...}, "cwd": "...", "python": "..."}

answered ``{"refused": "why"}``, or ``{"pid": P}`` with a pidfd of the fork; the caller then
sends a go byte, without which the fork ends unrun (a caller that gave up waiting runs its own
process). ``{"code": C}`` follows when that process ends (C < 0: killed by signal -C). A
zygote's stand-in is the connecting process (``SO_PEERCRED``). Like the zygote, the template never imports gRPC, which does not
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
import shutil
import signal
import socket
import struct
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
_FIXED_AT_IMPORT = (
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    # What the interpreter itself read when it started.
    "PYTHONHASHSEED",
    "PYTHONOPTIMIZE",
    "PYTHONWARNINGS",
    "PYTHONDEVMODE",
    "PYTHONFAULTHANDLER",
    "PYTHONUTF8",
    "PYTHONIOENCODING",
    "PYTHONMALLOC",
    "PYTHONHOME",
    "PYTHONNOUSERSITE",
    "PYTHONSAFEPATH",
)
# How long a caller waits for its answer: the template may still be importing. A caller that
# gives up starts its own process; the template's late fork then waits for a go that never
# comes (_GO, _GO_S) and ends without running anything.
_CONNECT_TIMEOUT_S = 30.0
_GO = b"g"
_GO_S = 10.0
# A request must be read whole within this.
_REQUEST_S = 2.0
# A stand-in's name (/proc/PID/comm, 15 characters at most) before its zygote's pid.
_STAND_IN = "zygote@"


def _fixed_at_import(env: Mapping[str, str]) -> dict[str, str]:
    return {
        k: v
        for k, v in env.items()
        if k.startswith(_FIXED_AT_IMPORT_PREFIXES) or k in _FIXED_AT_IMPORT
    }


def _send(conn: socket.socket, msg: dict[str, Any], fds: Sequence[int] = ()) -> None:
    line = (json.dumps(msg) + "\n").encode()
    with contextlib.suppress(OSError):
        sent = socket.send_fds(conn, [line], list(fds)) if fds else 0
        conn.sendall(line[sent:])


def _read_line(
    conn: socket.socket, deadline: float | None = None
) -> tuple[dict[str, Any], list[int]]:
    """One JSON line and the descriptors that came with it; ``{}`` when the peer closed first.
    ``deadline`` (monotonic) bounds the whole line, not each read."""
    buf, fds = b"", []
    try:
        while not buf.endswith(b"\n"):
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the line did not come in time")
                conn.settimeout(left)
            chunk, more, _, _ = socket.recv_fds(conn, 1 << 16, 4)
            fds += more
            if not chunk:
                raise EOFError
            buf += chunk
        out = json.loads(buf.split(b"\n", 1)[0])
        if not isinstance(out, dict):
            raise ValueError(f"a line must be a JSON object, got {type(out).__name__}")
    except BaseException as exc:
        for fd in fds:
            os.close(fd)
        # Reset: it closed with bytes of ours unread (a go its fork never read, as both died).
        if isinstance(exc, (EOFError, ConnectionResetError)):
            return {}, []
        raise
    return out, fds


def _peer_pid(conn: socket.socket) -> int:
    pid, _, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return int(pid)


def _onto(fds: list[int], targets: Sequence[int]) -> None:
    """The caller's descriptors become this process's ``targets`` (1, 2; or 0, 1, 2)."""
    for fd, target in zip(fds, targets, strict=True):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)


def _checked(req: dict[str, Any]) -> str:
    """Why ``req`` is malformed, or ""."""
    if req.get("kind") not in ("run", "zygote"):
        return f"kind must be run or zygote, got {req.get('kind')!r}"
    argv, env = req.get("argv"), req.get("env")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        return "argv must be a list of strings"
    if req["kind"] == "run" and len(argv) < 2:
        return "a run's argv must name an interpreter and what it runs"
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        return "env must map strings to strings"
    if not isinstance(req.get("cwd"), str) or not isinstance(req.get("python"), str):
        return "cwd and python must be strings"
    return ""


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
        self.python = os.path.abspath(sys.executable)
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
            # One bound for the whole request: a caller that trickles it holds no one else up.
            req, fds = _read_line(conn, time.monotonic() + _REQUEST_S)
            why = _checked(req) or self._refusal(req, fds)
            # A zygote ends with its stand-in, the caller itself (its pid from the kernel).
            watch = os.pidfd_open(_peer_pid(conn)) if not why and req["kind"] == "zygote" else -1
        except Exception as exc:  # whatever a caller sends, the template stays
            why = f"unreadable request: {exc!r}"
            req, watch = {}, -1
        if not why:
            try:
                pid = os.fork()
            except OSError as exc:
                why = f"fork failed: {exc}"
        if why:
            _send(conn, {"refused": why})
            conn.close()
            for fd in [*fds, watch]:
                if fd >= 0:
                    os.close(fd)
            return
        if pid == 0:
            closing = [self.listener.fileno(), *(c.fileno() for c in self.served.values())]
            _child(req, fds, watch, conn, closing, self)
        for fd in [*fds, watch]:
            if fd >= 0:
                os.close(fd)
        self.served[pid] = conn
        child = os.pidfd_open(pid)
        _send(conn, {"pid": pid}, [child])
        os.close(child)

    def _refusal(self, req: dict[str, Any], fds: list[int]) -> str:
        kind = req["kind"]
        wanted = {"run": 2, "zygote": 3}[kind]
        if len(fds) != wanted:
            return f"a {kind} needs {wanted} descriptors, got {len(fds)}"
        if os.path.abspath(req["python"]) != self.python:
            return f"the template runs {self.python}, not {req['python']}"
        # What the caller's own import would have ended with: its values, and where it has
        # none, what the import sets for itself (Paddle sets OMP_NUM_THREADS=1 when unset, and
        # a caller that imported Paddle passes that on).
        theirs = {**self.defaulted, **_fixed_at_import(req["env"])}
        differ = sorted(
            k
            for k in theirs.keys() | self.import_env.keys()
            if theirs.get(k) != self.import_env.get(k)
        )
        if differ:
            return f"Paddle was imported here with other values of {', '.join(differ)}"
        return ""

    def adopt(self, env: Mapping[str, str], first: str | None) -> dict[str, str]:
        """sys.path as the caller's own interpreter would have started it: ``first`` (the
        working directory for ``-m``; a script's directory is put first when it runs), the
        caller's PYTHONPATH, then the interpreter's own entries (the template's, less its own
        first entry and PYTHONPATH). Returns the caller's environment as its own import would
        have left it."""
        ours = set(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))
        rest = [p for p in self.base_path[1:] if p not in ours]
        theirs = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [*([first] if first else []), *theirs, *rest]
        return {**self.defaulted, **env}


def _child(
    req: dict[str, Any],
    fds: list[int],
    watch: int,
    conn: socket.socket,
    closing: list[int],
    tpl: _Template,
) -> NoReturn:
    """The forked child: becomes the caller's run or zygote; never returns."""
    code = 1
    try:
        for fd in closing:
            with contextlib.suppress(OSError):
                os.close(fd)
        zygote.prctl(zygote.PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != tpl.pid:
            os._exit(1)  # the template died before the death signal was set
        # Only once the caller has its answer: one that gave up waiting has started a process
        # of its own, and this one must not run beside it.
        conn.settimeout(_GO_S)
        go = conn.recv(1)
        conn.close()
        if go != _GO:
            os._exit(1)
        cwd, argv = req["cwd"], list(req["argv"])
        if req["kind"] == "run":
            _onto(fds, (1, 2))
            env = tpl.adopt(req["env"], cwd if argv[1:2] == ["-m"] else None)
            zygote.run_child({"argv": argv, "env": env, "cwd": cwd, "log": None}, [], tpl.pid)
        # A zygote: the launcher's pipes become its stdio, the stand-in's end becomes its end.
        _onto(fds, (0, 1, 2))
        env = tpl.adopt(req["env"], cwd)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv = [zygote.__file__, *argv]
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
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


def _python(argv: Sequence[str], env: Mapping[str, str], cwd: str) -> str:
    """The interpreter ``argv`` would run, as a path (its own PATH lookup for a bare name)."""
    if os.sep in argv[0]:
        return os.path.abspath(os.path.join(cwd, argv[0]))
    return shutil.which(argv[0], path=env.get("PATH")) or argv[0]


def _request(
    path: str,
    kind: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    fds: list[int],
    python: str,
) -> tuple[socket.socket, int, int]:
    """Sends one request; the connection, the forked pid and a pidfd of it; or _Refused."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(_CONNECT_TIMEOUT_S)
        conn.connect(path)
        req = {"kind": kind, "argv": list(argv), "env": dict(env), "cwd": cwd, "python": python}
        line = (json.dumps(req) + "\n").encode()
        sent = socket.send_fds(conn, [line], fds)
        conn.sendall(line[sent:])
        # The template answers once it has imported: a caller that came early waits for it.
        answer, got = _read_line(conn, time.monotonic() + _CONNECT_TIMEOUT_S)
        if "pid" in answer and len(got) == 1:
            conn.sendall(_GO)
            conn.settimeout(None)
            return conn, int(answer["pid"]), got[0]
        for fd in got:
            os.close(fd)
        why = str(answer.get("refused") or "the template did not answer")
    except (OSError, ValueError) as exc:
        why = f"no template at {path} ({exc})"
    conn.close()
    raise _Refused(why)


class Run:
    """A script forked from the template: the part of ``subprocess.Popen`` callers use."""

    def __init__(self, argv: Sequence[str], conn: socket.socket, pid: int, pidfd: int) -> None:
        self.args = list(argv)
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn
        # Signals go through the pidfd: the template reaps at once, and a pid can be reused.
        self._pidfd = pidfd

    def poll(self) -> int | None:
        if self.returncode is None:
            self._conn.setblocking(False)
            try:
                answer, _ = _read_line(self._conn)
            except BlockingIOError:
                self._conn.setblocking(True)
                return None
            self._ended(answer)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if timeout is not None and timeout <= 0:
                if self.poll() is None:
                    raise subprocess.TimeoutExpired(self.args, timeout)
            else:
                try:
                    answer, _ = _read_line(
                        self._conn, None if timeout is None else time.monotonic() + timeout
                    )
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
        os.close(self._pidfd)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

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
            python = _python(argv, env, cwd)
            return Run(argv, *_request(path, "run", argv, env, cwd, [out, err], python))
    return subprocess.Popen(list(argv), env=dict(env), cwd=cwd, stdout=out, stderr=err)


def stand_in(path: str, argv: Sequence[str]) -> int | None:
    """Run in the process a launcher started as its zygote: has the template fork the zygote
    on this process's stdin, stdout and stderr, then waits for it and returns its code. None
    when there is no template or it refuses (the reason on stderr): import Paddle here."""
    try:
        conn, pid, pidfd = _request(
            path, "zygote", argv, os.environ, os.getcwd(), [0, 1, 2], sys.executable
        )
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
    try:
        answer, _ = _read_line(conn)
    except (OSError, ValueError):
        answer = {}
    code = int(answer.get("code", -signal.SIGKILL))
    if code < 0:
        # Killed by a signal: end the same way, so the launcher reads what a zygote's death
        # reads as (a signal), not an exit status.
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's own cannot be set
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


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
    preload = zygote.preload_modules(args.preload, "template")
    return 2 if preload is None else serve(args.socket, preload)


if __name__ == "__main__":
    zygote.exit_now(main())
