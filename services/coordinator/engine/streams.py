"""The streams a member or the scaler holds open: each waits on its job's change
notifier (never polls) and yields what changed since it last looked."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from services.coordinator.domain import Directive
from services.coordinator.engine.coordinator import Coordinator
from services.coordinator.engine.messages import JobView, ResizeInput, ResizeView

#: WatchJob sends progress (steps, throughput) at most this often, seconds.
WATCH_PROGRESS_INTERVAL_S = 1.0


async def directives(c: Coordinator, member_id: str) -> AsyncIterator[Directive]:
    """The member's unacknowledged directives, each once per stream, in order; ends when
    a newer stream of the member opens, the member leaves, or its job is reloaded."""
    rt = c.job_of_member(member_id)
    token = rt.open_stream(member_id)
    sent: set[str] = set()
    while True:
        seen = rt.notifier.version
        for d in rt.pending_directives(member_id):
            if d.directive_id not in sent:
                sent.add(d.directive_id)
                yield d
        if not rt.stream_current(member_id, token):
            return
        await rt.notifier.wait(seen)


async def resize(c: Coordinator, inp: ResizeInput) -> AsyncIterator[ResizeView]:
    """Start (or re-attach to) the resize and follow it to its final phase."""
    rt = c.start_resize(inp)
    last: ResizeView | None = None
    while True:
        seen = rt.notifier.version
        if rt.broken:
            rt = c.job(inp.job_id)
        view = rt.resize_view(inp.decision_id)
        if view != last:
            last = view
            yield view
        if view.phase.final:
            return
        await rt.notifier.wait(seen)


async def watch_job(c: Coordinator, job_id: str) -> AsyncIterator[JobView]:
    rt = c.job(job_id)
    last: JobView | None = None
    while True:
        seen = rt.notifier.version
        if rt.broken:
            rt = c.job(job_id)
        view = rt.status()
        if view != last:
            last = view
            yield view
        # Changes wake the stream at once; heartbeat progress, which does not notify, is
        # picked up on the periodic wake-up.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(rt.notifier.wait(seen), WATCH_PROGRESS_INTERVAL_S)
