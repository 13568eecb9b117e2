"""The coordinator of every job: the registry of job runtimes, the indexes from member
and decision ids to jobs, the reload of a job whose commit failed, and the tick loop.

Every operation is synchronous and may write the store (with retries that wait). The
server's asyncio loop therefore never runs one itself: :meth:`Coordinator.call` hands it
to the engine's one thread and awaits it, so operations still run one at a time, in
order, and the loop stays free for health checks and every other call while a
commit waits for the store (docs/reliability.md, "Nothing blocks the event loop").
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tide.base.cpuwait import CpuWait
from tide.base.errors import Conflict, InvalidArgument, Unavailable
from tide.services.common.clock import Clock
from tide.services.coordinator.domain import JobRecord, ResizePhase
from tide.services.coordinator.engine.job import JobRuntime
from tide.services.coordinator.engine.messages import (
    AckInput,
    HeartbeatInput,
    RegisterInput,
    RegisterResult,
    ResizeInput,
)
from tide.services.coordinator.errors import UnknownJob, UnknownMember, UnknownResize
from tide.services.coordinator.metrics import CoordinatorMetrics
from tide.services.coordinator.settings import Tuning
from tide.services.coordinator.store import CoordinatorStore

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Coordinator:
    """Every job's runtime, the indexes from member and decision ids to jobs, and
    the periodic tick."""

    def __init__(
        self,
        store: CoordinatorStore,
        clock: Clock,
        tuning: Tuning,
        metrics: CoordinatorMetrics | None = None,
    ) -> None:
        self._store = store
        self._clock = clock
        self.tuning = tuning
        self.metrics = metrics or CoordinatorMetrics()
        self.jobs: dict[str, JobRuntime] = {}
        self._member_job: dict[str, str] = {}
        self._decision_job: dict[int, str] = {}
        #: Why this replica does not serve (a standby: who leads), or "" when it does.
        #: A standby answers every call UNAVAILABLE, never NOT_FOUND: launchers retry
        #: and keep their member ids instead of registering again as new members.
        self.standby = ""
        #: Whether this replica still holds its lease by its own clock (the elector's):
        #: a leader woken from a pause past its lease must not act before the elector
        #: notices. Always true without leader election.
        self.may_act: Callable[[], bool] = lambda: True
        # One thread: operations stay serial (the engine's state has no locks), and a
        # SQLite connection is used by the thread that opened it.
        self._engine_thread: ThreadPoolExecutor | None = None
        self._closed = False

    async def call(self, fn: Callable[..., T], /, *args: Any) -> T:
        """Run ``fn(*args)`` (an operation or a read of the engine's state) on the
        engine's thread and return its result; the event loop waits without blocking.
        A caller cancelled before its turn (a deadline) never runs."""
        if self._closed:
            raise Unavailable("the coordinator is shutting down: retry")
        if self._engine_thread is None:
            self._engine_thread = ThreadPoolExecutor(1, thread_name_prefix="coordinator-engine")
        ctx = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(
            self._engine_thread, functools.partial(ctx.run, fn, *args)
        )

    def close(self, *, wait: bool = False) -> None:
        """Take no more operations; the engine's thread ends once those in its queue are
        done (``wait``: block until then; never on the event loop)."""
        self._closed = True
        if self._engine_thread is not None:
            self._engine_thread.shutdown(wait=wait)

    def _serving(self) -> None:
        if self.standby:
            raise Unavailable(f"standby coordinator, {self.standby}: retry")
        if not self.may_act():
            raise Unavailable("this coordinator's lease ran out; another replica leads: retry")

    def take_over(self) -> None:
        """Elected: load every job from the store, as after a restart, and serve."""
        self.load()
        self.standby = ""

    def load(self) -> None:
        """Reload every job from the store and apply the restart rules."""
        for snap in self._store.load_all():
            self._install(
                JobRuntime.from_snapshot(snap, self._store, self._clock, self.tuning, self.metrics)
            )
        for rt in self.jobs.values():
            rt.recover_after_restart()
        logger.info("loaded %d job(s) from the store", len(self.jobs))

    def _install(self, rt: JobRuntime) -> None:
        self.jobs[rt.job.job_id] = rt
        # The job's series exist at 0 from now on, so a first loss shows as an increase.
        self.metrics.lost_steps.labels(rt.job.job_id)
        self.metrics.members_lost.labels(rt.job.job_id)
        self.metrics.restarts.labels(rt.job.job_id)
        self.metrics.jobs_failed.labels(rt.job.job_id)
        for mid in rt.members:
            self._member_job[mid] = rt.job.job_id
        for did in rt.resizes:
            self._decision_job[did] = rt.job.job_id

    def _reload(self, job_id: str) -> JobRuntime | None:
        # Read first: while the store is down this raises Unavailable and the broken
        # runtime stays, so its members' calls get UNAVAILABLE (retry) rather than
        # NOT_FOUND, which would send every launcher to register again as new members.
        snaps = self._store.load_all()
        old = self.jobs.pop(job_id, None)
        fault = old.outbox.fault if old is not None else None
        for snap in snaps:
            if snap.job.job_id == job_id:
                rt = JobRuntime.from_snapshot(
                    snap, self._store, self._clock, self.tuning, self.metrics
                )
                if isinstance(fault, Conflict):
                    # Another writer changed the job (a second coordinator): what this
                    # one knew in memory may be wrong, as after a restart.
                    rt.recover_after_restart()
                else:
                    # The store failed a commit: the same process carries on from what
                    # it stored (docs/reliability.md, "A resize survives its store").
                    rt.recover_after_store_fault(old, _first_line(fault))
                self._install(rt)
                if old is not None:
                    old.notifier.notify()  # ends streams bound to the discarded runtime
                return rt
        if old is not None:
            old.notifier.notify()
        return None

    def job(self, job_id: str, *, create: bool = False) -> JobRuntime:
        self._serving()
        rt = self.jobs.get(job_id)
        if rt is not None and rt.broken:
            rt = self._reload(job_id)
        if rt is None:
            if not create:
                raise UnknownJob(f"job {job_id!r} is not known to the coordinator")
            _validate_job_id(job_id)
            rt = JobRuntime(
                JobRecord(job_id=job_id), self._store, self._clock, self.tuning, self.metrics
            )
            self.jobs[job_id] = rt
        return rt

    def job_of_member(self, member_id: str) -> JobRuntime:
        self._serving()
        job_id = self._member_job.get(member_id)
        if job_id is None:
            raise UnknownMember(f"member {member_id!r} is not known; register first")
        return self.job(job_id)

    def member_pod(self, member_id: str) -> tuple[str, str]:
        """(job id, pod name) of a member, ("", "") for one not known: what the guard
        checks a launcher's identity against."""
        self._serving()
        job_id = self._member_job.get(member_id)
        rt = self.jobs.get(job_id) if job_id is not None else None
        m = rt.members.get(member_id) if rt is not None else None
        return (job_id or "", m.pod_name) if m is not None else ("", "")

    def register(self, inp: RegisterInput) -> RegisterResult:
        for name, value in (
            ("pod_name", inp.pod_name),
            ("host", inp.host),
            ("launcher_id", inp.launcher_id),
        ):
            if not value:
                raise InvalidArgument(f"{name}: required, got ''")
        if not 0 < inp.free_port <= 65535:
            raise InvalidArgument(f"free_port: must be in 1..65535, got {inp.free_port}")
        self._serving()
        rt = self.job(inp.job_id, create=True)
        res = rt.register(inp)
        self._member_job[res.member_id] = inp.job_id
        return res

    def heartbeat(self, inp: HeartbeatInput) -> int:
        return self.job_of_member(inp.member_id).heartbeat(inp)

    def ack(self, inp: AckInput) -> None:
        self.job_of_member(inp.member_id).ack(inp)

    def start_resize(self, inp: ResizeInput) -> JobRuntime:
        self._serving()
        owner = self._decision_job.get(inp.decision_id)
        if owner is not None and owner != inp.job_id:
            raise InvalidArgument(
                f"decision_id {inp.decision_id} belongs to job {owner}, not {inp.job_id}"
            )
        rt = self.job(inp.job_id, create=True)
        rt.start_resize(inp)
        self._decision_job[inp.decision_id] = inp.job_id
        return rt

    def abort_resize(self, decision_id: int, job_id: str, reason: str) -> ResizePhase:
        self._serving()
        owner = self._decision_job.get(decision_id)
        if owner is None or (job_id and owner != job_id):
            raise UnknownResize(f"no resize {decision_id} for job {job_id!r}")
        return self.job(owner).abort_resize(decision_id, reason)

    def tick(self, stalled_s: float = 0.0, cpu_wait_s: float = 0.0) -> None:
        """``cpu_wait_s``: how much of the stall the loop's thread was runnable but had no
        CPU (tide/base/cpuwait.py). That is a loaded machine, not a fault of this process,
        so a stall mostly made of it is told at INFO: a healthy run logs no WARNING."""
        if self.standby or not self.may_act():
            return
        if stalled_s > 0:
            starved = stalled_s - cpu_wait_s < self.tuning.tick_interval_s
            logger.log(
                logging.INFO if starved else logging.WARNING,
                "the coordinator stalled %.2f s (%.2f s of it waiting for a CPU): heartbeat "
                "timeouts and deadlines of %d job(s) moved by as much",
                stalled_s,
                cpu_wait_s,
                len(self.jobs),
            )
        for job_id in list(self.jobs):
            try:
                self.job(job_id).tick(stalled_s)
            except Unavailable as exc:
                # Every tick of an outage would log a traceback; one line says it all.
                logger.warning("tick of job %s: %s", job_id, exc, extra={"job_id": job_id})
            except Exception:
                # One job's failure (a store outage) must not stop the others' checks.
                logger.exception("tick of job %s failed", job_id, extra={"job_id": job_id})

    async def run(self) -> None:
        """Tick until cancelled, measuring how late each tick is.

        A tick more than one interval late means the loop did not run (blocked, or the
        process starved on a loaded machine); the lateness is handed to the tick, which
        does not count it against anyone. Shorter jitter is ignored."""
        interval = self.tuning.tick_interval_s
        # Opened here, on the loop's thread: thread-self is the thread that opens it.
        cpu = CpuWait()
        try:
            last, waited = self._clock.monotonic(), cpu.seconds()
            while True:
                await self._clock.sleep(interval)
                now, wait_s = self._clock.monotonic(), cpu.seconds() - waited
                late = now - last - interval
                if late > interval:
                    await self.call(self.tick, late, wait_s)
                else:
                    await self.call(self.tick)
                last, waited = self._clock.monotonic(), cpu.seconds()
        finally:
            cpu.close()


def _validate_job_id(job_id: str) -> None:
    ns, sep, name = job_id.partition("/")
    if not sep or not ns or not name or "/" in name or len(job_id) > 253:
        raise InvalidArgument(f"job_id: expected 'namespace/name', got {job_id!r}")


def _first_line(exc: BaseException | None) -> str:
    text = str(exc) if exc is not None else ""
    return text.splitlines()[0] if text else "unknown cause"
