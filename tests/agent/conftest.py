"""Fixtures of the agent tests: a Telemetry server on port 0 and running agents.

What they are made of lives in tests/agent/support.py, which tests import."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from .support import Agents, RunAgent, Scaler, start_scaler

#: How long the tasks a test leaves behind may take to end once its fixtures are done.
SETTLE_TIMEOUT_S = 10.0


@pytest.fixture(autouse=True)
async def _grpc_settled() -> AsyncIterator[None]:
    """Holds the test's event loop open until every task on it has ended.

    grpc.aio's ``Server.stop`` returns before the tasks of the RPCs it cancelled have
    had the last completions of their calls, and a cancelled call's status task waits
    for one too. Core delivers those later through grpc's one process-wide poller, to
    whichever loop reads its socket: once pytest-asyncio has closed this test's loop,
    that is the next test's, where ``call_soon_threadsafe`` on the closed loop raises
    and asyncio logs "Exception in callback PollerCompletionQueue._handle_events" as
    an ERROR in a test that did nothing wrong. Autouse, so it is set up first and
    torn down last: after every fixture has stopped what it started.

    Only grpc's own tasks are waited for (an RPC's handler runs inside one): other
    tasks await no completion of grpc's, and pytest-asyncio cancels them. A grpc task
    that does not end (a server or call left open) fails the test that left it."""
    yield
    deadline = asyncio.get_running_loop().time() + SETTLE_TIMEOUT_S
    while True:
        # Looked at again after each wait: a finishing RPC task can start another.
        left = {t for t in asyncio.all_tasks() if not t.done() and _is_grpcs(t)}
        if not left:
            return
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            names = sorted(f"{t.get_name()} {t.get_coro()!r}" for t in left)
            raise AssertionError(f"grpc tasks still running after the test's teardown: {names}")
        await asyncio.wait(left, timeout=remaining)


def _is_grpcs(task: asyncio.Task[object]) -> bool:
    # grpc.aio's tasks run coroutines compiled from its Cython sources
    # (src/python/grpcio/grpc/_cython/_cygrpc/aio/server.pyx.pxi, call.pyx.pxi).
    code = getattr(task.get_coro(), "cr_code", None)
    return "grpc/_cython/" in getattr(code, "co_filename", "")


@pytest.fixture
async def scaler() -> AsyncIterator[Scaler]:
    s = await start_scaler()
    yield s
    await s.server.stop(None)


@pytest.fixture
async def run_agent() -> AsyncIterator[RunAgent]:
    agents = Agents()
    yield agents.start
    await agents.stop_all()
