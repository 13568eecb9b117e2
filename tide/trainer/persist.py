"""Durable checkpoints off the training loop's critical path.

The state is serialised at the step boundary, on the training thread (a consistent
snapshot, and Paddle is not asked to work from two threads); writing it (files, fsyncs,
sha256, the manifest, the rename) happens on one background thread, into the durable
store: a local directory or a PVC (:class:`~tide.trainer.checkpoint.CheckpointStore`), or object
storage (:class:`~tide.trainer.objstore.ObjectStore`). The training thread collects what has
been written at its next step boundary (:meth:`DurableWriter.poll`) and reports it then.

One write at a time; a snapshot that arrives while one is being written waits, and a newer
one replaces a waiting one (the newest state is what a crash recovery wants).

The writing thread runs at the lowest CPU priority (nice 19, for that thread only): a durable
write of a large state (sha256 and the copy into the page cache cost about 1 ms per MB here)
must not take the CPU from the barrier or the training beside it; a write that falls behind
is reported (its lag: from the snapshot to the commit), never waited for by the training.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from tide.trainer.checkpoint import LoadedCheckpoint, WrittenCheckpoint

logger = logging.getLogger(__name__)


class DurableStore(Protocol):
    def write(
        self, step: int, files: Mapping[str, bytes], meta: Mapping[str, Any]
    ) -> WrittenCheckpoint: ...

    def list_steps(self) -> list[int]: ...

    def load_latest(self, at_most: int | None = None) -> LoadedCheckpoint: ...

    def cleanup_tmp(self) -> int: ...


# The writing thread's niceness (Linux applies it to the one thread).
WRITER_NICE = 19


@dataclass(frozen=True)
class Snapshot:
    step: int
    files: Mapping[str, bytes]
    meta: Mapping[str, Any]
    periodic: bool
    taken_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Written:
    snapshot: Snapshot
    checkpoint: WrittenCheckpoint | None
    error: str = ""
    # From the snapshot to the commit, seconds: how far the durable store lags the state.
    lag_s: float = 0.0


class DurableWriter:
    def __init__(self, store: DurableStore) -> None:
        self.store = store
        self._lock = threading.Condition()
        self._waiting: Snapshot | None = None
        self._busy = False
        self._done: list[Written] = []
        self._thread: threading.Thread | None = None

    def submit(self, snapshot: Snapshot) -> None:
        with self._lock:
            if self._waiting is not None:
                logger.info(
                    "durable checkpoint of step %d superseded by step %d before its write",
                    self._waiting.step,
                    snapshot.step,
                )
            self._waiting = snapshot
            if self._thread is None or not self._thread.is_alive():
                # A daemon: a worker that is killed does not wait for it (the store's
                # commit protocol makes a torn write invisible).
                self._thread = threading.Thread(target=self._run, name="durable", daemon=True)
                self._thread.start()
            self._lock.notify_all()

    def _run(self) -> None:
        niced = False
        while True:
            with self._lock:
                if self._waiting is None:
                    self._thread = None
                    self._lock.notify_all()
                    return
                snap, self._waiting, self._busy = self._waiting, None, True
            if not niced:
                # Once the snapshot is taken: at nice 19 from its start, the thread could
                # leave it waiting long enough on a busy machine for the next to replace it.
                niced = True
                try:
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
                except OSError:
                    logger.info("durable writer: cannot lower its priority", exc_info=True)
            try:
                checkpoint = self.store.write(snap.step, snap.files, snap.meta)
                written = Written(snap, checkpoint, lag_s=time.monotonic() - snap.taken_at)
                logger.info(
                    "durable checkpoint of step %d committed %.3fs after its snapshot",
                    snap.step,
                    written.lag_s,
                )
            except Exception as exc:
                logger.exception("durable checkpoint of step %d failed", snap.step)
                written = Written(snap, None, f"{type(exc).__name__}: {exc}")
            with self._lock:
                self._busy = False
                self._done.append(written)
                self._lock.notify_all()

    def poll(self) -> list[Written]:
        """What was written (or failed) since the last poll."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def idle(self) -> bool:
        with self._lock:
            return self._waiting is None and not self._busy

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until nothing is waiting or being written; False if ``timeout_s`` passed first."""
        with self._lock:
            return self._lock.wait_for(
                lambda: self._waiting is None and not self._busy, timeout=timeout_s
            )
