"""The local channel between a launcher and its worker: JSON lines over a unix socket.

The launcher listens; the worker connects at start (path in ``TIDE_CONTROL_SOCKET``). Messages are
small dicts with a ``type``. The worker reads on a background thread and its training loop polls
at step boundaries, so a directive never interrupts a collective.

Launcher → worker: ``checkpoint`` (directive_id, step), ``hold`` (directive_id), ``resume``
(directive_id), ``exit``.

Worker → launcher: ``hello`` (pid), ``ready`` (restored_step, timings), ``progress`` (step,
epoch, cursor, samples_per_s, first_step_at), ``held`` (step, held_at, directive_ids,
checkpoint), ``resumed``, ``checkpoint`` (a periodic one: step, digest), ``done``.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
from typing import Any, Protocol

logger = logging.getLogger(__name__)

Message = dict[str, Any]
CONTROL_SOCKET_ENV = "TIDE_CONTROL_SOCKET"


class WorkerChannel(Protocol):
    """The worker's end of the channel."""

    def send(self, message: Message) -> None: ...

    def poll(self) -> Message | None:
        """The next message if one has arrived, else None; never blocks."""
        ...

    def wait(self, timeout_s: float) -> Message | None:
        """The next message, waiting up to timeout_s; None on timeout."""
        ...

    @property
    def closed(self) -> bool:
        """True once the launcher's end went away (the worker should exit)."""
        ...


class NullChannel:
    """No launcher: a standalone run that nobody steers."""

    def send(self, message: Message) -> None:
        pass

    def poll(self) -> Message | None:
        return None

    def wait(self, timeout_s: float) -> Message | None:
        return None

    @property
    def closed(self) -> bool:
        return False


class QueueChannel:
    """In-memory channel for tests: ``inbox`` feeds the worker, ``outbox`` collects what it sent."""

    def __init__(self) -> None:
        self.inbox: queue.Queue[Message] = queue.Queue()
        self.outbox: queue.Queue[Message] = queue.Queue()
        self._closed = False

    def close(self) -> None:
        self._closed = True

    def send(self, message: Message) -> None:
        self.outbox.put(message)

    def poll(self) -> Message | None:
        try:
            return self.inbox.get_nowait()
        except queue.Empty:
            return None

    def wait(self, timeout_s: float) -> Message | None:
        try:
            return self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None

    @property
    def closed(self) -> bool:
        return self._closed and self.inbox.empty()


class SocketChannel:
    """The worker's end over a unix socket; a reader thread fills an inbox queue."""

    def __init__(self, path: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        self._send_lock = threading.Lock()
        self._inbox: queue.Queue[Message] = queue.Queue()
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, name="tide-channel", daemon=True)
        self._reader.start()

    def _read_loop(self) -> None:
        buf = b""
        try:
            while True:
                chunk = self._sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        self._inbox.put(json.loads(line))
        except (OSError, ValueError) as exc:
            logger.warning("control channel read failed: %s", exc)
        finally:
            self._closed.set()

    def send(self, message: Message) -> None:
        data = (json.dumps(message) + "\n").encode()
        with self._send_lock:
            try:
                self._sock.sendall(data)
            except OSError as exc:
                logger.warning("control channel send of %s failed: %s", message.get("type"), exc)
                self._closed.set()

    def poll(self) -> Message | None:
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def wait(self, timeout_s: float) -> Message | None:
        try:
            return self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None

    @property
    def closed(self) -> bool:
        return self._closed.is_set() and self._inbox.empty()
