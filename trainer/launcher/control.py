"""The launcher's end of the control socket: one unix-socket connection per worker process.

Every worker (the current one and the prewarmed one) connects at start and says
:class:`~trainer.messages.Hello` with its pid; the server keeps one writer per pid. What
the messages mean is the launcher core's business: this module only frames them
(trainer/messages.py) and tells when a worker's connection has been read to its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from collections.abc import Awaitable, Callable

from trainer.messages import Hello, MessageError, ToLauncher, ToWorker, decode_to_launcher, encode

logger = logging.getLogger(__name__)


class ControlServer:
    def __init__(
        self,
        accept: Callable[[int], bool],
        on_message: Callable[[int, ToLauncher], Awaitable[None]],
        on_hello: Callable[[int], None],
    ) -> None:
        # accept(pid): whether a worker that says hello is one of ours (else it is dropped);
        # on_hello(pid) runs once its connection is usable; on_message(pid, msg) for the rest.
        self._accept = accept
        self._on_message = on_message
        self._on_hello = on_hello
        self._dir = tempfile.mkdtemp(prefix="tide-ctl-")
        self.path = os.path.join(self._dir, "ctl.sock")
        self._conns: dict[int, asyncio.StreamWriter] = {}
        # Set when a worker's connection is closed and every line it sent has been handled.
        self._closed: dict[int, asyncio.Event] = {}
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            os.rmdir(self._dir)

    def connected(self, pid: int) -> bool:
        return pid in self._conns

    def send(self, pid: int, msg: ToWorker) -> bool:
        """Write ``msg`` to worker ``pid``; False when it is not (or no longer) connected."""
        writer = self._conns.get(pid)
        if writer is None or writer.is_closing():
            return False
        writer.write(encode(msg))
        return True

    async def drained(self, pid: int, timeout_s: float) -> None:
        """Until every line worker ``pid`` sent has been handled (at most ``timeout_s``)."""
        closed = self._closed.get(pid)
        if closed is None:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await closed.wait()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pid = -1
        try:
            while line := await reader.readline():
                try:
                    msg = decode_to_launcher(line)
                except MessageError as exc:
                    logger.warning("worker pid %d: ignoring a control line: %s", pid, exc)
                    continue
                if isinstance(msg, Hello):
                    if not self._accept(msg.pid):
                        logger.warning("control socket: hello from stale pid %d", msg.pid)
                        return
                    pid = msg.pid
                    self._conns[pid] = writer
                    self._closed[pid] = asyncio.Event()
                    self._on_hello(pid)
                    continue
                if pid >= 0:
                    await self._on_message(pid, msg)
        except ConnectionResetError as exc:
            # A worker that exits (stopped at a resize, killed after its grace) resets
            # its end: expected. A crash is reported by the worker's exit status.
            logger.debug("worker pid %d: control connection reset: %s", pid, exc)
        except ConnectionError as exc:
            logger.warning("worker pid %d: control connection error: %s", pid, exc)
        finally:
            if self._conns.get(pid) is writer:
                del self._conns[pid]
            closed = self._closed.pop(pid, None)
            if closed is not None:
                closed.set()
            writer.close()
