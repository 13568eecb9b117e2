"""The hostile client (tide.services.testing.hostile) against a real scaler and coordinator:
edge values and garbage bytes on every method, every forged shape on every link."""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tide.services.common import refused_streams
from tide.services.testing import hostile
from tide.services.testing.stack import Stack, start_stack

pytestmark = pytest.mark.component


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = await start_stack(tmp_path)
    try:
        yield s
    finally:
        await s.close()


async def test_edge_values_and_garbage_never_end_unknown_or_internal(stack: Stack) -> None:
    tally = await hostile.run_malformed(stack, per_method=6)
    assert tally.tried >= 6 * 17
    assert tally.bad == 0, hostile.summary(tally)
    assert tally.codes["INVALID_ARGUMENT"] > 0
    assert await hostile.servers_alive(stack)


async def test_every_forged_shape_is_refused_and_writes_nothing(
    stack: Stack, tmp_path: Path
) -> None:
    tally = await hostile.run_forged(stack, tmp_path)
    assert tally.tried >= 35
    assert tally.bad == 0, hostile.summary(tally)
    assert await hostile.servers_alive(stack)


async def test_a_refused_stream_ends_with_its_code_while_the_client_still_writes(
    stack: Stack, tmp_path: Path
) -> None:
    # A refusal sent while the client's writes are in flight reached grpcio's asyncio
    # client as INTERNAL "Internal error from Core" (grpc/grpc#36066): up to 1 in 100 of
    # the single-report forged streams, 104 of these 125. Since the guard reads a refused
    # stream to its half-close, the code is the refusal's, every time.
    before = collections.Counter(refused_streams.ENDS)
    tally = await hostile.run_refused_streams(stack, tmp_path, tries=25, messages=8)
    assert tally.tried == 5 * 25
    # How the server's drains ended in this test: CI at 4823684 once read INTERNAL for one
    # refusal in 125 that no run here has reproduced since (1,500 tries under load, every
    # drain ended at the half-close within 26 ms): this says which way it went next time.
    ends = dict(refused_streams.ENDS - before)
    assert tally.bad == 0, f"{hostile.summary(tally)}; the drains ended: {ends}"
    assert sum(ends.values()) == tally.tried, ends
    assert await hostile.servers_alive(stack)


def test_the_strategies_cover_every_field_of_every_request() -> None:
    for service in hostile.SERVICES:
        for method in service.methods:
            msgs = hostile.generate(method.input_type, 30)
            seen = {f.name for m in msgs for f, _ in m.ListFields()}
            wanted = {f.name for f in method.input_type.fields}
            assert seen == wanted, (method.full_name, wanted - seen)
