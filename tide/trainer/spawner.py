"""How the launcher starts worker processes: forked from a warm zygote, or as plain subprocesses.

Both implement :class:`Spawner`; the launcher does not care which. The zygote path hides the
~2 s Paddle import from every restart; the subprocess path runs any command (not only Python
scripts) and is the fallback when the zygote cannot be used.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tide.base.errors import Unavailable
from tide.trainer.zygote import is_python_command

logger = logging.getLogger(__name__)


class WorkerHandle(Protocol):
    @property
    def pid(self) -> int: ...

    async def wait(self) -> int:
        """Exit code; negative: killed by that signal."""
        ...

    @property
    def returncode(self) -> int | None: ...

    def kill(self, sig: int = signal.SIGKILL) -> None: ...


class Spawner(Protocol):
    async def start(self) -> None: ...

    async def wait_ready(self) -> float:
        """Until a spawn would be fast; returns the warm-up time, seconds."""
        ...

    async def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str, log_path: str
    ) -> WorkerHandle: ...

    async def close(self) -> None: ...


class ZygoteExited(Unavailable):
    """The zygote process ended; a new one can be started."""


class _ZygoteChild:
    def __init__(self, pid: int) -> None:
        self._pid = pid
        self._done: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def returncode(self) -> int | None:
        return self._done.result() if self._done.done() else None

    def _exited(self, code: int) -> None:
        if not self._done.done():
            self._done.set_result(code)

    async def wait(self) -> int:
        return await asyncio.shield(self._done)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self._done.done():
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._pid, sig)


class ZygoteSpawner:
    """Forks workers from ``python -m tide.trainer.zygote``, which imported Paddle once."""

    def __init__(self, preload: str | None = None, python: str = sys.executable) -> None:
        self._preload = preload
        self._python = python
        self._proc: asyncio.subprocess.Process | None = None
        self._ready: asyncio.Future[float] | None = None
        self._pending: dict[int, asyncio.Future[int]] = {}
        self._children: dict[int, _ZygoteChild] = {}
        self._early_exits: dict[int, int] = {}
        self._next_id = 0
        self._reader: asyncio.Task[None] | None = None
        self._start_lock = asyncio.Lock()
        self.import_s = 0.0

    @property
    def pid(self) -> int | None:
        """The zygote's pid while it runs."""
        return self._proc.pid if self._proc is not None and self._reader_alive() else None

    def _reader_alive(self) -> bool:
        return self._reader is not None and not self._reader.done()

    async def start(self) -> None:
        # One restart even when a standby spawn and a rendezvous spawn find the zygote dead.
        async with self._start_lock:
            await self._start()

    async def _start(self) -> None:
        if self._proc is not None and self._reader_alive():
            return
        if self._proc is not None:
            # The zygote died (killed, OOM): its children went with it and were reported as
            # exited. Start a new one: a spawn pays the import once instead of failing.
            code = await self._proc.wait()
            logger.warning("zygote pid %d exited with %d; starting a new one", self._proc.pid, code)
            self._proc = None
            self._pending.clear()
            self._early_exits.clear()
        args = [self._python, "-m", "tide.trainer.zygote"]
        if self._preload is not None:
            args += ["--preload", self._preload]
        self._proc = await asyncio.create_subprocess_exec(
            *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        self._ready = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read_events(), name="zygote-events")

    async def _read_events(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        try:
            while line := await self._proc.stdout.readline():
                event: dict[str, Any] = json.loads(line)
                kind = event.get("event")
                if kind == "ready" and self._ready is not None and not self._ready.done():
                    self._ready.set_result(float(event.get("import_s", 0.0)))
                elif kind == "spawned":
                    fut = self._pending.pop(int(event["id"]), None)
                    if fut is not None and not fut.done():
                        fut.set_result(int(event["pid"]))
                elif kind == "exit":
                    pid, code = int(event["pid"]), int(event["code"])
                    child = self._children.pop(pid, None)
                    if child is not None:
                        child._exited(code)
                    else:
                        self._early_exits[pid] = code
                elif kind == "error":
                    fut = self._pending.pop(int(event.get("id") or -1), None)
                    if fut is not None and not fut.done():
                        fut.set_exception(Unavailable(f"zygote: {event.get('message')}"))
        finally:
            # The zygote is gone: its workers died with it (PDEATHSIG).
            err = ZygoteExited("the zygote process exited")
            if self._ready is not None and not self._ready.done():
                self._ready.set_exception(err)
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(err)
            for child in self._children.values():
                child._exited(-signal.SIGKILL)
            self._children.clear()

    async def wait_ready(self) -> float:
        await self.start()
        assert self._ready is not None
        self.import_s = await self._ready
        return self.import_s

    async def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str, log_path: str
    ) -> WorkerHandle:
        if not is_python_command(argv):
            raise Unavailable(f"the zygote runs python scripts only, not {list(argv)!r}")
        try:
            return await self._spawn_once(argv, env, cwd, log_path)
        except (ZygoteExited, BrokenPipeError, ConnectionResetError) as exc:
            # It died under us (or just before, unnoticed): once more, on a new zygote. A
            # zygote that cannot even start fails the second time too, and that is final.
            logger.warning("zygote gone while spawning (%s); retrying on a new one", exc)
            if self._reader is not None:
                await self._reader
            return await self._spawn_once(argv, env, cwd, log_path)

    async def _spawn_once(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str, log_path: str
    ) -> WorkerHandle:
        await self.wait_ready()
        assert self._proc is not None and self._proc.stdin is not None
        self._next_id += 1
        req_id = self._next_id
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        request = {
            "cmd": "spawn",
            "id": req_id,
            "argv": list(argv),
            "env": dict(env),
            "cwd": cwd,
            "log": log_path or None,
        }
        self._proc.stdin.write((json.dumps(request) + "\n").encode())
        await self._proc.stdin.drain()
        pid = await fut
        child = _ZygoteChild(pid)
        if pid in self._early_exits:
            child._exited(self._early_exits.pop(pid))
        else:
            self._children[pid] = child
        return child

    async def close(self) -> None:
        if self._proc is None:
            return
        for child in list(self._children.values()):
            child.kill()
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            async with asyncio.timeout(5.0):
                await self._proc.wait()
        except TimeoutError:
            self._proc.kill()
            await self._proc.wait()
        if self._reader is not None:
            await self._reader
        self._proc = None


class _SubprocessChild:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._proc = proc

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def wait(self) -> int:
        return await self._proc.wait()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(sig)


class SubprocessSpawner:
    """Fresh processes: pays the Paddle import on every restart (Paddle's own way)."""

    def __init__(self) -> None:
        self._children: list[_SubprocessChild] = []

    async def start(self) -> None:
        pass

    async def wait_ready(self) -> float:
        return 0.0

    async def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str, log_path: str
    ) -> WorkerHandle:
        out: Any = open(log_path, "ab") if log_path else None  # noqa: SIM115, ASYNC230
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, env=dict(env), cwd=cwd, stdout=out, stderr=out
            )
        finally:
            if out is not None:
                out.close()
        child = _SubprocessChild(proc)
        self._children.append(child)
        return child

    async def close(self) -> None:
        for child in self._children:
            child.kill()
            await child.wait()
        self._children.clear()
