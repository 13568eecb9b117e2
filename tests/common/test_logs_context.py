"""A streaming RPC's log context closed in another task (the loop's async-generator
finalizer, after its caller dropped the stream) raises nothing (issue 32: "Task
exception was never retrieved ... created in a different Context")."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from tide.base import logs

pytestmark = pytest.mark.unit


async def test_a_bound_block_closed_in_another_task_is_quiet() -> None:
    async def stream() -> AsyncIterator[int]:
        with logs.bound(job_id="ml/a"):
            yield 1
            yield 2

    gen = stream()
    assert await asyncio.create_task(anext(gen)) == 1  # entered in one task's context
    await asyncio.create_task(gen.aclose())  # closed in another's, as the finalizer does
