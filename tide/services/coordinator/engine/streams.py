"""The streams a member or the scaler holds open: each waits on its job's change
notifier (never polls) and yields what changed since it last looked.

What a stream reads of the engine it reads on the engine's thread (Coordinator.call):
a reload after a failed commit reads the store, and the state changes only there.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from tide.services.coordinator.domain import Directive
from tide.services.coordinator.engine.coordinator import Coordinator
from tide.services.coordinator.engine.job import JobRuntime
from tide.services.coordinator.engine.messages import JobView, ResizeInput, ResizeView

#: WatchJob sends progress (steps, throughput) at most this often, seconds.
WATCH_PROGRESS_INTERVAL_S = 1.0


async def directives(c: Coordinator, member_id: str) -> AsyncIterator[Directive]:
    """The member's unacknowledged directives, each once per stream, in order; ends when
    a newer stream of the member opens, the member leaves, or its job is reloaded."""

    def open_() -> tuple[JobRuntime, object]:
        rt = c.job_of_member(member_id)
        return rt, rt.open_stream(member_id)

    def look(rt: JobRuntime, token: object) -> tuple[int, list[Directive], bool]:
        # The version first: a change after it wakes the wait below.
        seen = rt.notifier.version
        return seen, rt.pending_directives(member_id), rt.stream_current(member_id, token)

    rt, token = await c.call(open_)
    sent: set[str] = set()
    while True:
        seen, pending, current = await c.call(look, rt, token)
        for d in pending:
            if d.directive_id not in sent:
                sent.add(d.directive_id)
                yield d
        if not current:
            return
        await rt.notifier.wait(seen)


async def resize(c: Coordinator, inp: ResizeInput) -> AsyncIterator[ResizeView]:
    """Start (or re-attach to) the resize and follow it to its final phase."""

    def look(rt: JobRuntime) -> tuple[JobRuntime, int, ResizeView]:
        seen = rt.notifier.version
        if rt.broken:
            rt = c.job(inp.job_id)
        return rt, seen, rt.resize_view(inp.decision_id)

    rt = await c.call(c.start_resize, inp)
    last: ResizeView | None = None
    while True:
        rt, seen, view = await c.call(look, rt)
        if view != last:
            last = view
            yield view
        if view.phase.final:
            return
        await rt.notifier.wait(seen)


async def watch_job(c: Coordinator, job_id: str) -> AsyncIterator[JobView]:
    def look(rt: JobRuntime) -> tuple[JobRuntime, int, JobView]:
        seen = rt.notifier.version
        if rt.broken:
            rt = c.job(job_id)
        return rt, seen, rt.status()

    rt = await c.call(c.job, job_id)
    last: JobView | None = None
    while True:
        rt, seen, view = await c.call(look, rt)
        if view != last:
            last = view
            yield view
        # Changes wake the stream at once; heartbeat progress, which does not notify, is
        # picked up on the periodic wake-up.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(rt.notifier.wait(seen), WATCH_PROGRESS_INTERVAL_S)
