"""The worker's end of the control socket to its launcher: typed messages over a unix socket.

The launcher listens (tide/trainer/launcher/control.py); the worker connects at start (path in
``TIDE_CONTROL_SOCKET``). What travels is in :mod:`tide.trainer.messages`. The worker reads on a
background thread and its training loop polls at step boundaries, so a directive never
interrupts a collective.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from typing import Protocol

from tide.trainer.messages import MessageError, ToLauncher, ToWorker, decode_to_worker, encode

logger = logging.getLogger(__name__)

CONTROL_SOCKET_ENV = "TIDE_CONTROL_SOCKET"


class WorkerChannel(Protocol):
    """The worker's end of the channel (a test double lives in tests/trainer)."""

    def send(self, message: ToLauncher) -> None: ...

    def poll(self) -> ToWorker | None:
        """The next message if one has arrived, else None; never blocks."""
        ...

    def wait(self, timeout_s: float) -> ToWorker | None:
        """The next message, waiting up to timeout_s; None on timeout."""
        ...

    @property
    def closed(self) -> bool:
        """True once the launcher's end went away (the worker should exit)."""
        ...


class NullChannel:
    """No launcher: a standalone run that nobody steers."""

    def send(self, message: ToLauncher) -> None:
        pass

    def poll(self) -> ToWorker | None:
        return None

    def wait(self, timeout_s: float) -> ToWorker | None:
        return None

    @property
    def closed(self) -> bool:
        return False


class SocketChannel:
    """The worker's end over a unix socket; a reader thread fills an inbox queue."""

    def __init__(self, path: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        self._send_lock = threading.Lock()
        self._inbox: queue.Queue[ToWorker] = queue.Queue()
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
                    if not line.strip():
                        continue
                    try:
                        self._inbox.put(decode_to_worker(line))
                    except MessageError as exc:
                        # One line this worker does not understand is not worth its job.
                        logger.warning("control channel: ignoring a line: %s", exc)
        except OSError as exc:
            logger.warning("control channel read failed: %s", exc)
        finally:
            self._closed.set()

    def send(self, message: ToLauncher) -> None:
        data = encode(message)
        with self._send_lock:
            try:
                self._sock.sendall(data)
            except OSError as exc:
                logger.warning("control channel send of %s failed: %s", message.TYPE, exc)
                self._closed.set()

    def poll(self) -> ToWorker | None:
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def wait(self, timeout_s: float) -> ToWorker | None:
        try:
            return self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None

    @property
    def closed(self) -> bool:
        return self._closed.is_set() and self._inbox.empty()
