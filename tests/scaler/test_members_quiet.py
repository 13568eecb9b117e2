"""A healthy run is quiet (issue 32): the member watch of a job the coordinator does
not know yet (no launcher registered) retries without a WARNING; a real break still
warns."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest

from tests.support.poll import eventually
from tide.base.errors import NotFound, Unavailable
from tide.services.scaler.members import CoordinatorMemberRegistry

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("error", "warns"), [(NotFound, False), (Unavailable, True)])
async def test_an_unknown_job_is_watched_again_quietly(
    caplog: pytest.LogCaptureFixture, error: type[Exception], warns: bool
) -> None:
    calls = []

    async def watch(job_id: str) -> AsyncIterator[list[object]]:
        calls.append(job_id)
        raise error(f"job {job_id!r} is not known to the coordinator")
        yield []  # an async generator, as the real watch

    reg = CoordinatorMemberRegistry(watch)  # type: ignore[arg-type]
    with caplog.at_level(logging.DEBUG, logger="tide.services.scaler.members"):
        reg.track("ns/new")
        await eventually(lambda: len(calls) >= 2, 5, what="a second watch")
        await reg.close()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert bool(warnings) is warns
