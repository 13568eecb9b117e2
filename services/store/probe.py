"""Is the store there? A background probe that answers in bounded time.

A service cannot learn that its database went away from its own writes alone:
a quiet scaler writes nothing for minutes, and a write that fails says nothing
about when the store is back. The probe runs ``SELECT 1`` every
:data:`PROBE_INTERVAL_S` on its own connection from the pool (in a thread: the
driver blocks), bounded by :data:`PROBE_TIMEOUT_S`, and tells its listeners
when the answer changes: health goes NOT_SERVING within about a second of an
outage and back within about a second of the store's return.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from sqlalchemy import Engine, text

logger = logging.getLogger(__name__)

#: Seconds between probes: one cheap query; half a second keeps detection
#: (interval + timeout) inside the 2 s the reliability catalog asks for.
PROBE_INTERVAL_S = 0.5
#: Seconds a probe may take before the store counts as down. A partitioned
#: connection hangs rather than failing; PostgreSQL's connect_timeout cannot go
#: below 1 s, so this bound, not the driver's, is what the probe waits.
PROBE_TIMEOUT_S = 1.0

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
    ) -> None:
        self._engine = engine
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._up = asyncio.Event()
        self._up.set()
        self._listeners: list[Listener] = []
        self._pending: asyncio.Future[None] | None = None

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
        with self._engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    async def probe_once(self) -> bool:
        """Probe now; returns whether the store answered within the timeout."""
        if self._pending is None or self._pending.done():
            # A hung probe thread is left to finish on its own (it cannot be
            # cancelled); until then no second one piles up behind it.
            self._pending = asyncio.ensure_future(asyncio.to_thread(self._ping))
        try:
            await asyncio.wait_for(asyncio.shield(self._pending), self.timeout_s)
        except TimeoutError:
            await self._set(False, f"no answer within {self.timeout_s:.1f} s")
            return False
        except Exception as exc:  # the driver's error, whatever it is: the store is down
            first = str(getattr(exc, "orig", exc)).splitlines()[0] if str(exc) else ""
            await self._set(False, f"{type(exc).__name__}: {first}")
            return False
        await self._set(True, "")
        return True

    async def run(self) -> None:
        """Probe until cancelled."""
        while True:
            await self.probe_once()
            await asyncio.sleep(self.interval_s)

    async def _set(self, ok: bool, why: str) -> None:
        if ok == self.ok:
            return
        if ok:
            self._up.set()
            logger.warning("store is back")
        else:
            self._up.clear()
            logger.error("store unavailable: %s", why)
        for fn in self._listeners:
            await fn(ok, why)
