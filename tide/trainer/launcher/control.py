"""The launcher's end of the control socket: one unix-socket connection per worker process.

Every worker (the current one and the prewarmed one) connects at start and says
:class:`~tide.trainer.messages.Hello` with its pid; the server keeps one writer per pid. What
the messages mean is the launcher core's business: this module only frames them
(tide/trainer/messages.py) and tells when a worker's connection has been read to its end.

A worker may connect, say Hello and Ready and die before the launcher's loop has accepted
its connection, and the zygote's report of its exit may be read first. The server
therefore accepts connections itself and knows each one's process from the kernel
(``SO_PEERCRED``) at accept, before any line is read: :meth:`ControlServer.drained` first
takes every connection still queued (a dead worker's connect came before its exit), so
"this worker never connected" and "its lines are not read yet" cannot be confused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from tide.trainer.messages import (
    Hello,
    MessageError,
    ToLauncher,
    ToWorker,
    decode_to_launcher,
    encode,
)

logger = logging.getLogger(__name__)


@dataclass
class _Reading:
    """One open connection as :meth:`ControlServer.drained` sees it."""

    ended: asyncio.Event = field(default_factory=asyncio.Event)
    lines: int = 0  # read so far
    handling: bool = False  # a line's handler is running


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
        # By the pid that connected (the kernel's word, known at accept): each open
        # connection, until it is closed and every line it sent has been handled.
        self._open: dict[int, list[_Reading]] = {}
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        listener.listen(100)
        listener.setblocking(False)
        self._listener = listener
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(listener.fileno(), self._accept_queued)

    def close(self) -> None:
        if self._listener is not None and self._loop is not None:
            self._loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
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

    async def drained(self, pid: int, idle_s: float, most_s: float) -> None:
        """Until every line the exited worker ``pid`` sent has been handled. A child of the
        worker (a DataLoader's process) may still hold its end open, so the wait ends once
        ``idle_s`` passes with no line read and none being handled, and after ``most_s``
        in any case."""
        # Its connection, if it made one, is accepted now or still queued: take the queue.
        self._accept_queued()
        readings = list(self._open.get(pid, ()))
        if not readings:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + most_s
        seen = -1
        while True:
            read = sum(r.lines for r in readings)
            if (read == seen and not any(r.handling for r in readings)) or (
                loop.time() >= deadline
            ):
                return
            seen = read
            try:
                async with asyncio.timeout(min(idle_s, max(deadline - loop.time(), 0.0))):
                    for reading in readings:
                        await reading.ended.wait()
                return
            except TimeoutError:
                # On a starved loop this bound can fire in the same turn as the reads that
                # were already due, ahead of them: let them run before judging. (Its 0.5 s,
                # counted whole, once ended a healthy job's member as lost: the worker's Done
                # was still unread under load; docs/reliability.md.)
                for _ in range(3):
                    await asyncio.sleep(0)

    def _accept_queued(self) -> None:
        """Accept every queued connection and note the pid that made it, at once."""
        while self._listener is not None:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # Out of descriptors: the rest stay queued until the loop's next accept.
                logger.warning("control socket: cannot accept: %s", exc)
                return
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            peer = struct.unpack("3i", creds)[0]
            reading = _Reading()
            self._open.setdefault(peer, []).append(reading)
            task = asyncio.create_task(self._serve_socket(conn, peer, reading), name="control-conn")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve_socket(self, conn: socket.socket, peer: int, reading: _Reading) -> None:
        try:
            try:
                reader, writer = await asyncio.open_unix_connection(sock=conn)
            except OSError as exc:
                logger.warning("worker pid %d: control connection failed: %s", peer, exc)
                conn.close()
                return
            await self._serve(reader, writer, reading)
        finally:
            reading.ended.set()
            readings = self._open.get(peer, [])
            if reading in readings:
                readings.remove(reading)
            if not readings:
                self._open.pop(peer, None)

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reading: _Reading
    ) -> None:
        pid = -1
        try:
            while line := await reader.readline():
                reading.lines += 1
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
                    self._on_hello(pid)
                    continue
                if pid >= 0:
                    reading.handling = True
                    try:
                        await self._on_message(pid, msg)
                    finally:
                        reading.handling = False
        except ConnectionResetError as exc:
            # A worker that exits (stopped at a resize, killed after its grace) resets
            # its end: expected. A crash is reported by the worker's exit status.
            logger.debug("worker pid %d: control connection reset: %s", pid, exc)
        except ConnectionError as exc:
            logger.warning("worker pid %d: control connection error: %s", pid, exc)
        finally:
            if self._conns.get(pid) is writer:
                del self._conns[pid]
            writer.close()
