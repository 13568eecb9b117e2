"""The bounds of a refused stream's drain (tide/services/common/refused_streams.py): it
ends at the client's half-close, after MAX_MESSAGES, or after LIMIT_S, and past
MAX_CONCURRENT drains at once a refusal waits for nothing."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from tide.services.common import refused_streams

pytestmark = pytest.mark.unit


class _Client:
    """A refused stream's context: ``sends`` messages, then half-closes (None: never)."""

    def __init__(self, sends: int | None, *, silent: bool = False) -> None:
        self.sends = sends
        self.silent = silent
        self.reads = 0

    async def read(self) -> Any:
        if self.silent:
            await asyncio.Event().wait()  # sends nothing and never half-closes
        self.reads += 1
        if self.sends is not None and self.reads > self.sends:
            return grpc.aio.EOF
        return b"report"


async def test_a_drain_ends_at_the_half_close() -> None:
    client = _Client(3)
    await refused_streams.drain(client)
    assert client.reads == 4


async def test_a_client_that_keeps_writing_is_read_at_most_max_messages() -> None:
    client = _Client(None)
    async with asyncio.timeout(refused_streams.LIMIT_S / 2):
        await refused_streams.drain(client)
    assert client.reads == refused_streams.MAX_MESSAGES


async def test_a_silent_client_is_refused_after_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(refused_streams, "LIMIT_S", 0.05)
    await asyncio.wait_for(refused_streams.drain(_Client(None, silent=True)), 5)


async def test_past_max_concurrent_drains_a_refusal_waits_for_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Silent callers with no credentials would each hold a stream slot for the limit:
    # past the cap, the next is refused at once and reads nothing.
    monkeypatch.setattr(refused_streams, "LIMIT_S", 60.0)
    holders = [
        asyncio.create_task(refused_streams.drain(_Client(None, silent=True)))
        for _ in range(refused_streams.MAX_CONCURRENT)
    ]
    await asyncio.sleep(0)
    late = _Client(None)
    await asyncio.wait_for(refused_streams.drain(late), 1)
    assert late.reads == 0
    for t in holders:
        t.cancel()
    await asyncio.gather(*holders, return_exceptions=True)
    # The slots are given back: the next refused stream is drained again.
    after = _Client(2)
    await refused_streams.drain(after)
    assert after.reads == 3
