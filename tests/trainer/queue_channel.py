"""An in-memory :class:`tide.trainer.channel.WorkerChannel` for session tests.

``inbox`` feeds the worker what a launcher would send; ``outbox`` collects what it sent.
"""

from __future__ import annotations

import queue

from tide.trainer.messages import ToLauncher, ToWorker


class QueueChannel:
    def __init__(self) -> None:
        self.inbox: queue.Queue[ToWorker] = queue.Queue()
        self.outbox: queue.Queue[ToLauncher] = queue.Queue()
        self._closed = False

    def close(self) -> None:
        self._closed = True

    def send(self, message: ToLauncher) -> None:
        self.outbox.put(message)

    def poll(self) -> ToWorker | None:
        try:
            return self.inbox.get_nowait()
        except queue.Empty:
            return None

    def wait(self, timeout_s: float) -> ToWorker | None:
        try:
            return self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None

    @property
    def closed(self) -> bool:
        return self._closed and self.inbox.empty()
