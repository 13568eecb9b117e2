"""Polling instead of sleeping: the one pair of helpers every tier uses."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    condition: Callable[[], T | None],
    timeout_s: float = 10.0,
    interval_s: float = 0.02,
    what: str = "",
) -> T:
    """Poll ``condition`` until it returns something truthy and return that; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or condition}")
        time.sleep(interval_s)


async def eventually(
    condition: Callable[[], T | None],
    timeout_s: float = 10.0,
    interval_s: float = 0.01,
    what: str = "",
) -> T:
    """``wait_for`` on the event loop: the loop keeps running the code under test between polls."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or condition}")
        await asyncio.sleep(interval_s)


async def eventually_rpc(
    condition: Callable[[], Awaitable[T | None]],
    timeout_s: float = 10.0,
    interval_s: float = 0.05,
    what: str = "",
) -> T:
    """``eventually`` for a condition that awaits (an RPC to a process under test)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or condition}")
        await asyncio.sleep(interval_s)
