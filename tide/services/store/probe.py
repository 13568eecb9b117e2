"""Is the store there? A background probe that answers in bounded time.

A service cannot learn that its database went away from its own writes alone:
a quiet scaler writes nothing for minutes, and a write that fails says nothing
about when the store is back. The probe runs ``SELECT 1`` every
:data:`PROBE_INTERVAL_S` on its own connection from the pool (in a thread: the
driver blocks), bounded by :data:`PROBE_TIMEOUT_S`, and tells its listeners
when the answer changes: health goes NOT_SERVING within about a second of an
outage and back within about a second of the store's return.

``SELECT 1`` still answers from a SQLite file whose disk is full or mounted
read-only, while every write fails. So for SQLite the probe also looks at the
file system that holds the database (``statvfs``): read-only, or less than
``min_free_bytes`` free, counts as down too, and space coming back counts as
up, with no restart. The reserve is what a few decisions and a rollup flush
need (the journal included), so the scaler stops before a write half-fails.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from sqlalchemy import Engine, text

from tide.base.cpuwait import thread_cpu_wait_s

from . import metrics as store_metrics

logger = logging.getLogger(__name__)

#: Seconds between probes: one cheap query; half a second keeps detection
#: (interval + timeout) inside the 2 s the reliability catalog asks for.
PROBE_INTERVAL_S = 0.5
#: Seconds a probe may take before the store counts as down. A partitioned
#: connection hangs rather than failing; PostgreSQL's connect_timeout cannot go
#: below 1 s, so this bound, not the driver's, is what the probe waits.
PROBE_TIMEOUT_S = 1.0
#: A probe whose thread was runnable but waited for a CPU (the machine had more runnable
#: work than cores) has that wait added to its timeout, up to this many timeouts in
#: all: the store did not fail to answer, the process did not get to ask. On 2 shared
#: cores at load average 15-25, `tide up`'s SQLite store "had no answer within 1.0 s"
#: about once a run, readiness went off and the scaler stopped evaluating (issue 32).
#: A partitioned connection's thread sleeps on its socket (no run-queue time): still
#: down after PROBE_TIMEOUT_S.
STARVED_TIMEOUT_FACTOR = 3.0
#: Bytes that must stay free beside a SQLite database for it to count as up: a
#: decision's few rows plus its WAL frames are kilobytes; 8 MiB also covers a
#: rollup flush and a WAL checkpoint, so the store is down before a write fails.
MIN_FREE_BYTES = 8 * 1024 * 1024


class StoreDown(Exception):
    """The probe's own finding (the disk, not the driver); ``cause`` is its metric label."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


def sqlite_directory(engine: Engine) -> Path | None:
    """The directory of the engine's SQLite file; None for other stores and ``:memory:``."""
    database = engine.url.database
    if engine.dialect.name != "sqlite" or not database or database == ":memory:":
        return None
    return Path(database).resolve().parent


def check_writable(directory: Path, min_free_bytes: int) -> None:
    """Raise :class:`StoreDown` when ``directory``'s file system is read-only or short of space."""
    st = os.statvfs(directory)
    if st.f_flag & os.ST_RDONLY:
        raise StoreDown("read_only", f"the file system of {directory} is read-only")
    free = st.f_bavail * st.f_frsize
    if free < min_free_bytes:
        raise StoreDown(
            "disk_full",
            f"{free} bytes free on the file system of {directory}, below {min_free_bytes}",
        )


Listener = Callable[[bool, str], Awaitable[None]]


class StoreProbe:
    """The store's reachability, probed in the background; starts optimistic
    (the service has just migrated the schema, so the store answered)."""

    def __init__(
        self,
        engine: Engine,
        *,
        interval_s: float = PROBE_INTERVAL_S,
        timeout_s: float = PROBE_TIMEOUT_S,
        min_free_bytes: int = MIN_FREE_BYTES,
    ) -> None:
        self._engine = engine
        self._directory = sqlite_directory(engine)
        self.min_free_bytes = min_free_bytes
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._up = asyncio.Event()
        self._up.set()
        self._listeners: list[Listener] = []
        self._pending: asyncio.Future[None] | None = None
        # The pending ping's thread and its run-queue time when it began.
        self._ping_thread: int | None = None
        self._ping_cpu_wait_s = 0.0

    @property
    def ok(self) -> bool:
        return self._up.is_set()

    def listen(self, fn: Listener) -> None:
        """``fn(ok, why)`` runs on every change (not on every probe)."""
        self._listeners.append(fn)

    async def wait_up(self) -> None:
        """Return when the store answers (at once if it does now)."""
        await self._up.wait()

    def _ping(self) -> None:
        self._ping_thread = threading.get_native_id()
        self._ping_cpu_wait_s = thread_cpu_wait_s(self._ping_thread)
        with self._engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        if self._directory is not None:
            check_writable(self._directory, self.min_free_bytes)

    async def probe_once(self) -> bool:
        """Probe now; returns whether the store answered within the timeout."""
        if self._pending is None or self._pending.done():
            # A hung probe thread is left to finish on its own (it cannot be
            # cancelled); until then no second one piles up behind it.
            self._ping_thread = None
            self._pending = asyncio.ensure_future(asyncio.to_thread(self._ping))
        try:
            await self._answer()
        except TimeoutError:
            await self._set(False, f"no answer within {self.timeout_s:.1f} s", "timeout")
            return False
        except StoreDown as down:
            await self._set(False, str(down), down.cause)
            return False
        except Exception as exc:  # the driver's error, whatever it is: the store is down
            first = str(getattr(exc, "orig", exc)).splitlines()[0] if str(exc) else ""
            await self._set(False, f"{type(exc).__name__}: {first}", "unreachable")
            return False
        await self._set(True, "", "")
        return True

    async def _answer(self) -> None:
        """The pending ping's end; TimeoutError once it has had ``timeout_s`` of wall
        time beyond what its thread spent waiting for a CPU (STARVED_TIMEOUT_FACTOR)."""
        assert self._pending is not None
        start, budget = time.monotonic(), self.timeout_s
        while True:
            try:
                await asyncio.wait_for(
                    asyncio.shield(self._pending), max(0.0, start + budget - time.monotonic())
                )
                return
            except TimeoutError:
                tid = self._ping_thread
                starved = thread_cpu_wait_s(tid) - self._ping_cpu_wait_s if tid else 0.0
                longer = min(self.timeout_s + starved, self.timeout_s * STARVED_TIMEOUT_FACTOR)
                if longer <= budget:
                    raise
                budget = longer

    async def run(self) -> None:
        """Probe until cancelled."""
        while True:
            await self.probe_once()
            await asyncio.sleep(self.interval_s)

    async def _set(self, ok: bool, why: str, cause: str) -> None:
        if ok == self.ok:
            return
        store_metrics.UP.set(1 if ok else 0)
        if ok:
            self._up.set()
            logger.warning("store is back")
        else:
            self._up.clear()
            store_metrics.OUTAGES.labels(cause).inc()
            logger.error("store unavailable: %s", why, extra={"cause": cause})
        for fn in self._listeners:
            await fn(ok, why)
