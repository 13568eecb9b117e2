"""Which pod belongs to which job: the coordinator's member registry.

The ingest hot path looks pods up in two plain dicts (by uid, and by
"namespace/name"), so attribution costs one dict lookup per GPU sample. Only
ACTIVE members (in the job's current generation) are in them: a STANDBY
newcomer or a DRAINING leaver holds a GPU the job's world does not use, and
counting it would skew the job's utilization window. :class:`MemberIndex`
holds the dicts; the real registry fills it from the coordinator's WatchJob
streams, tests fill one directly (tide.services.testing.members).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from tide.base.errors import NotFound
from tide.base.retry import Backoff
from tide.services.common.clock import Clock, SystemClock

logger = logging.getLogger(__name__)

#: Streams a job's members now and after every change (the coordinator's WatchJob).
WatchFn = Callable[[str], AsyncIterator[list["Member"]]]


@dataclass(frozen=True)
class Member:
    """A pod registered as a trainer of a job."""

    pod_name: str
    pod_uid: str = ""
    active: bool = True
    # Its pod got SIGTERM and asks for a coordinated leave (docs/preemption.md).
    leave_requested: bool = False
    # When that pod's grace ends (unix seconds), if its launcher said.
    leave_deadline_s: float | None = None


class MemberRegistry(Protocol):
    """Read side used by ingestion and the policy loop."""

    #: pod uid → job id
    by_uid: dict[str, str]
    #: "namespace/name" (and the bare pod name) → job id
    by_name: dict[str, str]

    def member_count(self, job_id: str) -> int | None:
        """Members of the job in its current generation; None when unknown."""
        ...


def _namespace(job_id: str) -> str:
    ns, sep, _ = job_id.partition("/")
    return ns if sep else ""


class MemberIndex:
    """The registry as data; ``set_members`` replaces one job's members."""

    def __init__(self) -> None:
        self.by_uid: dict[str, str] = {}
        self.by_name: dict[str, str] = {}
        self._members: dict[str, tuple[Member, ...]] = {}

    def set_members(self, job_id: str, members: Iterable[Member]) -> None:
        self._drop_keys(job_id)
        ms = tuple(members)
        self._members[job_id] = ms
        ns = _namespace(job_id)
        for m in ms:
            if not m.active:
                continue
            if m.pod_uid:
                self.by_uid[m.pod_uid] = job_id
            if m.pod_name:
                self.by_name[f"{ns}/{m.pod_name}"] = job_id
                self.by_name.setdefault(m.pod_name, job_id)

    def _drop_keys(self, job_id: str) -> None:
        for m in self._members.get(job_id, ()):
            if self.by_uid.get(m.pod_uid) == job_id:
                del self.by_uid[m.pod_uid]
            for key in (f"{_namespace(job_id)}/{m.pod_name}", m.pod_name):
                if self.by_name.get(key) == job_id:
                    del self.by_name[key]

    def member_count(self, job_id: str) -> int | None:
        ms = self._members.get(job_id)
        if ms is None:
            return None
        return sum(1 for m in ms if m.active)

    def members(self, job_id: str) -> tuple[Member, ...]:
        return self._members.get(job_id, ())


class CoordinatorMemberRegistry(MemberIndex):
    """Follows the coordinator's WatchJob stream of each tracked job and mirrors
    its members. A broken stream is retried with backoff; meanwhile the last
    known members stay (a coordinator restart must not unattribute every GPU)."""

    def __init__(self, watch: WatchFn, clock: Clock | None = None) -> None:
        super().__init__()
        self._watch = watch
        self._clock = clock or SystemClock()
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def track(self, job_id: str) -> None:
        if job_id not in self._tasks:
            self._tasks[job_id] = asyncio.create_task(self._follow(job_id))

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    async def _follow(self, job_id: str) -> None:
        backoff = Backoff(0.2, 5.0)
        while True:
            try:
                async for members in self._watch(job_id):
                    backoff.reset()
                    self.set_members(job_id, members)
            except asyncio.CancelledError:
                raise
            except NotFound as exc:
                # The coordinator learns of a job when its first launcher registers: until
                # then an unknown job is the expected state, not trouble (issue 32).
                logger.debug("job %s: %s; watching again", job_id, exc, extra={"job_id": job_id})
            except Exception as exc:
                logger.warning(
                    "job %s: member watch broke (%s); retrying",
                    job_id,
                    exc,
                    extra={"job_id": job_id},
                )
            await self._clock.sleep(backoff.next_delay_s())
