"""Time as a dependency. The fake clock tests advance by hand is tide.services.testing.clock."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Wall-clock time, seconds since the epoch (stored and shown to users)."""
        ...

    def monotonic(self) -> float:
        """Monotonic seconds, for durations and deadlines."""
        ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
