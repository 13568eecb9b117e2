"""A clock that only moves when told, for component tests with no sleeps."""

from __future__ import annotations

import asyncio


class FakeClock:
    """A clock that only moves when told. ``sleep`` waits until ``advance`` passes the wake time."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self._now = start
        self._mono = 1000.0
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def now(self) -> float:
        return self._now

    def monotonic(self) -> float:
        return self._mono

    def sleeping(self) -> int:
        """How many sleeps wait on this clock: a test advances once the loop it drives sleeps
        again, else the advance would pass while the loop is still busy and never wake it."""
        return sum(1 for _, fut in self._sleepers if not fut.done())

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"cannot move a clock backwards by {seconds}")
        self._now += seconds
        self._mono += seconds
        due = [s for s in self._sleepers if s[0] <= self._mono]
        self._sleepers = [s for s in self._sleepers if s[0] > self._mono]
        for _, fut in due:
            if not fut.done():
                fut.set_result(None)

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sleepers.append((self._mono + seconds, fut))
        await fut
